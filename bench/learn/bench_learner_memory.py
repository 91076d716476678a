"""What `learn.gradient_checkpointing` (every job's default) saves in memory, and what it costs in time.

One learner update on rows of `--repeat` copies of a rules text (10: ~430 tokens a row, between the
TicTacToe learning job's ~314 and the Kuhn jobs' ~570; micro-batches of `--micro` rows), with and without checkpointing, each in a fresh process
(so one variant's allocations cannot hide the other's) and in turn (A B A B). A process builds its
Trainer (model and adapter resident), resets the kernel's high-water mark of its resident memory
(`/proc/self/clear_refs`, Linux: loading's transient peak is not the learner's) and makes two
updates (the first also makes the optimizer state): the updates' peak is that mark minus the memory
resident before them. The allocator keeps freed activations for reuse, so the process's memory
stays near that peak between updates.

    python bench/learn/bench_learner_memory.py [--rows 32] [--micro 8] [--repeat 10] [--dtype auto] [--runs 2] [--name learner_memory]

Writes bench/results/<name>.json and prints markdown rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/learn/"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save, tictactoe_batch


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(args: argparse.Namespace) -> None:
    import torch

    from unstable_dask.jobfile import validate_job
    from unstable_dask.learn.trainer import Trainer
    job = validate_job({"model": {"base": args.model, "max_new_tokens": 48},
                        "learn": {"batch_size": args.rows, "mini_batch_size": args.micro, "lr": 1e-6,
                                  "gradient_checkpointing": args.checkpointing, "dtype": args.dtype}})
    trainer = Trainer(job, None, torch.device("cpu"))
    batch = tictactoe_batch(trainer.tokenizer, args.rows, repeat=args.repeat)
    resident = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    trainer.update(batch)
    stats = trainer.update(batch)
    peak = _status_kib("VmHWM")
    tokens = trainer.batch(batch).tokens
    print(json.dumps({"resident_mib": resident / 1024, "peak_mib": peak / 1024,
                      "update_peak_mib": (peak - resident) / 1024, "tokens_per_s": stats["tokens_per_s"],
                      "row_tokens": float(tokens.attention_mask.sum(-1).float().mean()),
                      "dtype": str(trainer.dtype)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=10, help="copies of the rules text in each prompt (10: ~430-token rows)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--name", default="learner_memory")
    ap.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.checkpointing = args.child == "on"
        child(args)
        return
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.runs):
        for variant in runs:  # A B A B: load drift hits both alike
            cmd = [sys.executable, __file__, "--child", variant] + [
                f"--{k}={getattr(args, k)}" for k in ("rows", "micro", "repeat", "dtype", "model")]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("resident_mib", "peak_mib", "update_peak_mib", "tokens_per_s")}
           for v, rs in runs.items()}
    res = dict(model=args.model, rows=args.rows, micro_batch=args.micro, dtype=args.dtype,
               row_tokens=runs["on"][0]["row_tokens"], learner_dtype=runs["on"][0]["dtype"], runs=runs, median=med,
               update_peak_on_vs_off=med["on"]["update_peak_mib"] / med["off"]["update_peak_mib"],
               process_peak_on_vs_off=med["on"]["peak_mib"] / med["off"]["peak_mib"],
               speed_on_vs_off=med["on"]["tokens_per_s"] / med["off"]["tokens_per_s"])
    save(args.name, res, settings=vars(args))
    print(row("gradient checkpointing", "resident MiB", "update's peak above it, MiB", "process peak MiB", "tok/s"))
    for v in runs:
        m = med[v]
        print(row(v, f"{m['resident_mib']:.0f}", f"{m['update_peak_mib']:.0f}", f"{m['peak_mib']:.0f}", f"{m['tokens_per_s']:.0f}"))
    print(row("on / off", "", f"{res['update_peak_on_vs_off']:.2f}", f"{res['process_peak_on_vs_off']:.2f}",
              f"{res['speed_on_vs_off']:.2f}"))


if __name__ == "__main__":
    main()
