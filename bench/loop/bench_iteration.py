"""Where a lock-step `loop` iteration's seconds go: the fixed cost of a learner iteration (dispatch,
model load, batch query, adapter save, commit, engine sleep/wake) against its optimizer steps, and
the round, rate and report around it.

Runs `loop --rounds R` of a job (default: the default job, builtin:tiny on hf) from an empty lake,
with rate and report on, as a user runs it. Per learner iteration, from the lake: the phases in
learner_steps.metrics (time_model_load_s, time_batch_query_s, time_save_s, time_dispatch_s,
time_engine_swap_s) and the steps' own step_time_s; the commit's seconds from the LearnResult (the
steps file is part of that commit); the round, learn, rate and report seconds from the loop's
one-line breakdown. The loop's critical path per iteration is the time between consecutive
checkpoint commits (round + learn + whatever the loop waits for in between), which also holds for a
loop that prints no breakdown (the before figure of docs/benchmarks/iteration.md).

    python bench/loop/bench_iteration.py [--job jobs/smollm2-learn.toml] [--rounds 3] [--name iteration]
    python bench/loop/bench_iteration.py --job jobs/smollm2-cpu.toml --resident never auto --name iteration-resident

`--resident A B`: the loop once per learn.resident setting, in turn from empty lakes, the fixed cost
per iteration compared from iteration 2 on (the first has nothing kept and imports the learner).

Writes bench/results/<name>.json and prints markdown rows.
"""
from __future__ import annotations

import argparse
import atexit
import io
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/learn/", "unstable_dask/lake/", "unstable_dask/rate/", "unstable_dask/report/",
            "unstable_dask/play/", "unstable_dask/loop.py"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.loop import loop

from common import row, save

FIXED = ("time_dispatch_s", "time_model_load_s", "time_batch_query_s", "time_save_s", "time_engine_swap_s")
LINE = re.compile(r"iteration (\d+): (?:round ([\d.]+) s, )?learn ([\d.]+) s .*?(?:, rate ([\d.]+) s)?(?:, report ([\d.]+) s)?$")


def run_once(job_path: str | None, rounds: int, resident: str | None = None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="iteration"))
    atexit.register(shutil.rmtree, tmp, True)
    overrides = {"run.lake": str(tmp / "lake"), "run.reports": str(tmp / "reports")}
    job = load_job(job_path, overrides | ({"learn.resident": resident} if resident else {}))
    out = io.StringIO()
    t0 = time.time()
    results = loop(job, rounds=rounds, console=Console(file=out, width=400), rate=True)
    wall = time.time() - t0
    con = Lake(job.run.lake).connect()
    try:
        steps = con.sql("SELECT iteration, step_time_s, map_entries(metrics) FROM learner_steps WHERE run = ? "
                        "ORDER BY iteration, update", params=[job.run.name]).fetchall()
        commits = [c.timestamp() for (c,) in con.sql("SELECT created_at FROM checkpoints WHERE run = ? ORDER BY iteration",
                                                     params=[job.run.name]).fetchall()]
    finally:
        con.close()
    commit_s = {r.iteration: r.timings.get("time_commit_s") for r in results if not r.skipped}
    its: dict[int, dict] = {}
    for it, step_s, metrics in steps:
        m = {e["key"]: e["value"] for e in metrics}
        d = its.setdefault(it, dict(iteration=it, steps_s=0.0, **{k: m.get(k) for k in FIXED}))
        d["steps_s"] += step_s or 0.0
    for it, d in its.items():
        d["time_commit_s"] = commit_s.get(it)
        known = [d[k] for k in (*FIXED, "time_commit_s")]
        d["fixed_s"] = sum(known) if None not in known else None  # None: a loop that records no phases
    for line in out.getvalue().splitlines():
        if (m := LINE.search(line.strip())) and int(m[1]) in its:
            its[int(m[1])].update(round_s=_f(m[2]), learn_s=_f(m[3]), rate_s=_f(m[4]), report_s=_f(m[5]))
    gaps = [b - a for a, b in zip(commits, commits[1:])]  # iteration k-1's commit to k's: one loop iteration
    return dict(rounds=rounds, wall_s=wall, iterations=list(its.values()), critical_path_s=gaps,
                critical_path_mean_s=statistics.mean(gaps) if gaps else None, log=out.getvalue()[-4000:])


def _f(v: str | None) -> float | None:
    return None if v is None else float(v)


def _mean(its: list[dict], key: str) -> float | None:
    vals = [d.get(key) for d in its]
    return statistics.mean(v for v in vals if v is not None) if any(v is not None for v in vals) else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default=None, help="a job file; default: the default job (builtin:tiny, hf)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="iteration", help="the result's name under bench/results/")
    ap.add_argument("--resident", nargs="+", default=None, choices=["auto", "always", "never"],
                    help="one loop per learn.resident setting, in turn (default: the job's own)")
    args = ap.parse_args()
    keys = ("fixed_s", "steps_s", *FIXED, "time_commit_s", "round_s", "learn_s", "rate_s", "report_s")
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(row(*["job", "learn.resident", "wall s", "loop iteration s", "fixed s/iteration", "steps s/iteration", "load",
               "query", "save", "commit", "round", "learn", "rate", "report"]))
    data: dict = {}
    for setting in args.resident or [None]:
        r = run_once(args.job, args.rounds, setting)
        its = r["iterations"]
        summary = {k: _mean(its, k) for k in keys}
        later = {k: _mean(its[1:], k) for k in keys}  # what a kept base can change: iterations 2..R
        data[setting or "job"] = dict(run=r, mean=summary, mean_from_iteration_2=later)
        print(row(*[args.job or "default", setting or "(job)", fmt(r["wall_s"]), fmt(r["critical_path_mean_s"]),
                   *(fmt(summary[k]) for k in ("fixed_s", "steps_s", "time_model_load_s", "time_batch_query_s",
                                               "time_save_s", "time_commit_s", "round_s", "learn_s", "rate_s",
                                               "report_s"))]))
    if len(data) == 2:  # the second setting against the first, iterations 2..R
        (a, ra), (b, rb) = data.items()
        ratio = {k: rb["mean_from_iteration_2"][k] / ra["mean_from_iteration_2"][k]
                 for k in ("fixed_s", "time_model_load_s", "learn_s")
                 if ra["mean_from_iteration_2"][k] and rb["mean_from_iteration_2"][k] is not None}
        data["ratio"] = dict(of=f"{b} / {a}", **ratio)
        print(f"{b} / {a}, iterations 2..{args.rounds}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    save(args.name, data if args.resident else data["job"], settings=vars(args))


if __name__ == "__main__":
    main()
