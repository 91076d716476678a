"""Games in flight per worker vs the round's wall time, on the learning job's round 0 (issue 19).

With per-game play a worker keeps `round.concurrency` games in flight until its task's games run
out. The learning job gives each worker one task of 28 games at concurrency 28: every game starts
at once and nothing refills a slot, so the games in flight fall as the short games end (in-flight
share ~0.70). A lower concurrency refills slots (a share near 1) but hands the engine smaller
batches. Which costs the round more is what this measures.

Round 0 of jobs/smollm2-learn.toml on one cluster whose engines are started before (engine start
timed apart), at each concurrency named: the same games and seeds, only how many run at once
changes. A first round at the first concurrency warms the engines up and is set apart (the first
round after an engine starts ran 1.25x slower than the same round later, in this bench's first
run). Each round goes into a lake of its own, with every worker's prefix cache emptied first
(each starts as a round does); the concurrencies take turns (A B C, then C B A, ...) for
--repeats passes, so drift on the machine falls on each alike. Ratios are against the first
concurrency named (the job's own), measured in the same run.

    python bench/inference/bench_concurrency.py [--concurrency 28,14,7 (default: the job's, half, quarter)] [--repeats 2] [--dtype bfloat16]

Writes bench/results/concurrency[_<dtype>].json and prints the table for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/inference/", "unstable_dask/cluster/", "unstable_dask/play/", "unstable_dask/lake/"]  # what bench/stale.py checks for changes since a result's commit

from common import empty_prefix_cache, round_figures, row, save, start_engines  # noqa: E402

JOB = "jobs/smollm2-learn.toml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default=None,
                    help="games in flight per task, comma-separated; the first is the baseline "
                         "(default: the job's, its half and its quarter)")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the concurrencies, alternating their order")
    ap.add_argument("--dtype", default=None, help="model.dtype (default: the job's)")
    args = ap.parse_args()
    from unstable_dask.cluster.client import open_client
    from unstable_dask.jobfile import load_job

    tmp = tempfile.mkdtemp(prefix="bench-concurrency-")
    load = [os.getloadavg()[0]]

    def job(name: str, concurrency: int):
        over = {"run.lake": f"{tmp}/{name}", "cluster.dashboard": False, "round.concurrency": concurrency}
        return load_job(JOB, over | ({"model.dtype": args.dtype} if args.dtype else {}))

    own = load_job(JOB).round.concurrency
    levels = [int(x) for x in args.concurrency.split(",")] if args.concurrency else [own, own // 2, own // 4]
    base = job("start", levels[0])
    runs: dict[int, list[dict]] = {c: [] for c in levels}
    with open_client(base.cluster) as client:
        engine, start_s = start_engines(client, base.model)
        warmup = round_figures(job("warmup", levels[0]), client)
        warmup.pop("tasks")
        for rep in range(args.repeats):
            for c in (levels if rep % 2 == 0 else levels[::-1]):
                client.run(empty_prefix_cache, base.model)
                r = round_figures(job(f"c{c}-r{rep}", c), client)
                r.pop("tasks")
                runs[c].append(r)
                print(f"concurrency {c}, pass {rep}: {r['wall_s']:.1f} s, {r['tok_s']:.1f} tok/s, "
                      f"in flight {r['in_flight_frac']:.2f}", flush=True)
    load.append(os.getloadavg()[0])
    shutil.rmtree(tmp, ignore_errors=True)

    def med(c: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[c])

    summary = {c: {"wall_s": med(c, "wall_s"), "wall_s_range": [min(r["wall_s"] for r in runs[c]), max(r["wall_s"] for r in runs[c])],
                   "tok_s": med(c, "tok_s"), "in_flight_frac": med(c, "in_flight_frac"),
                   "prefix_cache_hit_rate": med(c, "prefix_cache_hit_rate"),
                   "completion_tokens": med(c, "completion_tokens_made"),
                   "wall_vs_baseline": med(c, "wall_s") / med(levels[0], "wall_s"),
                   "tok_s_vs_baseline": med(c, "tok_s") / med(levels[0], "tok_s")} for c in levels}
    path = save("concurrency" + (f"_{args.dtype}" if args.dtype else ""),
                {"job": JOB, "engine": engine, "engine_start_s": start_s, "dtype": args.dtype or "the job's",
                 "games_per_task": base.round.games_per_task, "n_workers": base.cluster.n_workers,
                 "repeats": args.repeats, "warmup": warmup, "load_average_1m": load, "runs": runs, "summary": summary}, settings=vars(args))

    print(row("games in flight per worker (task of "
              f"{base.round.games_per_task})", "round wall s, median [range]", "vs the job's", "tok/s",
              "games in flight / concurrency", "prefix-cache hit rate", "new tokens"))
    print(row(*["---"] * 7))
    for c in levels:
        s = summary[c]
        print(row(c, f"{s['wall_s']:.1f} [{s['wall_s_range'][0]:.1f}, {s['wall_s_range'][1]:.1f}]",
                  f"{s['wall_vs_baseline']:.2f}", f"{s['tok_s']:.1f}", f"{s['in_flight_frac']:.2f}",
                  f"{s['prefix_cache_hit_rate']:.2f}", f"{s['completion_tokens']:.0f}"))
    print(f"engine {engine} (start {start_s:.0f} s, warm-up round {warmup['wall_s']:.1f} s); load average {load[0]:.1f} -> {load[1]:.1f}; results: {path}")


if __name__ == "__main__":
    main()
