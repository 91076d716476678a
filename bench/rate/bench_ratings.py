"""Ratings replay speed: the closed-form 2-player path vs a plain `trueskill` package loop.

    .venv/bin/python bench/rate/bench_ratings.py [--games 1000000] [--sample 20000]

Writes a synthetic lake of 2-player games (100 models, 4 envs, 10 rounds), runs the rate job on it
end to end, then times the package on the first `--sample` games (same rules: overall + env track
per game) and extrapolates per game. Results go to bench/results/ratings.json; the last line
printed is a markdown table row for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trueskill

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/rate/", "unstable_dask/lake/", "unstable_dask/skill.py"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.jobfile import default_job  # noqa: E402
from unstable_dask.lake import Lake  # noqa: E402
from unstable_dask.rate import ratings, replay_state  # noqa: E402
from unstable_dask.skill import make_env  # noqa: E402

from common import save  # noqa: E402
from helpers import synthetic_lake as sl  # noqa: E402

ENVS = ["SimpleTak-v0-train", "KuhnPoker-v0-train", "TicTacToe-v0-train", "ConnectFour-v0-train"]


def package_loop(games: list[tuple], cfg) -> tuple[dict, float]:
    """Every game through trueskill.TrueSkill.rate, overall and env track; returns ratings, seconds."""
    env = make_env(cfg)
    R: dict[tuple[str, str], trueskill.Rating] = {}
    t0 = time.perf_counter()
    for env_id, a, b, ra, rb in games:
        ranks = [0, 0] if ra == rb else [0, 1] if ra > rb else [1, 0]
        for track in ("*", env_id):
            (na,), (nb,) = env.rate([(R.get((track, a)) or env.create_rating(),),
                                     (R.get((track, b)) or env.create_rating(),)], ranks=ranks)
            R[(track, a)], R[(track, b)] = na, nb
    return {k: (r.mu, r.sigma) for k, r in R.items()}, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--games", type=int, default=1_000_000)
    ap.add_argument("--sample", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ratings-"))
    try:
        rng = np.random.default_rng(0)
        strengths = rng.normal(0, 1, 100)
        per = args.games // args.rounds
        t0 = time.perf_counter()
        for r in range(args.rounds):
            table = sl.duel_table(per, strengths, rng, ENVS, r, start=r * per)
            Lake(tmp).write("games", "bench", r, "task-0", table)
            sl.commit(tmp, "bench", r, [])
        t_write = time.perf_counter() - t0

        job = default_job()
        job.run.lake, job.run.name = str(tmp), "bench"
        job.ratings.bootstrap = 200
        res = ratings.rate(job)
        t_full = res.seconds

        # The replay alone (prepared duels -> ratings), as the rate job runs it.
        con = Lake(tmp).connect()
        games = ratings.read_games(con, "bench", True, -1)
        con.close()
        envs = [ratings.OVERALL] + sorted(set(games.column("env_id").to_pylist()))
        models = sorted(set(__import__("pyarrow").compute.list_flatten(games.column("uids")).to_pylist()))
        st = replay_state.State(envs, models, {})
        t0 = time.perf_counter()
        duels, rounds, _ = ratings.prepare_duels(st, games)
        t_prep = time.perf_counter() - t0
        t0 = time.perf_counter()
        ratings.replay(st, job.ratings, duels, rounds, list(range(args.rounds)))
        t_replay = time.perf_counter() - t0

        # The package on a sample (the first games in canonical order) and the same sample fast.
        sample = games.slice(0, args.sample).to_pylist()
        rows = [(g["env_id"], g["uids"][0], g["uids"][1], g["rewards"][0], g["rewards"][1]) for g in sample]
        want, t_pkg = package_loop(rows, job.ratings)
        st2 = replay_state.State(envs, models, {})
        d2, rounds2, _ = ratings.prepare_duels(st2, games.slice(0, args.sample))
        ratings.replay(st2, job.ratings, d2, rounds2, sorted(set(rounds2.tolist())))
        diff = max(max(abs(st2.mu[st2.slot(e, m)] - mu), abs(st2.sg[st2.slot(e, m)] - sd))
                   for (e, m), (mu, sd) in want.items())
        pkg_per_game = t_pkg / args.sample
        out = {
            "games": args.games, "models": 100, "envs": len(ENVS), "rounds": args.rounds, "sample": args.sample,
            "write_lake_s": round(t_write, 2), "rate_job_s": round(t_full, 2), "prepare_s": round(t_prep, 2),
            "replay_s": round(t_replay, 2), "package_sample_s": round(t_pkg, 2),
            "package_games_per_s": round(1 / pkg_per_game), "package_1M_extrapolated_s": round(pkg_per_game * 1e6, 1),
            "fast_games_per_s": round(args.games / t_replay), "speedup_replay": round(pkg_per_game * args.games / t_replay, 1),
            "max_abs_diff_vs_package": diff, "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "trueskill": trueskill.__version__,
            "load_avg_1m": os.getloadavg()[0],
        }
        save("ratings", out, settings=vars(args))
        print(json.dumps(out, indent=2))
        print("| ratings replay | {games:,} 2-player games, 2 tracks | rate job {rate_job_s} s (replay {replay_s} s, "
              "prepare {prepare_s} s) | trueskill loop {package_1M_extrapolated_s} s / 1M (extrapolated from "
              "{sample:,}) | x{speedup_replay} | max diff {max_abs_diff_vs_package:.1e} |".format(**out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
