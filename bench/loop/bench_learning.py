"""A real pretrained model learning a real game on this machine: the learning curve of
jobs/smollm2-learn.toml (SmolLM2-135M-Instruct, TicTacToe against the random agent, REINFORCE on
a LoRA adapter), measured on every round's held-out eval games against the random agent.

Targets (eval games, Wilson 95% CIs): the learner's invalid-move rate falls by >= 20 points from
round 0 and its win rate against the random agent (draws half) rises by >= 10 points.

It is `loop` (which prints each round's eval figures as it goes) plus a summary read back from
the lake with the report's query. The run lives in the job's lake, so the bench resumes where it
stopped: run the same command again after a kill. The report of the run is
reports/smollm2-learn/index.html.

    python bench/loop/bench_learning.py [--rounds 12] [--job jobs/smollm2-learn.toml] [--set KEY=VALUE ...]
                                   [--name learning]

Writes bench/results/<name>.json and <name>.svg; prints the markdown table.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/play/", "unstable_dask/inference/", "unstable_dask/learn/", "unstable_dask/lake/", "unstable_dask/rate/", "unstable_dask/report/", "unstable_dask/cluster/", "unstable_dask/loop.py", "unstable_dask/run.py", "unstable_dask/cli.py", "unstable_dask/jobs/smollm2-learn.toml"]  # what bench/stale.py checks for changes since a result's commit

from common import RESULTS, row, save  # noqa: E402

OPPONENT = "random"


def curve(job) -> list[dict]:
    """Per round: the eval games against the random agent and the train split's learner turns."""
    from unstable_dask.lake import Lake
    from unstable_dask.report.report import round_curves
    con = Lake(job.run.lake).connect()
    try:
        rows = round_curves(con, job.run.name)
        times = {r["round"]: r for r in con.sql(
            "SELECT round, started_at, committed_at FROM rounds WHERE run = ?", params=[job.run.name]
        ).to_arrow_table().to_pylist()}
        learned = {r["rounds_trained"][-1]: r["created_at"] for r in con.sql(
            "SELECT rounds_trained, created_at FROM checkpoints WHERE run = ?", params=[job.run.name]
        ).to_arrow_table().to_pylist()}
    finally:
        con.close()
    start = min((t["started_at"] for t in times.values()), default=None)
    out = []
    for k in sorted(times):
        ev = next((r for r in rows if r["round"] == k and r["split"] == "eval" and r["opponent"] == OPPONENT), None)
        tr = next((r for r in rows if r["round"] == k and r["split"] == "train" and r["opponent"] == "*"), None)
        if ev is None:
            continue
        prev = learned.get(k - 1)  # the learner update that made this round's checkpoint
        out.append({
            "round": k, "checkpoint": ev["checkpoint_uid"], "eval_games": ev["games"],
            "wins": ev["wins"], "draws": ev["draws"], "losses": ev["losses"],
            "win_rate": ev["win_rate"], "win_rate_ci": [ev["win_rate_low"], ev["win_rate_high"]],
            "invalid_rate": ev["invalid_rate"], "invalid_rate_ci": [ev["invalid_rate_low"], ev["invalid_rate_high"]],
            "learner_turns": ev["turns"], "format_success": ev["format_success"],
            "mean_completion_tokens": ev["mean_completion_tokens"],
            "train_invalid_rate": tr["invalid_rate"] if tr else None,
            "play_s": (times[k]["committed_at"] - times[k]["started_at"]).total_seconds(),
            "learn_s": (prev - times[k - 1]["committed_at"]).total_seconds() if prev and k - 1 in times else None,
            "elapsed_s": (times[k]["committed_at"] - start).total_seconds()})
    return out


