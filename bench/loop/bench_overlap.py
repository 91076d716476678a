"""The overlapped loop (learn.max_staleness = 1) vs the lock-step loop (0) on the same job, and a
projection of the speed-up for N GPU workers + 1 learner GPU.

Each repeat runs `loop --rounds R` from an empty lake twice, lock-step then overlapped (A B A B
over repeats, so drift in machine load hits both). Per run, from the lake: rounds per hour, the
workers' busy share of the run's wall time (report/timeline.py: the union of each worker's games),
the learner's busy share (its updates' step_time_s), and the staleness the learner saw
(learner_steps.staleness_max, which must stay <= the bound).

The projection models one loop iteration from the lock-step run's own measured times: G = a
round's generation wall time on this machine's workers, L = one learner iteration. With N engine
workers (each as fast as one here, games split evenly) and a learner GPU of its own, lock-step
takes G/N + L per iteration and the overlapped loop max(G/N, L) (staleness 1: the round plays
while the previous round trains). Assumptions: no speed-up of G beyond the split, L constant,
commits free. Published figures for comparison: AReaL 2.77x, verl's fully async mode 2.35-2.67x.

    python bench/loop/bench_overlap.py [--job jobs/demo.toml] [--rounds 4] [--repeats 2]

Writes bench/results/overlap.json and prints markdown rows.
"""
from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/play/", "unstable_dask/inference/", "unstable_dask/learn/", "unstable_dask/lake/", "unstable_dask/cluster/", "unstable_dask/loop.py", "unstable_dask/run.py", "unstable_dask/cli.py"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.loop import loop
from unstable_dask.report.timeline import timeline, union_seconds

from common import row, save


def run_once(job_path: str, rounds: int, staleness: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="overlap"))
    atexit.register(shutil.rmtree, tmp, True)  # its lake: ~50 MB a run
    job = load_job(job_path, {"run.lake": str(tmp / "lake"), "run.reports": str(tmp / "reports"),
                              "learn.max_staleness": staleness})
    t0 = time.time()
    loop(job, rounds=rounds, console=Console(quiet=True), rate=False)
    wall = time.time() - t0
    con = Lake(job.run.lake).connect()
    try:
        busy = timeline(con, job.run.name)
        learner = [(t.timestamp() - s, t.timestamp()) for t, s in con.sql(
            "SELECT created_at, step_time_s FROM learner_steps WHERE run = ?", params=[job.run.name]).fetchall()]
        games = con.sql("SELECT worker, started_at, finished_at FROM games WHERE run = ?", params=[job.run.name]).fetchall()
        stale = con.sql("SELECT max(staleness_max) FROM learner_steps WHERE run = ?", params=[job.run.name]).fetchall()[0][0]
    finally:
        con.close()
    lo, hi = t0, t0 + wall
    workers: dict[str, list] = {}
    for w, a, b in games:
        workers.setdefault(w, []).append((a.timestamp(), b.timestamp()))
    return dict(staleness=staleness, rounds=rounds, wall_s=wall, rounds_per_hour=3600 * rounds / wall,
                worker_busy=statistics.mean(union_seconds(iv, lo, hi) / wall for iv in workers.values()),
                learner_busy=union_seconds(learner, lo, hi) / wall, staleness_max=stale,
                round_wall_s=statistics.mean(t["wall_s"] for t in busy),
                learner_s=sum(b - a for a, b in learner) / max(len(learner), 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="jobs/demo.toml")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    runs: dict[int, list[dict]] = {0: [], 1: []}
    for _ in range(args.repeats):
        for k in (0, 1):
            runs[k].append(run_once(args.job, args.rounds, k))
    ratio = statistics.median(o["rounds_per_hour"] / s["rounds_per_hour"] for s, o in zip(runs[0], runs[1]))
    g = statistics.median(r["round_wall_s"] for r in runs[0])
    learn_s = statistics.median(r["learner_s"] for r in runs[0])
    projection = {n: (g / n + learn_s) / max(g / n, learn_s) for n in (1, 2, 4, 8, 16)}
    res = dict(job=args.job, rounds=args.rounds, repeats=args.repeats, runs=runs, overlapped_vs_lock_step=ratio,
               generation_s_per_round=g, learner_s_per_iteration=learn_s, projected_speedup=projection,
               published={"AReaL": 2.77, "verl fully async": [2.35, 2.67]})
    save("overlap", res, settings=vars(args))
    print(row("loop", "rounds/h", "workers busy", "learner busy", "staleness max"))
    for k, name in ((0, "lock-step"), (1, "overlapped (max_staleness 1)")):
        rs = runs[k]
        print(row(name, f"{statistics.median(r['rounds_per_hour'] for r in rs):.0f}",
                  f"{statistics.median(r['worker_busy'] for r in rs):.2f}",
                  f"{statistics.median(r['learner_busy'] for r in rs):.2f}", max(r["staleness_max"] or 0 for r in rs)))
    print(f"overlapped / lock-step rounds per hour: {ratio:.2f}")
    print(row("N GPU workers + 1 learner GPU", *projection))
    print(row("projected speed-up", *(f"{v:.2f}" for v in projection.values())))


if __name__ == "__main__":
    main()
