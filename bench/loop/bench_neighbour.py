"""A busy neighbour: generation and a learner update, alone and beside a CPU-bound process on one core.

Sharing one of 2 cores with another process should cost about 2x at worst (the share of the cores
lost), not an order of magnitude: `loop` on jobs/smollm2-cpu.toml (hf, 1 worker with 2 OpenMP
threads) was measured 14x slower beside one. With the threads of an OpenMP team spread over two
cores, every parallel region ends at a barrier; while a thread is descheduled by the neighbour its
peer, spinning, keeps its own core busy and waits out the whole time slice. Each measurement is a fresh interpreter with one wait-policy setting of the
environment (`variants`), that loads SmolLM2 on the hf engine and times (a) a batch of `--prompts`
TicTacToe-length prompts generated to `--tokens` tokens and (b) learner updates on a batch shaped
like the learning job's; `neighbour` runs the same beside `python -c 'while True: pass'` pinned
to core 1. Variants and conditions run in turn (A B A B) so machine load hits them alike.

    python bench/loop/bench_neighbour.py [--repeats 2] [--prompts 6] [--tokens 24] [--rows 8] [--variants A,B] [--out neighbour]

Writes bench/results/<out>.json (neighbour.json) and prints markdown rows: each condition's seconds and its
slowdown beside the neighbour (neighbour / alone, same variant).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/inference/hf.py", "unstable_dask/learn/trainer.py", "unstable_dask/cluster/client.py",
            "unstable_dask/inference/engine.py"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save  # noqa: E402

# The environment each variant adds (None: the project's own choice, i.e. what a user gets).
VARIANTS: dict[str, dict[str, str]] = {
    "libgomp default (spin 300000)": {"GOMP_SPINCOUNT": "300000"},
    "active (spin without end)": {"OMP_WAIT_POLICY": "ACTIVE"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "short spin (10000)": {"GOMP_SPINCOUNT": "10000"},
    "project default": {},  # what a user gets: the package's own setting (unstable_dask/__init__.py)
}

_ONE = """
import json, sys, time
sys.path[:0] = [{root!r}, {bench!r}]
import unstable_dask  # before torch, as in every command: the package sets the OpenMP wait policy
import torch
from common import tictactoe_batch
from unstable_dask.config import ModelConfig
from unstable_dask.inference.engine import get_engine
from unstable_dask.jobfile import load_job
from unstable_dask.learn.trainer import Trainer
job = load_job({job!r}, {{"learn.device": "cpu", "model.backend": "hf", "model.max_new_tokens": {tokens},
                         "model.temperature": 0.0}})
engine = get_engine(job.model)
rules = "You are playing Tic Tac Toe. Make valid moves to win. Choose a cell, e.g. [4]. " * 6
prompts = [engine.chat_prompt(rules + f"Game {{i}}: the opponent played [{{i % 9}}].") for i in range({prompts})]
engine.generate(prompts[:2])  # warm-up
gen = []
for _ in range(2):
    t = time.perf_counter(); out = engine.generate(prompts); gen.append(time.perf_counter() - t)
gen_tokens = sum(g.completion_tokens for g in out)
trainer = Trainer(job, None, torch.device("cpu"))
batch = tictactoe_batch(trainer.tokenizer, {rows})
trainer.update(batch, seed=0)  # warm-up
upd = []
for s in range(2):
    t = time.perf_counter(); trainer.update(batch, seed=s + 1); upd.append(time.perf_counter() - t)
print(json.dumps({{"threads": torch.get_num_threads(), "generate_s": gen, "gen_tokens": gen_tokens,
                  "update_s": upd}}))
"""


def measure(args, variant: str, neighbour: bool) -> dict:
    code = _ONE.format(root=str(ROOT), bench=str(ROOT / "bench"), job=args.job, tokens=args.tokens,
                       prompts=args.prompts, rows=args.rows)
    env = {**os.environ, **VARIANTS[variant]}
    busy = None
    if neighbour:
        busy = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {1}); exec('while True: pass')"])
        time.sleep(0.5)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600, env=env)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {**r, "generate": statistics.median(r["generate_s"]), "update": statistics.median(r["update_s"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="jobs/smollm2-cpu.toml")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="neighbour", help="bench/results/<out>.json")
    args = ap.parse_args()
    names = args.variants.split(",")
    runs: dict[str, dict[str, list[dict]]] = {v: {"alone": [], "neighbour": []} for v in names}
    for _ in range(args.repeats):
        for v in names:
            for cond in ("alone", "neighbour"):
                runs[v][cond].append(measure(args, v, cond == "neighbour"))
                print(v, cond, json.dumps(runs[v][cond][-1]), flush=True)
    summary = {}
    print(row("wait policy", "generate alone s", "beside neighbour s", "slowdown", "update alone s",
              "beside neighbour s", "slowdown"))
    for v in names:
        m = {c: {k: statistics.median(r[k] for r in runs[v][c]) for k in ("generate", "update")} for c in runs[v]}
        summary[v] = {**m, "generate_slowdown": m["neighbour"]["generate"] / m["alone"]["generate"],
                      "update_slowdown": m["neighbour"]["update"] / m["alone"]["update"]}
        print(row(v, f"{m['alone']['generate']:.2f}", f"{m['neighbour']['generate']:.2f}",
                  f"{summary[v]['generate_slowdown']:.2f}x", f"{m['alone']['update']:.2f}",
                  f"{m['neighbour']['update']:.2f}", f"{summary[v]['update_slowdown']:.2f}x"))
    path = save(args.out, {"job": args.job, "variants": {v: VARIANTS[v] for v in names}, "runs": runs,
                              "summary": summary, "load_average_1m": os.getloadavg()[0]}, settings=vars(args))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