def plot(points: list[dict]) -> str:
    from unstable_dask.report import charts
    inv = [(p["round"], p["invalid_rate"]) for p in points]
    win = [(p["round"], p["win_rate"]) for p in points]
    chart = charts.line(
        {"eval invalid-move rate": inv, f"eval win rate vs {OPPONENT}": win,
         "train invalid-move rate": [(p["round"], p["train_invalid_rate"]) for p in points
                                     if p["train_invalid_rate"] is not None]},
        "round (checkpoint that played it)", "rate", y_range=(0, 1), width=480, height=260,
        bands={"eval invalid-move rate": [(p["round"], *p["invalid_rate_ci"]) for p in points],
               f"eval win rate vs {OPPONENT}": [(p["round"], *p["win_rate_ci"]) for p in points]})
    assert chart is not None
    return charts.svg(chart, "SmolLM2-135M-Instruct learning TicTacToe against the random agent "
                             "(eval games, Wilson 95% CIs)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default=str(ROOT / "jobs" / "smollm2-learn.toml"))
    ap.add_argument("--rounds", type=int, default=12, help="the run's total rounds (0 .. rounds-1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="job overrides, as `run --set`")
    ap.add_argument("--name", default="learning", help="results name: bench/results/<name>.json and <name>.svg")
    args = ap.parse_args()

    from rich.console import Console

    from unstable_dask.cli import parse_set
    from unstable_dask.jobfile import load_job
    from unstable_dask.loop import loop
    job = load_job(args.job, parse_set(args.set))
    t0 = time.perf_counter()
    loop(job, rounds=args.rounds, console=Console(stderr=True))
    points = curve(job)
    if not points:
        raise SystemExit(f"no eval games against '{OPPONENT}' in run '{job.run.name}'")
    first, last = points[0], points[-1]
    targets = {
        "invalid_rate_drop": first["invalid_rate"] - last["invalid_rate"],
        "invalid_rate_drop_target": 0.20,
        "win_rate_rise": last["win_rate"] - first["win_rate"],
        "win_rate_rise_target": 0.10,
        # The change is clear when the two rounds' 95% intervals do not overlap.
        "invalid_rate_cis_apart": last["invalid_rate_ci"][1] < first["invalid_rate_ci"][0],
        "win_rate_cis_apart": last["win_rate_ci"][0] > first["win_rate_ci"][1],
    }
    svg = RESULTS / f"{args.name}.svg"
    RESULTS.mkdir(parents=True, exist_ok=True)
    svg.write_text(plot(points), encoding="utf-8")
    from unstable_dask.lake import Lake
    engines = [r["engine"] for r in Lake(job.run.lake).sql(
        "SELECT DISTINCT engine FROM rounds WHERE run = ? AND engine IS NOT NULL", params=[job.run.name]).to_pylist()]
    path = save(args.name, {"job": os.path.relpath(args.job, ROOT), "overrides": args.set, "run": job.run.name,
                            "engines": engines,
                             "rounds": points, **targets, "this_call_s": time.perf_counter() - t0,
                             "load_average_1m": os.getloadavg()[0], "plot": svg.name}, settings=vars(args))
    print(row("round", "checkpoint", "eval games", "invalid-move rate [95% CI]", "win rate vs random [95% CI]",
              "format", "tokens", "wall (min)"))
    print(row(*["---"] * 8))
    for p in points:
        print(row(p["round"], p["checkpoint"], p["eval_games"],
                  f"{p['invalid_rate']:.2f} [{p['invalid_rate_ci'][0]:.2f}, {p['invalid_rate_ci'][1]:.2f}]",
                  f"{p['win_rate']:.2f} [{p['win_rate_ci'][0]:.2f}, {p['win_rate_ci'][1]:.2f}]",
                  f"{p['format_success']:.2f}", f"{p['mean_completion_tokens']:.1f}", f"{p['elapsed_s'] / 60:.1f}"))
    print(f"invalid-move rate {first['invalid_rate']:.2f} -> {last['invalid_rate']:.2f} "
          f"(drop {targets['invalid_rate_drop']:.2f}, target >= 0.20); win rate {first['win_rate']:.2f} -> "
          f"{last['win_rate']:.2f} (rise {targets['win_rate_rise']:.2f}, target >= 0.10)")
    print(f"results: {path}  plot: {svg}  report: {Path(job.run.reports) / job.run.name / 'index.html'}")


if __name__ == "__main__":
    main()
