"""A `round` command as a user runs it: vLLM vs hf, the engine start counted, at the job's own dtype.

Each measurement is the whole command `python -m unstable_dask.run round --job <job>` on a fresh
lake with `model.backend` set to one engine: cluster start, model load, the engine start (vLLM
compiles and sizes its KV cache; hf loads weights), every game, the commit. Nothing is warmed
up and `model.dtype` stays the job's (`auto`: fp32 on a CPU). The engines run in turn (A B, then
B A) so machine load hits both alike. Besides the wall time it reads the round's own line (games,
completion tokens, seconds of play) so the engine's start and its play can be told apart.

    python bench/loop/bench_user_round.py [--job jobs/smollm2-learn.toml] [--repeats 2]

Writes bench/results/user_round.json and prints markdown rows (vLLM / hf: the speed-up a user
sees from that command; above 1 means vLLM is quicker).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/inference/", "unstable_dask/play/", "unstable_dask/cluster/"]  # what bench/stale.py checks

from common import row, save  # noqa: E402

# "round 0 of run X played checkpoint base: 40 games, 310 turns, 9216 completion tokens in 26.1 s (353 tok/s on vllm ...)"
ROUND_LINE = re.compile(r"(\d+) games, (\d+) turns, (\d+) completion tokens in ([\d.]+) s")


def measure(job: str, backend: str) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="user-round-"))
    cmd = [sys.executable, "-m", "unstable_dask.run", "round", "--job", job, "--set", f'model.backend="{backend}"',
           "--set", f'run.lake="{folder / "lake"}"', "--set", f'run.reports="{folder / "reports"}"']
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t
    shutil.rmtree(folder, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"{backend}: rc {out.returncode}\n{out.stderr[-3000:]}")
    m = ROUND_LINE.search(out.stderr + out.stdout)
    if m is None:
        raise SystemExit(f"{backend}: no round line in the output\n{(out.stderr + out.stdout)[-2000:]}")
    games, turns, tokens, play_s = int(m[1]), int(m[2]), int(m[3]), float(m[4])
    return dict(wall_s=wall, games=games, turns=turns, tokens=tokens, round_s=play_s, tok_s_wall=tokens / wall)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="jobs/smollm2-learn.toml")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"vllm": [], "hf": []}
    for i in range(args.repeats):
        for backend in (["vllm", "hf"] if i % 2 == 0 else ["hf", "vllm"]):
            runs[backend].append(measure(args.job, backend))
            print(backend, json.dumps(runs[backend][-1]), flush=True)
    med = {b: {k: statistics.median(r[k] for r in v) for k in ("wall_s", "round_s", "tokens")} for b, v in runs.items()}
    ratio = med["hf"]["wall_s"] / med["vllm"]["wall_s"]
    print(row("engine", "command wall s (median)", "the round's own clock s", "completion tokens"))
    for b in runs:
        print(row(b, f"{med[b]['wall_s']:.0f}", f"{med[b]['round_s']:.0f}", f"{med[b]['tokens']:.0f}"))
    print(row("vLLM / hf (speed-up of the whole command)", f"{ratio:.2f}x", "", ""))
    path = save("user_round", {"job": args.job, "runs": runs, "median": med, "vllm_speedup_whole_command": ratio,
                               "per_run_ratios": [h["wall_s"] / v["wall_s"] for v, h in zip(runs["vllm"], runs["hf"])],
                               "load_average_1m": os.getloadavg()[0]}, settings=vars(args))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
