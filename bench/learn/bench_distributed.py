"""Data-parallel learner updates (learn.devices): the step time of 1 process against 2 gloo ranks on
the same batch, on CPU, and a projection for N GPUs from the measured compute/communication split.

Each variant times `--updates` updates of a fresh Trainer (builtin model, CPU, fp32) on one
synthetic batch (common.tictactoe_batch) after one warm-up update:
  one-2t   one process, 2 torch threads (what `learn` runs on this machine today)
  one-1t   one process, 1 thread (a rank's share of a 2-core machine: the compute a rank does alone)
  two      2 ranks (learn/distributed.py's group: gloo over TCP on 127.0.0.1), 1 thread each, the
           batch's micro-batches dealt between them; the time inside torch.distributed's
           collectives is measured on each rank (it includes waiting for the slower rank)
and the bare all-reduce of the adapter's gradient (its size, 20 repeats after a barrier): the
communication a step cannot avoid.

On 2 cores, 2 ranks cannot beat one 2-thread process: the same cores do the same matmuls (smaller
ones), plus the all-reduce and a duplicated tokenization; the figure is the cost of the machinery.
The projection takes the measured compute per step as dividing by N (micro-batches dealt evenly:
at most batch_size / mini_batch_size ranks do work) plus a ring all-reduce of the adapter's
gradient at an assumed bus bandwidth, latency per collective included.

    python bench/learn/bench_distributed.py [--model builtin:tiny] [--rows 16] [--micro 2] [--updates 3]

Writes bench/results/distributed.json and prints markdown rows.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
MEASURES = ["unstable_dask/learn/"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save  # noqa: E402

# One variant in a fresh interpreter: torch's thread count is fixed per process.
_RANK = """
import json, sys, time
sys.path[:0] = [{root!r}, {bench!r}]
import torch
torch.set_num_threads({threads})
import torch.distributed as dist
from common import tictactoe_batch
from unstable_dask.jobfile import validate_job
from unstable_dask.learn import distributed
from unstable_dask.learn.trainer import Trainer
job = validate_job({{"model": {{"base": {model!r}, "lora": {{"rank": 8, "alpha": 16}}}},
                    "learn": {{"batch_size": {rows}, "mini_batch_size": {micro}, "device": "cpu", "dtype": "float32",
                              "gradient_checkpointing": False, "lr": 1e-4}}}})
comm = [0.0]
def timed(fn):
    def inner(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        comm[0] += time.perf_counter() - t
        return out
    return inner
dist.all_reduce, dist.all_gather_object = timed(dist.all_reduce), timed(dist.all_gather_object)
def work():
    trainer = Trainer(job, None, torch.device("cpu"))
    torch.set_num_threads({threads})  # the Trainer sets the driver's count; this variant's is the point
    batch = tictactoe_batch(trainer.tokenizer, {rows})
    trainer.update(batch, seed=0)  # warm-up
    comm[0], steps = 0.0, []
    for u in range({updates}):
        t = time.perf_counter()
        trainer.update(batch, seed=u + 1)
        steps.append(time.perf_counter() - t)
    out = dict(step_s=steps, comm_s=comm[0] / {updates}, threads=torch.get_num_threads())
    if {n} > 1:
        grad = torch.zeros(sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad))
        dist.barrier()
        t = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(grad)
        out.update(bare_allreduce_s=(time.perf_counter() - t) / 20, grad_bytes=grad.numel() * 4)
    return out
if {n} > 1:
    with distributed.joined({rank}, {n}, "127.0.0.1", {port}, "cpu"):
        out = work()
else:
    out = work()
