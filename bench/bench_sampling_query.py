"""The learner's sampling query, all default transforms, over 1M synthetic turns (target <= 1 s).

Writes a lake of `--turns` learner turns (mirror self-play, 2 seats, 10 turns a game, 20 rounds),
then times the composed query (window = all: the EMA runs over every game, the join over every
turn) on the read-only lake connection. Prints a markdown row; writes bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from unstable_dask.lake import Lake
from unstable_dask.learn.algorithms.reinforce import Config as LearnConfig
from unstable_dask.learn.rewards import batch_query, parse_transforms, run_batch_query, window_rounds

from common import row, save

RUN = "bench"


def write_lake(root: Path, turns: int, rounds: int = 20, turns_per_game: int = 10) -> None:
    rng = np.random.default_rng(0)
    per_round = turns // rounds
    games = per_round // turns_per_game
    prompt = "<|im_start|>user\nYou are playing a two-player zero-sum game. " + "Observation: board " * 8
    for r in range(rounds):
        gids = np.array([f"r{r:03d}-g{i:06d}" for i in range(games)])
        envs = np.where(rng.random(games) < 0.5, "SimpleTak-v0-train", "KuhnPoker-v0-train")
        seeds = rng.integers(0, 1 << 40, games)
        rewards = rng.choice([-1.0, 0.0, 1.0], size=games)
        seat = pa.struct([("pid", pa.int32()), ("model_uid", pa.string()), ("is_learner", pa.bool_()),
                          ("role", pa.string()), ("reward", pa.float64()), ("invalid_move", pa.bool_()),
                          ("reason", pa.string())])
        seats = [[dict(pid=0, model_uid="ckpt", is_learner=True, role="P0", reward=float(x), invalid_move=False, reason=""),
                  dict(pid=1, model_uid="ckpt", is_learner=True, role="P1", reward=float(-x), invalid_move=False, reason="")]
                 for x in rewards]
        groups = np.array([f"r{r:03d}-g{i // 4:06d}" for i in range(games)])  # round.group_size = 4
        g = pa.table({"game_id": gids, "split": ["train"] * games, "env_id": envs, "seed": seeds, "group_id": groups,
                      "num_players": np.full(games, 2, np.int32), "num_turns": np.full(games, turns_per_game, np.int32),
                      "started_at": pa.nulls(games, pa.timestamp("us", tz="UTC")),
                      "finished_at": pa.nulls(games, pa.timestamp("us", tz="UTC")),
                      "worker": ["w"] * games, "task": ["task0"] * games, "seats": pa.array(seats, type=pa.list_(seat))})
        n = games * turns_per_game
        gi = np.repeat(np.arange(games), turns_per_game)
        turn = np.tile(np.arange(turns_per_game, dtype=np.int32), games)
        t = pa.table({"game_id": gids[gi], "turn": turn, "pid": (turn % 2).astype(np.int32), "model_uid": ["ckpt"] * n,
                      "is_learner": np.ones(n, bool), "split": ["train"] * n, "env_id": envs[gi], "seed": seeds[gi],
                      "group_id": groups[gi], "observation": ["obs"] * n, "prompt": [prompt + str(i % 97) for i in range(n)],
                      "completion": ["\\boxed{[3]}"] * n, "action": ["[3]"] * n, "format_ok": rng.random(n) < 0.8,
                      "invalid_move": rng.random(n) < 0.1, "step_info": ["{}"] * n,
                      "prompt_tokens": np.full(n, 200, np.int32), "completion_tokens": np.full(n, 30, np.int32),
                      "completion_token_ids": pa.array([list(range(30))] * n, pa.list_(pa.int32())),
                      "truncated": np.zeros(n, bool), "logprobs": pa.array([[-1.0] * 30] * n, pa.list_(pa.float32())),
                      "latency_s": np.zeros(n), "error": pa.nulls(n, pa.string())})
        Lake(root).write("games", RUN, r, "task0", g)
        Lake(root).write("turns", RUN, r, "task0", t)
        Lake(root).commit_round(RUN, r, dict(checkpoint_uid="ckpt", games=games, temperature=1.0, top_p=1.0,
                                           max_new_tokens=30))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = LearnConfig(window="all")
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        t0 = time.perf_counter()
        write_lake(root, args.turns)
        build_s = time.perf_counter() - t0
        sql = batch_query(RUN, window_rounds(Lake(root).rounds(RUN), "all"), cfg.batch_size, 0,
                          parse_transforms(cfg.final_transforms, "final"), parse_transforms(cfg.step_transforms, "step"),
                          parse_transforms(cfg.sampling_transforms, "sampling"))
        times = []
        for i in range(args.repeats + 1):
            con = Lake(root).connect()  # a learn job opens its own connection: count the view setup too
            t0 = time.perf_counter()
            rows = run_batch_query(con, sql).num_rows
            dt = time.perf_counter() - t0
            con.close()
            if i:  # the first run warms the OS page cache
                times.append(dt)
        total_turns = Lake(root).sql("SELECT count(*) FROM turns").column(0)[0].as_py()
    res = dict(name="bench_sampling_query", turns=total_turns, batch_rows=rows, median_s=statistics.median(times),
               min_s=min(times), target_s=1.0, lake_build_s=build_s, transforms=dict(final=cfg.final_transforms,
               step=cfg.step_transforms, sampling=cfg.sampling_transforms))
    save("bench_sampling_query", res)
    print(row("benchmark", "turns", "median", "min", "target"))
    print(row("sampling query (default transforms, window=all)", f"{total_turns:,}", f"{res['median_s']:.3f} s",
              f"{res['min_s']:.3f} s", "<= 1 s"))


if __name__ == "__main__":
    main()
