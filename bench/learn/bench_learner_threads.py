"""The learner inside `loop`: torch's threads in the driver while a local cluster is open.

`loop` keeps its local cluster open and runs the learner in the driver process, which imports
torch late, after the cluster's nannies have written their workers' OMP_NUM_THREADS into the
driver's environment (1 each with 2 workers on 2 cores); torch sized its pool from that, so every
learner iteration of a 2-worker local job computed on one core. The Trainer now sets torch's
threads from what the process started with (cluster.client.driver_threads).

Each measurement is a fresh interpreter that opens the job's local cluster, imports torch inside
it, builds the Trainer (CPU, the job's learn settings) and times updates on a batch shaped like
bench_learner_speed's; `before` puts the thread count torch had taken back after the Trainer is
built, `after` keeps the Trainer's. The two run in turn (A B A B) so machine load hits both alike.

    python bench/learn/bench_learner_threads.py [--job jobs/smollm2-kuhn-single.toml] [--rows 16] [--steps 2] [--repeats 2]

Writes bench/results/learner_threads.json and prints markdown rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/learn/", "unstable_dask/cluster/"]  # what bench/stale.py checks for changes since a result's commit


from common import row, save  # noqa: E402

_ONE = """
import json, sys, time
sys.path[:0] = [{root!r}, {bench!r}]
from unstable_dask.cluster.client import open_client
from unstable_dask.jobfile import load_job
job = load_job({job!r}, {{"learn.device": "cpu"}})
with open_client(job.cluster):
    import torch
    taken = torch.get_num_threads()
    from common import tictactoe_batch
    from unstable_dask.learn.trainer import Trainer
    trainer = Trainer(job, None, torch.device("cpu"))
    if {before!r}:
        torch.set_num_threads(taken)
    batch = tictactoe_batch(trainer.tokenizer, {rows})
    tokens = sum(batch["prompt_tokens"].to_pylist()) + sum(len(c) for c in batch["completion_token_ids"].to_pylist())
    trainer.update(batch, seed=0)  # warm-up
    times = []
    for s in range({steps}):
        t = time.perf_counter()
        trainer.update(batch, seed=s + 1)
        times.append(time.perf_counter() - t)
    print(json.dumps({{"threads": torch.get_num_threads(), "taken_at_import": taken, "tokens": tokens, "seconds": times}}))
"""


def measure(job: str, before: bool, rows: int, steps: int) -> dict:
    code = _ONE.format(root=str(ROOT), bench=str(ROOT / "bench"), job=job, before=before, rows=rows, steps=steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["tok_s"] = r["tokens"] / statistics.median(r["seconds"])
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="jobs/smollm2-kuhn-single.toml")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(measure(args.job, name == "before", args.rows, args.steps))
            print(name, json.dumps(runs[name][-1]), flush=True)
    tok_s = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    print(row("learner in the driver, local cluster open", "torch threads", "tok/s", "ratio"))
    for k, v in runs.items():
        print(row(k, v[0]["threads"], f"{tok_s[k]:.0f}", f"{tok_s[k] / tok_s['before']:.2f}"))
    path = save("learner_threads", {"job": args.job, "rows": args.rows, "steps": args.steps,
                                    "load_average_1m": os.getloadavg()[0], "runs": runs, "tok_s": tok_s,
                                    "after_vs_before": tok_s["after"] / tok_s["before"]}, settings=vars(args))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
