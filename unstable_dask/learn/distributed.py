"""Data-parallel learner updates over N Dask workers (`learn.devices = N`), with torch.distributed.

Each of N workers runs the learn job's update as one rank (learner._train inside `rank_task`):
the same LoRA adapter and AdamW state (the parent checkpoint's, or the same seeded init) and the
same batch (a pure function of the plan's lake snapshot, the SQL and the batch seed: every rank runs
the query itself). An optimizer step's micro-batches (passes.plan) are dealt round-robin to the
ranks (`shard`). Every micro-batch's loss is already its share of the whole step's loss
(passes.aggregate divides by the step's rows or tokens, not the micro-batch's), so the SUM over
ranks of their accumulated gradients is the one-process gradient, up to float summation order.
`reduce_step` sums it (and the step's metric sums) over the ranks before the gradient is clipped:
the clip sees the global norm, and every rank takes the same AdamW step. The engine/learner
mismatch record is gathered (`gather_mismatch`), so learner_steps and the max_logp_gap guard read
the whole batch on every rank: the same decision everywhere, no rank left waiting for one that
stopped. Dropout (model.lora.dropout > 0) draws other masks on other ranks: equal in law only.

Rendezvous: rank 0's worker host and a free port on it (tcp:// init), gloo on CPU and NCCL on
CUDA, with a timeout. A rank whose worker dies closes its sockets: gloo fails its peers at once
(measured: ~1 s). A rank that raises destroys its group, but in the learn flow its peers were seen
to wait for learn.collective_timeout_s all the same (its retained traceback seems to keep the group
alive: the frames are cleared before the group is destroyed); a rank that hangs fails them after
that timeout (the rendezvous too: a rank may first wait for its worker's GPU, held by a round task
of an overlapped loop, and load the base model).
The driver then raises one error naming every failed rank. Rank 0 alone saves the adapter and
commits, after every rank finished every update on identical weights (`finished`); a failure
before that commits nothing.

torch is imported inside functions: algorithm files import this module, and loading a job reads
their Config without importing torch.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, TypeVar

from unstable_dask.errors import JobError

if TYPE_CHECKING:
    import torch

    from unstable_dask.config import Job
    from unstable_dask.learn.passes import Mismatch

T = TypeVar("T")

# After the first failed rank, how long the driver waits for the others to fail too (gloo: ~1 s once they reach a collective); the error names those that failed by then.
GRACE_S = 10.0
# The failure path's test hook: "<rank>:raise" or "<rank>:exit" in a worker's environment makes
# that rank raise, or exit its process, at its first gradient all-reduce (mid-update).
FAULT_ENV = "UNSTABLE_DASK_LEARN_FAULT"


@dataclass
class Ranks:
    rank: int
    world: int
    device: Any  # torch.device the collectives' buffers live on (cuda for NCCL)


_ranks: Optional[Ranks] = None  # this process's group while a rank task runs; None: one process


def world() -> int:
    return _ranks.world if _ranks else 1


def shard(items: Sequence[T]) -> list[T]:
    """This rank's share of a step's micro-batches (round-robin: steps sort rows by length, so
    each rank gets short and long ones); all of them in one process."""
    return list(items) if _ranks is None else list(items[_ranks.rank::_ranks.world])


def reduce_step(optimizer: "torch.optim.Optimizer", sums: dict[str, float]) -> dict[str, float]:
    """The step's gradient and metric sums, summed over the ranks (before clip and step); `sums`
    unchanged in one process. A parameter without a gradient on every rank keeps none (AdamW
    skips it, as one process does)."""
    if _ranks is None:
        return sums
    import torch
    import torch.distributed as dist
    _fault(_ranks.rank)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads]).to(_ranks.device)
    small = torch.tensor([float(p.grad is not None) for p in params] + list(sums.values()),
                         dtype=torch.float64, device=_ranks.device)
    dist.all_reduce(flat)
    dist.all_reduce(small)
    at = 0
    for p, had in zip(params, small[:len(params)].tolist()):
        n = p.numel()
        p.grad = flat[at:at + n].view_as(p).to(p.device, p.dtype).clone() if had else None
        at += n
    return dict(zip(sums, small[len(params):].tolist()))


def share_rows(owned: Sequence[int], *tensors: "torch.Tensor") -> None:
    """Fill each tensor's rows (dim 0) with the values of the rank that owns them: every row is
    owned by exactly one rank (a micro-batch of this rank's `shard`), the others hold zeros there."""
    if _ranks is None:
        return
    import torch
    import torch.distributed as dist
    for t in tensors:
        keep = torch.zeros(t.shape[0], dtype=t.dtype)
        keep[list(owned)] = 1
        buf = (t * keep.view(-1, *([1] * (t.dim() - 1)))).to(_ranks.device)
        dist.all_reduce(buf)
        t.copy_(buf.to(t.device))


def gather_mismatch(mismatch: "Mismatch") -> None:
    """Every rank's mismatch record (learn/passes.py) joined into each rank's, in rank order."""
    if _ranks is None:
        return
    import torch
    import torch.distributed as dist

    def cat(parts: list) -> "torch.Tensor":
        return torch.cat(parts) if parts else torch.zeros(0)
    mine = (cat(mismatch.gaps), cat(mismatch.raw), cat(mismatch.fresh_gaps), mismatch.outside, mismatch.tokens,
            mismatch.entropy_sum)
    every: list = [None] * _ranks.world
    dist.all_gather_object(every, mine)
    mismatch.gaps, mismatch.raw, mismatch.fresh_gaps = ([e[i] for e in every] for i in range(3))
    mismatch.outside, mismatch.tokens = sum(e[3] for e in every), sum(e[4] for e in every)
    mismatch.entropy_sum = sum(e[5] for e in every)


def finished(trainer: Any) -> bool:
    """Every rank has finished every update (a collective: a rank that failed fails it) on the same
    weights; True on rank 0, the one that saves and commits (and in one process)."""
    if _ranks is None:
        return True
    import torch
    import torch.distributed as dist
    modules = [trainer.policy] + ([trainer.critic] if trainer.critic is not None else [])
    mine = torch.tensor([float(sum(p.detach().double().sum() for p in m.parameters() if p.requires_grad))
                         for m in modules], dtype=torch.float64, device=_ranks.device)
    every = [torch.zeros_like(mine) for _ in range(_ranks.world)]
    dist.all_gather(every, mine)
    if any(not torch.equal(e, every[0]) for e in every):  # a bug, never float noise: all ranks step alike
        raise RuntimeError(f"data-parallel ranks diverged: adapter weight sums {[e.tolist() for e in every]}")
    return _ranks.rank == 0


@contextlib.contextmanager
def joined(rank: int, n: int, host: str, port: int, device: str, timeout_s: float) -> Iterator[None]:
    """This process as rank `rank` of `n` for the block; the group is closed however it ends (a
    raising rank thereby fails its peers' collectives at once instead of after learn.collective_timeout_s)."""
    global _ranks
    import torch
    import torch.distributed as dist
    dev = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(0)  # a worker sees its own GPU(s); the rank computes on the first
        dev = torch.device("cuda", 0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://{_url_host(host)}:{port}",
                            rank=rank, world_size=n, timeout=datetime.timedelta(seconds=timeout_s))
    _ranks = Ranks(rank, n, dev)
    try:
        yield
    except BaseException as e:
        # The traceback's frames hold tensors and work handles of the group, which keep its
        # sockets open after destroy_process_group: let them go so peers fail now.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        _ranks = None
        dist.destroy_process_group()


def rank_task(train: Callable, job: "Job", lake: Any, p: Any, device: str, rank: int, n: int, host: str,
              port: int) -> Any:
    """One rank's Dask task: the learn job's update (`train`: learner._train) inside the group."""
    with joined(rank, n, host, port, device, job.learn.collective_timeout_s):
        return train(job, lake, p, device)


def devices_error(job: "Job", has: str) -> JobError:
    """The one message for a learn.devices the cluster cannot provide."""
    n = job.learn.devices
    return JobError(f"{job.source}: key 'learn.devices' has value {n}: the cluster has {has}; a data-parallel "
                    f"update needs one worker per device (at most that many, or a larger cluster)")


def check_job(job: "Job") -> None:
    """At job load: learn.devices within cluster.n_workers where that is the worker count."""
    c = job.cluster
    if job.learn.devices > 1 and c.kind in ("local", "local-gpu") and job.learn.devices > c.n_workers:
        raise devices_error(job, f"cluster.n_workers = {c.n_workers} worker(s) (cluster.kind {c.kind!r})")


def run(job: "Job", lake: Any, p: Any, device: str, train: Callable, client: Any = None) -> Any:
    """The update on learn.devices workers of `client` (or of a cluster opened from job.cluster);
    returns rank 0's result (learner.LearnResult). Raises before any work when the cluster has too
    few workers (GPU workers when the update runs on CUDA)."""
    if client is None:
        from unstable_dask.cluster.client import open_client
        with open_client(job.cluster) as own:
            return run(job, lake, p, device, train, own)
    from distributed.comm import get_address_host

    from unstable_dask.cluster.client import task_resources
    n = job.learn.devices
    resources = task_resources(job.cluster, client) if device == "cuda" else None
    addrs = _workers(job, client, resources)[:n]
    host = get_address_host(addrs[0])
    port = client.run(_free_port, workers=[addrs[0]])[addrs[0]]
    stamp = time.time_ns()  # a fresh key per attempt: a failed attempt's futures are never reused
    futures = [client.submit(rank_task, train, job, lake, p, device, r, n, host, port, workers=[a],
                             allow_other_workers=False, resources=resources, pure=False,
                             key=f"learn-{p.run_name}-{p.uid}-rank{r}-{stamp}")
               for r, a in enumerate(addrs)]
    return _gather(job, client, futures, addrs)


def _workers(job: "Job", client: Any, resources: Optional[dict]) -> list[str]:
    """Addresses of the workers that can hold a rank, at least learn.devices of them, else JobError.
    A batch-scheduler cluster gets cluster.death_timeout for its workers to arrive."""
    from unstable_dask.cluster.client import JOBQUEUE_KINDS
    n, gpus = job.learn.devices, (resources or {}).get("GPU", 0)

    def able() -> list[str]:
        return sorted(a for a, res in _resources(client).items() if res.get("GPU", 0) >= gpus)
    deadline = time.monotonic() + (job.cluster.death_timeout if job.cluster.kind in JOBQUEUE_KINDS else 0)
    while len(able()) < n and time.monotonic() < deadline:
        time.sleep(1.0)
    have = able()
    if len(have) < n:
        what = "GPU worker(s)" if gpus else "worker(s)"
        raise devices_error(job, f"{len(have)} {what} (cluster.kind {job.cluster.kind!r})")
    return have


def _gather(job: "Job", client: Any, futures: list, addrs: list[str]) -> Any:
    """Rank 0's result once every rank finished; else one error naming every failed rank."""
    from distributed import as_completed
    for f in as_completed(futures):
        if f.status != "finished":
            break
    else:
        return futures[0].result()
    deadline = time.monotonic() + GRACE_S  # the peers fail in turn (their group is broken)
    while True:
        alive = set(_resources(client))
        if time.monotonic() > deadline or all(f.done() or a not in alive for f, a in zip(futures, addrs)):
            break  # a dead worker's task is never done: Dask waits for a worker it was pinned to
        time.sleep(0.2)
    failures, user, first = [], None, None
    for r, (f, a) in enumerate(zip(futures, addrs)):
        if a not in alive:
            failures.append(f"rank {r}'s worker {a} died")
        elif f.status == "error":
            e = f.exception()
            user = user or (e if isinstance(e, JobError) else None)
            first = first or e
            failures.append(f"rank {r} on {a}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        elif not f.done():
            failures.append(f"rank {r} on {a}: not failed yet, cancelled")
    for f in futures:
        f.cancel()
    if user is not None:  # every rank reached the same verdict on the same batch (e.g. a guard)
        raise user
    raise JobError(f"{job.source}: learn.devices = {job.learn.devices}: the data-parallel update failed, nothing was "
                   f"committed ({'; '.join(failures)})") from first


def _resources(client: Any) -> dict[str, dict]:
    """{address: resources} of the workers the scheduler knows now (asked, never a cached copy)."""
    return client.run_on_scheduler(lambda dask_scheduler: {a: dict(w.resources) for a, w in dask_scheduler.workers.items()})


def _free_port() -> int:
    """A TCP port free on this worker's host now (rank 0 binds it for the rendezvous next)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _fault(rank: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    target, _, mode = spec.partition(":")
    if spec and target == str(rank):
        if mode == "exit":
            os._exit(17)
        raise RuntimeError(f"{FAULT_ENV}={spec}: rank {rank} failed on purpose")
