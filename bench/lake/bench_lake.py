"""The lake on Delta vs plain DuckDB over the same Parquet files (issue 12's target: <= 1.5x plain
DuckDB at every size, roughly flat in the number of rounds).

For each size (`--rounds`, default 100 400 1000) it writes a run of R rounds x `--tasks` task files
(`--games` games a task, 6 turns a game) through `Lake.write` + `Lake.commit_round`, as the
round job does, then times (median of `--reps`):
  connect      lake.connect() / a plain connection with views over read_parquet(glob, hive)
  count        SELECT count(*) FROM turns
  newest       the newest round's averages (format_ok, invalid_move, completion_tokens)
  batch        one learner batch: rewards.batch_query over the newest round (no transforms)
each on the lake as committed, and again after `run compact` + `run vacuum` (one file per round
and table); the next size then adds its rounds as task files again.
The plain reader lists files; it cannot tell committed from uncommitted, nor notice a missing file.
Prints markdown rows; writes bench/results/lake.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/lake/", "unstable_dask/learn/rewards.py"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.lake import Lake, read
from unstable_dask.lake.maintain import compact, vacuum
from unstable_dask.learn.rewards import batch_query

from common import row, save

RUN = "bench"
TURNS_PER_GAME = 6
QUERIES = {
    "count": "SELECT count(*) FROM turns",
    "newest": f"""SELECT avg(format_ok::INT), avg(invalid_move::INT), avg(completion_tokens) FROM turns
                  WHERE run = '{RUN}' AND round = (SELECT max(round) FROM rounds WHERE run = '{RUN}')""",
}


def write_round(lake: Path, r: int, tasks: int, games: int, rng: np.random.Generator) -> None:
    attempt = f"a{r:05d}"
    for t in range(tasks):
        g_rows, t_rows = [], []
        for i in range(games):
            gid, group = f"r{r:05d}-t{t:03d}-g{i:03d}", f"r{r:05d}-train-g{t * games + i:05d}"
            reward = float(rng.choice([-1.0, 0.0, 1.0]))
            seats = [dict(pid=p, model_uid="ckpt-0", is_learner=True, role=f"P{p}", reward=reward * (1 - 2 * p),
                          invalid_move=False, reason="") for p in (0, 1)]
            g_rows.append(dict(game_id=gid, split="train", env_id="SimpleTak-v0-train", seed=i, group_id=group,
                               num_players=2, num_turns=TURNS_PER_GAME, worker="w", task=f"task-{t:04d}", seats=seats))
            for k in range(TURNS_PER_GAME):
                n = int(rng.integers(4, 33))
                t_rows.append(dict(game_id=gid, turn=k, pid=k % 2, model_uid="ckpt-0", is_learner=True, split="train",
                                   env_id="SimpleTak-v0-train", seed=i, group_id=group, observation="board " * 20,
                                   prompt="<|im_start|>user\n" + "board " * 40, completion="\\boxed{[3]}",
                                   action="[3]", format_ok=bool(rng.random() < 0.7), invalid_move=False,
                                   prompt_tokens=120, completion_tokens=n, completion_token_ids=list(range(n)),
                                   truncated=False, logprobs=[-1.0] * n))
        key = f"task-{t:04d}.{attempt}"
        Lake(lake).write("games", RUN, r, key, g_rows)
        Lake(lake).write("turns", RUN, r, key, t_rows)
    Lake(lake).commit_round(RUN, r, dict(attempt=attempt, checkpoint_uid="ckpt-0", games=tasks * games,
                                       temperature=1.0, top_p=1.0, max_new_tokens=32))


def plain_connect(lake: Path) -> duckdb.DuckDBPyConnection:
    """What issue 12 measured against: views over globs, hive partitions, no commit log."""
    con = duckdb.connect(":memory:")
    for t in ("games", "turns", "rounds"):
        con.execute(f"CREATE VIEW {t} AS SELECT * FROM read_parquet('{lake}/{t}/*/*/*.parquet', "
                    "hive_partitioning = true, union_by_name = true)")
    con.execute(read.SEATS_VIEW)
    return con


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(lake: Path, rounds: int, reps: int) -> dict:
    sql = dict(QUERIES, batch=batch_query(RUN, [rounds - 1], 32, 7, [], [], [], unit="turn"))
    out = {}
    for name, connect in (("delta", lambda: Lake(lake).connect()), ("plain", lambda: plain_connect(lake))):
        res = {"connect": timed(lambda c=connect: c().close(), reps)}
        con = connect()
        answers = {}
        for q, text in sql.items():
            res[q] = timed(lambda c=con, t=text: c.sql(t).fetchall(), reps)
            answers[q] = con.sql(text).fetchall()
        out[name], out[f"{name}_answers"] = res, answers
    assert out["delta_answers"] == out["plain_answers"], "Delta and plain readers disagree"
    del out["plain_answers"]
    out["answers"] = {q: str(v)[:80] for q, v in out.pop("delta_answers").items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, nargs="+", default=[100, 400, 1000])
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--games", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    results = []
    print(row("rounds", "files", "state", "reader", "connect s", "count s", "newest s", "batch s", "commit s/round"))
    print(row(*["---"] * 9))
    with tempfile.TemporaryDirectory() as tmp:
        lake, done, commit_s = Path(tmp) / "lake", 0, []
        for size in sorted(args.rounds):  # one lake grown through the sizes
            t = time.perf_counter()
            for r in range(done, size):
                write_round(lake, r, args.tasks, args.games, rng)
            commit_s.append((time.perf_counter() - t) / (size - done))
            done = size
            for state in ("committed", "compacted"):
                if state == "compacted":  # vacuumed at once, or the plain reader's glob reads both copies
                    compact(lake, RUN)
                    vacuum(lake, retention_hours=0)
                m = measure(lake, size, args.reps)
                files = len(Lake(lake).table("turns").files()) + len(Lake(lake).table("games").files())
                results.append(dict(rounds=size, files=files, state=state, write_s_per_round=commit_s[-1], **m))
                for reader in ("delta", "plain"):
                    x = m[reader]
                    print(row(size, files, state, reader, f"{x['connect']:.3f}", f"{x['count']:.3f}",
                              f"{x['newest']:.3f}", f"{x['batch']:.3f}", f"{commit_s[-1]:.2f}"), flush=True)
    print(f"results: {save('lake', {'tasks': args.tasks, 'games_per_task': args.games, 'results': results}, settings=vars(args))}")


if __name__ == "__main__":
    main()
