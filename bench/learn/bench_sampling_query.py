"""The learner's sampling query, all default transforms, over 10M synthetic turns (target <= 1 s).

Writes a lake of `--turns` learner turns (mirror self-play, 2 seats, 10 turns a game, 20 rounds)
under /tmp (deleted afterwards), commits the role-advantage EMA's state after round 18 as a learner
iteration over round 18 commits it (learn/ema.py), then times on the read-only lake connection
the query of the next iteration (window = latest: round 19) two ways, interleaved so that load on
the machine falls on both alike: from the stored state (what the learner runs) and scanning the
run's whole history (what it ran before the state existed, and still runs without one). Checks
that both give the same batch; prints markdown rows; writes bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/learn/rewards.py", "unstable_dask/lake/"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.lake import Lake
from unstable_dask.learn.algorithms.reinforce import Config as LearnConfig
from unstable_dask.learn.ema import find_state
from unstable_dask.learn.rewards import batch_query, run_batch_query, state_rows
from unstable_dask.learn.transforms import parse_transforms

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
        ids = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * 30),  # fast: no Python lists
                                       pa.array(np.tile(np.arange(30, dtype=np.int32), n)))
        logprobs = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * 30),
                                            pa.array(np.full(n * 30, -1.0, np.float32)))
        gi = np.repeat(np.arange(games), turns_per_game)
        turn = np.tile(np.arange(turns_per_game, dtype=np.int32), games)
        t = pa.table({"game_id": gids[gi], "turn": turn, "pid": (turn % 2).astype(np.int32), "model_uid": ["ckpt"] * n,
                      "is_learner": np.ones(n, bool), "split": ["train"] * n, "env_id": envs[gi], "seed": seeds[gi],
                      "group_id": groups[gi], "observation": ["obs"] * n, "prompt": [prompt + str(i % 97) for i in range(n)],
                      "completion": ["\\boxed{[3]}"] * n, "action": ["[3]"] * n, "format_ok": rng.random(n) < 0.8,
                      "invalid_move": rng.random(n) < 0.1, "step_info": ["{}"] * n,
                      "prompt_tokens": np.full(n, 200, np.int32), "completion_tokens": np.full(n, 30, np.int32),
                      "completion_token_ids": ids, "truncated": np.zeros(n, bool), "logprobs": logprobs,
                      "latency_s": np.zeros(n), "adapter_sha256": pa.nulls(n, pa.string()),
                      "error": pa.nulls(n, pa.string())})
        Lake(root).write("games", RUN, r, "task0", g)
        Lake(root).write("turns", RUN, r, "task0", t)
        Lake(root).commit_round(RUN, r, dict(checkpoint_uid="ckpt", games=games, temperature=1.0, top_p=1.0,
                                           max_new_tokens=30))


def commit_state(root: Path, rounds: list[int], final) -> float:
    """What the learner iteration over `rounds` commits besides its adapter: the EMA's state after
    them, in its checkpoint's commit. Returns the seconds its query took."""
    lake, attempt = Lake(root), uuid.uuid4().hex[:8]
    con = lake.connect()
    t0 = time.perf_counter()
    rows = state_rows(con, RUN, rounds, final)
    dt = time.perf_counter() - t0
    con.close()
    lake.write("baselines", RUN, 1, f"baselines.{attempt}", rows)
    lake.commit("checkpoints", RUN, 1, "checkpoint", dict(attempt=attempt, uid="ckpt-1", rounds_trained=rounds))
    return dt


def timed(root: Path, sql: str):
    con = Lake(root).connect()  # a learn job opens its own connection: count the view setup too
    t0 = time.perf_counter()
    batch = run_batch_query(con, sql)
    dt = time.perf_counter() - t0
    con.close()
    return dt, batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = LearnConfig()
    final, step, sampling = (parse_transforms(cfg.final_transforms, "final"), parse_transforms(cfg.step_transforms, "step"),
                             parse_transforms(cfg.sampling_transforms, "sampling"))
    last = args.rounds - 1
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="bench_sampling_query.") as d:
        root = Path(d)
        t0 = time.perf_counter()
        write_lake(root, args.turns, args.rounds)
        build_s = time.perf_counter() - t0
        print(f"lake of {args.turns:,} turns written in {build_s:.0f} s", flush=True)
        state_s = commit_state(root, [last - 1], final)  # the previous iteration's (a full scan: no state before it)
        con = Lake(root).connect()
        state = find_state(con, RUN, [last], final)
        con.close()
        assert state == last - 1, state
        sqls = {"state": batch_query(RUN, [last], cfg.batch_size, 0, final, step, sampling, state=state),
                "full": batch_query(RUN, [last], cfg.batch_size, 0, final, step, sampling)}
        times: dict[str, list[float]] = {k: [] for k in sqls}
        batches = {}
        for i in range(args.repeats + 1):
            for k, sql in sqls.items():
                dt, batches[k] = timed(root, sql)
                if i:  # the first run warms the OS page cache
                    times[k].append(dt)
        total_turns = Lake(root).sql("SELECT count(*) FROM turns").column(0)[0].as_py()
    keys = ["round", "game_id", "turn", "pid"]
    assert batches["state"].select(keys).equals(batches["full"].select(keys))  # the same rows, in the same order
    diff = max(max(abs(x - y) for x, y in zip(batches["state"].column(c).to_pylist(), batches["full"].column(c).to_pylist()))
               for c in ("final_reward", "step_reward", "advantage"))
    med = {k: statistics.median(v) for k, v in times.items()}
    res = dict(name="bench_sampling_query", turns=total_turns, rounds=args.rounds, window=[last], state_round=state,
               batch_rows=batches["state"].num_rows, max_abs_reward_diff=diff,
               stateful_median_s=med["state"], stateful_min_s=min(times["state"]), full_scan_median_s=med["full"],
               full_scan_min_s=min(times["full"]), speedup_median=med["full"] / med["state"], target_s=1.0,
               lake_build_s=build_s, state_query_s=state_s, loadavg_before=load_before, loadavg_after=os.getloadavg(),
               times=times, transforms=dict(final=cfg.final_transforms, step=cfg.step_transforms,
                                            sampling=cfg.sampling_transforms))
    save("bench_sampling_query", res, settings=vars(args))
    print(row("sampling query (default transforms, window = latest)", "turns", "median", "min", "target"))
    print(row("from the stored EMA state (the learner's)", f"{total_turns:,}", f"{med['state']:.3f} s",
              f"{min(times['state']):.3f} s", "<= 1 s"))
    print(row("scanning the whole history", f"{total_turns:,}", f"{med['full']:.3f} s", f"{min(times['full']):.3f} s",
              f"x{res['speedup_median']:.1f}"))
    print(f"max |final_reward, step_reward, advantage difference| {diff:.2e}; load average {load_before} -> "
          f"{res['loadavg_after']}")


if __name__ == "__main__":
    main()
