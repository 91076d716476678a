"""Round throughput, measured in one run on the same prompts (issue: round/lake).

  A  in-process round: play_task over every task, no Dask
  B  the raw engine: the very prompts A sent, batched `generate` at the same concurrency
  C  UnstableBaselines-style play: the same prompts one at a time (a sample, per-token rate)
  D  the Dask round: play_round on a LocalCluster of 1 worker (same compute as A), and of 2

Ratios: A/B (target >= 0.9), C/B (what batching buys), D1/A (target >= 0.9), D2/A.
The builtin tiny model is untrained, so games run with a large error_allowance and a turn cap:
every game then makes `max_turns` model calls, which is the load a round puts on the engine.

    python bench/play/bench_round.py [--games 32] [--concurrency 16] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/play/", "unstable_dask/inference/", "unstable_dask/cluster/", "unstable_dask/lake/"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--games", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--sequential-sample", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of A, B and D; medians are reported")
    args = ap.parse_args()

    import duckdb

    from unstable_dask.cluster.client import open_client
    from unstable_dask.inference.engine import get_engine
    from unstable_dask.jobfile import load_job
    from unstable_dask.lake import Lake
    from unstable_dask.play.opponents import list_checkpoints
    from unstable_dask.play.round import play_round
    from unstable_dask.play.schedule import schedule_round
    from unstable_dask.play.task import play_task

    tmp = tempfile.mkdtemp(prefix="bench-round-")
    over = {"run.lake": f"{tmp}/a", "round.train_games": args.games, "round.eval_games": 0,
            "round.games_per_task": args.games // 2, "round.concurrency": args.concurrency,
            "round.max_turns": args.max_turns, "round.error_allowance": 10_000,
            "model.max_new_tokens": args.tokens, "cluster.dashboard": False}
    # Every path first plays a small round of its own, so engine load, first-call kernels and
    # lazy imports (the Parquet writer) are out of every timed figure, as in a round after the first.
    warm = {"round.train_games": 4, "round.games_per_task": 2}

    def tasks_of(job):
        cks = list_checkpoints(Lake(job.run.lake), job.run.name)
        return schedule_round(job, Lake(job.run.lake), 0, cks[-1], cks)

    job = load_job(None, over)
    engine = get_engine(job.model)
    wjob = load_job(None, over | warm | {"run.lake": f"{tmp}/a-warm"})
    for task in tasks_of(wjob):
        play_task(task, wjob.model, wjob.round, Lake(wjob.run.lake))

    # A: in-process, the same tasks each repeat (each replaces its own files)
    tasks = tasks_of(job)
    a_runs = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        res = [play_task(task, job.model, job.round, Lake(job.run.lake)) for task in tasks]
        a_runs.append(sum(r["completion_tokens"] for r in res) / (time.perf_counter() - t))
    a_tps = statistics.median(a_runs)

    # B: raw engine, same prompts, same batch size
    prompts = [r[0] for r in duckdb.sql(
        f"SELECT prompt FROM read_parquet('{tmp}/a/turns/**/*.parquet') ORDER BY game_id, turn").fetchall()]
    b_runs = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        b_tokens = 0
        for i in range(0, len(prompts), args.concurrency):
            b_tokens += sum(g.completion_tokens for g in engine.generate(prompts[i:i + args.concurrency]))
        b_runs.append(b_tokens / (time.perf_counter() - t))
    b_tps = statistics.median(b_runs)

    # C: one prompt at a time (UB-style), on a sample
    t = time.perf_counter()
    c_tokens = sum(engine.generate([p])[0].completion_tokens for p in prompts[: args.sequential_sample])
    c_tps = c_tokens / (time.perf_counter() - t)

    # D: the Dask round on 1 and 2 workers: a warm-up round, then `repeats` timed rounds
    # (round k plays other seeds than round 0, so compare tokens/s, not wall time).
    d, d_runs = {}, {}
    for n in (1, 2):
        jn = load_job(None, over | {"run.lake": f"{tmp}/d{n}", "cluster.n_workers": n})
        with open_client(jn.cluster) as client:
            play_round(load_job(None, over | warm | {"run.lake": f"{tmp}/d{n}-warm", "cluster.n_workers": n}),
                       client=client)
            d_runs[n] = [play_round(jn, client=client).tokens_per_s for _ in range(args.repeats)]
        d[n] = statistics.median(d_runs[n])
    shutil.rmtree(tmp, ignore_errors=True)

    result = {
        "games": args.games, "concurrency": args.concurrency, "prompts": len(prompts), "repeats": args.repeats,
        "in_process_tok_s": a_tps, "raw_engine_tok_s": b_tps, "one_at_a_time_tok_s": c_tps,
        "dask_1_worker_tok_s": d[1], "dask_2_workers_tok_s": d[2],
        "runs_tok_s": {"in_process": a_runs, "raw_engine": b_runs, "dask_1": d_runs[1], "dask_2": d_runs[2]},
        "round_vs_raw_engine": a_tps / b_tps, "one_at_a_time_vs_raw_engine": c_tps / b_tps,
        "dask_1_vs_in_process": d[1] / a_tps, "dask_2_vs_in_process": d[2] / a_tps,
        "load_average_1m": os.getloadavg()[0],
    }
    path = save("round", result, settings=vars(args))
    print(row("metric", "tok/s (median)", "ratio"))
    print(row("---", "---", "---"))
    print(row("raw engine, batched generate", f"{b_tps:.0f}", "1.00 (baseline)"))
    print(row("round in one process", f"{a_tps:.0f}", f"{a_tps / b_tps:.2f} (target >= 0.9)"))
    print(row("UB-style, one prompt at a time", f"{c_tps:.0f}", f"{c_tps / b_tps:.2f}"))
    print(row("Dask round, 1 worker", f"{d[1]:.0f}", f"{d[1] / a_tps:.2f} of in-process (target >= 0.9)"))
    print(row("Dask round, 2 workers", f"{d[2]:.0f}", f"{d[2] / a_tps:.2f} of in-process"))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