print("RESULT" + json.dumps(out))
"""


def variant(args, n: int, threads: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK.format(
        root=str(ROOT), bench=str(ROOT / "bench"), threads=threads, model=args.model, rows=args.rows,
        micro=args.micro, updates=args.updates, n=n, rank=r, port=port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) for r in range(n)]
    outs = []
    for p in procs:
        text, _ = p.communicate(timeout=1800)
        line = next((x for x in text.splitlines() if x.startswith("RESULT")), None)
        if line is None:
            raise SystemExit(f"a rank of the {n}-rank variant failed (exit {p.returncode})")
        outs.append(json.loads(line[len("RESULT"):]))
    return outs


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def project(compute_s: float, grad_bytes: int, micro_batches: int, bus_gbps: float, latency_s: float,
            collectives: int) -> list[dict]:
    """Step time on N devices: compute / min(N, micro-batches) + a ring all-reduce, 2 (N-1)/N of the
    gradient's bytes over the bus, plus a latency per collective."""
    out = []
    for n in (1, 2, 4, 8, 16):
        comm = 0.0 if n == 1 else 2 * (n - 1) / n * grad_bytes / (bus_gbps * 1e9) + collectives * latency_s
        step = compute_s / min(n, micro_batches) + comm
        out.append(dict(devices=n, step_s=step, comm_share=comm / step, speedup=compute_s / step))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--bus-gbps", type=float, default=100.0, help="assumed NCCL all-reduce bus bandwidth, GB/s")
    ap.add_argument("--latency-us", type=float, default=30.0, help="assumed latency of one NCCL collective, us")
    ap.add_argument("--gpu-step-s", type=float, default=1.3,
                    help="a measured 1-GPU update step (SmolLM2-135M on an H200, ~10k tokens: 1.3-2.6 s, issue 50)")
    ap.add_argument("--gpu-grad-mib", type=float, default=18.6,
                    help="the GPU job's adapter gradient (SmolLM2-135M, LoRA rank 16 on its 7 projections: 4.9M fp32)")
    ap.add_argument("--gpu-micro-batches", type=int, default=8, help="micro-batches in one GPU step (ranks with work)")
    args = ap.parse_args()

    one2 = variant(args, 1, 2)[0]
    one1 = variant(args, 1, 1)[0]
    two = variant(args, 2, 1)
    t_one2, t_one1 = median(one2["step_s"]), median(one1["step_s"])
    t_two = max(median(r["step_s"]) for r in two)  # a step ends when the slower rank's does
    comm = max(r["comm_s"] for r in two)
    bare = max(r["bare_allreduce_s"] for r in two)
    grad_bytes = two[0]["grad_bytes"]
    micro_batches = -(-args.rows // args.micro)
    collectives = 2  # reduce_step: the gradient and the metric sums (plus one gather a batch)
    figures = dict(
        one_process_2_threads_step_s=t_one2, one_process_1_thread_step_s=t_one1, two_ranks_step_s=t_two,
        two_ranks_over_one_process=t_two / t_one2, two_ranks_over_one_thread=t_two / t_one1,
        collective_s_per_step=comm, collective_share=comm / t_two, bare_allreduce_s=bare, grad_bytes=grad_bytes,
        ranks=two, one_2t=one2, one_1t=one1,
        # compute per step on 1 device, from this machine: the 1-thread process less nothing (no comm)
        # CPU: this machine's 1-thread compute, its measured all-reduce as the bandwidth (bytes / time)
        projection_cpu=project(t_one1, grad_bytes, micro_batches, grad_bytes / max(bare, 1e-9) / 1e9, 0.0, 0),
        projection_gpu=project(args.gpu_step_s, int(args.gpu_grad_mib * 2**20), args.gpu_micro_batches, args.bus_gbps,
                               args.latency_us * 1e-6, collectives))
    path = save("distributed", figures, settings=vars(args))
    print(row("variant", "step s", "vs 1 process (2 threads)", "collectives s/step"))
    print(row("1 process, 2 threads", f"{t_one2:.3f}", "1.00", "-"))
    print(row("1 process, 1 thread", f"{t_one1:.3f}", f"{t_one1 / t_one2:.2f}", "-"))
    print(row("2 gloo ranks, 1 thread each", f"{t_two:.3f}", f"{t_two / t_one2:.2f}", f"{comm:.4f} ({comm / t_two:.0%})"))
    print(f"bare all-reduce of the gradient ({grad_bytes / 2**20:.2f} MiB): {bare * 1e3:.2f} ms")
    print(row("GPUs", "projected step s", "speedup", "comm share"))
    for p in figures["projection_gpu"]:
        print(row(p["devices"], f"{p['step_s']:.3f}", f"{p['speedup']:.2f}", f"{p['comm_share']:.1%}"))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
