"""Every built-in reward transform equals a plain-Python reference of the UB math (to 1e-9)."""
from __future__ import annotations

import math
import re
from collections import defaultdict

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from unstable_dask.errors import JobError
from unstable_dask.lake import Lake
from unstable_dask.learn.ema import RoleAdvantageByEnvFormatter, RoleAdvantageFormatter
from unstable_dask.learn.rewards import batch_query, run_batch_query, window_rounds
from unstable_dask.learn.transforms import (
    ExpertMove,
    GroupRelativeAdvantage,
    NormalizeRewards,
    NormalizeRewardsByEnv,
    PenaltyForInvalidMove,
    RewardForFormat,
    StateRelativeAdvantage,
    parse_transform,
    parse_transforms,
    register_functions,
)
from unstable_dask.play.envs import register_envs

from helpers.lakes import RUN, make_lake
from helpers.tictactoe import optimal_cells


def ref_final(root, tau, by_env, upto):
    con = Lake(root).connect()
    seats = con.sql(f"SELECT round, game_id, env_id, pid, reward FROM seats WHERE run = '{RUN}' "
                    f"AND split = 'train' AND is_learner AND round <= {upto}").fetchall()
    b, out = defaultdict(float), {}
    for rnd, gid, env, pid, r in sorted(seats, key=lambda s: (s[0], s[1])):
        key = (env, pid) if by_env else pid
        b[key] = (1 - tau) * b[key] + tau * r  # UB: update first, then subtract the updated baseline
        out[(rnd, gid, pid)] = r - b[key]
    return out


def ref_steps(root, final, rounds, step):
    con = Lake(root).connect()
    rows = con.sql(f"SELECT round, game_id, turn, pid, env_id, group_id, prompt, format_ok, invalid_move FROM turns "
                   f"WHERE run = '{RUN}' AND split = 'train' AND is_learner AND prompt IS NOT NULL").fetchall()
    out = {}
    for rnd, gid, turn, pid, env, group, prompt, fmt, inv in rows:
        if rnd not in rounds:
            continue
        r = final[(rnd, gid, pid)]
        for t in step:
            if isinstance(t, RewardForFormat):
                r += t.reward if fmt else t.penalty
            elif isinstance(t, PenaltyForInvalidMove):
                r += t.penalty if inv else t.reward
        out[(rnd, gid, turn, pid)] = dict(r=r, env=env, group=(group, pid), game=(rnd, gid), prompt=prompt)
    for t in step:  # over the whole window: each turn against the turns of its state (prompt)
        if isinstance(t, StateRelativeAdvantage):
            states = defaultdict(list)
            for row in out.values():
                states[row["prompt"]].append(row["r"])
            for row in out.values():
                seen = states[row["prompt"]]
                row["r"] += t.weight * (row["r"] - sum(seen) / len(seen)) if len(seen) > 1 else 0.0
    return out


def ref_sampling(rows, transform):
    def norm(keys, z):
        groups = defaultdict(list)
        for k in keys:
            groups[gkey(rows[k])].append(rows[k]["r"])
        for k in keys:
            g = np.array(groups[gkey(rows[k])])
            v = rows[k]["r"] - g.mean()
            rows[k]["r"] = v / (np.std(g) + 1e-8) if z else v
    keys = list(rows)
    if isinstance(transform, NormalizeRewardsByEnv):
        gkey = lambda x: x["env"]  # noqa: E731
        norm(keys, transform.z_score)
    elif isinstance(transform, NormalizeRewards):
        gkey = lambda x: 0  # noqa: E731
        norm(keys, transform.z_score)
    elif transform.by == "prompt":
        gkey = lambda x: x["prompt"]  # noqa: E731
        norm(keys, True)
    else:  # (group_id, pid) groups; every attempt (game) weighs the same: each of its n turns 1/n
        def attempt_weights(members):  # an attempt is one seat's turns in one game
            n_turns = defaultdict(int)
            for k in members:
                n_turns[(rows[k]["group"], rows[k]["game"])] += 1
            return np.array([1 / n_turns[(rows[k]["group"], rows[k]["game"])] for k in members]), len(n_turns)

        w_all, _ = attempt_weights(keys)
        r_all = np.array([rows[k]["r"] for k in keys])
        b_mu = (w_all * r_all).sum() / w_all.sum()
        b_sd = np.sqrt((w_all * (r_all - b_mu) ** 2).sum() / (w_all.sum() - 1))  # unbiased, over attempts
        groups = defaultdict(list)
        for k in keys:
            groups[rows[k]["group"]].append(k)
        new = {}
        for members in groups.values():
            w, attempts = attempt_weights(members)
            r = np.array([rows[k]["r"] for k in members])
            mu = (w * r).sum() / w.sum()
            sd = np.sqrt((w * (r - mu) ** 2).sum() / (w.sum() - 1)) if attempts > 1 else 0.0
            for k, v in zip(members, r):
                if attempts < 2:  # no baseline
                    new[k] = 0.0
                elif transform.scale == "none":
                    new[k] = v - mu
                else:
                    new[k] = (v - mu) / ((sd if transform.scale == "group" else b_sd) + 1e-8)
        for k, v in new.items():
            rows[k]["r"] = v


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    return make_lake(tmp_path_factory.mktemp("lake"))


FINALS = [RoleAdvantageFormatter(), RoleAdvantageByEnvFormatter(), RoleAdvantageFormatter(0.3),
          RoleAdvantageByEnvFormatter(0.05)]
STEPS = [[], [RewardForFormat(1.5)], [RewardForFormat(1.5, -0.5), PenaltyForInvalidMove(1.0, -1.0)],
         [PenaltyForInvalidMove(0.5, -1.0), StateRelativeAdvantage()], [StateRelativeAdvantage(0.5)]]
SAMPLINGS = [None, NormalizeRewards(), NormalizeRewards(z_score=True), NormalizeRewardsByEnv(),
             NormalizeRewardsByEnv(z_score=True), GroupRelativeAdvantage(), GroupRelativeAdvantage(scale="batch"),
             GroupRelativeAdvantage(scale="none"), GroupRelativeAdvantage("prompt")]


@pytest.mark.parametrize("final", FINALS, ids=repr)
@pytest.mark.parametrize("window", ["latest", "all", 2])
def test_final_and_step_transforms_match_reference(lake, final, window):
    rounds = window_rounds(Lake(lake).rounds(RUN), window)
    ref_f = ref_final(lake, final.tau, isinstance(final, RoleAdvantageByEnvFormatter), max(rounds))
    con = Lake(lake).connect()
    for step in STEPS:
        got = run_batch_query(con, batch_query(RUN, rounds, 10**6, 0, [final], step, []))
        ref = ref_steps(lake, ref_f, set(rounds), step)
        assert got.num_rows == len(ref) > 0
        for row in got.to_pylist():
            k = (row["round"], row["game_id"], row["turn"], row["pid"])
            assert row["final_reward"] == pytest.approx(ref_f[k[:2] + k[3:]], abs=1e-9)
            assert row["advantage"] == pytest.approx(ref[k]["r"], abs=1e-9)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=repr)
def test_sampling_transforms_match_reference_over_the_sampled_batch(lake, sampling):
    rounds = window_rounds(Lake(lake).rounds(RUN), "all")
    final, step = RoleAdvantageByEnvFormatter(), [RewardForFormat(1.5), PenaltyForInvalidMove(1.0, -1.0)]
    ref_all = ref_steps(lake, ref_final(lake, 0.001, True, max(rounds)), set(rounds), step)
    con = Lake(lake).connect()
    got = run_batch_query(con, batch_query(RUN, rounds, 40, 7, [final], step, [sampling] if sampling else []))
    assert got.num_rows == 40 < len(ref_all)
    rows = {(r["round"], r["game_id"], r["turn"], r["pid"]): dict(ref_all[(r["round"], r["game_id"], r["turn"], r["pid"])])
            for r in got.to_pylist()}
    if sampling is not None:
        ref_sampling(rows, sampling)
    for r in got.to_pylist():
        k = (r["round"], r["game_id"], r["turn"], r["pid"])
        assert r["advantage"] == pytest.approx(rows[k]["r"], abs=1e-9)
        assert r["step_reward"] == pytest.approx(ref_all[k]["r"], abs=1e-9)


def test_group_advantage_weighs_every_attempt_equally():
    """Group (x, 0): attempts a (won in 2 turns), b (lost in 1), c (won in 3): mu and sd are those
    of the outcomes [1, -1, 1] (sd unbiased, as verl's and TRL's torch.std), not of the 6 turns;
    group (x, 1), all lost, gets 0; a group of one game has no baseline: 0."""
    con = duckdb.connect()
    games = ["a", "a", "b", "c", "c", "c", "a", "b", "d", "d"]
    pids = [0] * 6 + [1, 1, 0, 0]
    groups = ["x"] * 8 + ["y", "y"]
    rewards = [1.0, 1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 0.5, 2.5]
    con.register("b", pa.table({"group_id": groups, "pid": pids, "round": [0] * 10, "game_id": games,
                                "turn": list(range(10)), "reward": rewards}))
    got = [r[0] for r in con.sql(f"SELECT reward FROM ({GroupRelativeAdvantage().sql('b')}) ORDER BY turn").fetchall()]
    mu, sd = 1 / 3, math.sqrt(((2 / 3) ** 2 * 2 + (4 / 3) ** 2) / 2)
    win, loss = (1 - mu) / sd, (-1 - mu) / sd
    assert got == pytest.approx([win, win, loss, win, win, win, 0.0, 0.0, 0.0, 0.0], abs=1e-7)
    torch_std = float(np.std([1.0, -1.0, 1.0], ddof=1))  # GRPO over the 3 outcomes, as torch.std takes it
    assert (win, loss) == pytest.approx(((1 - mu) / torch_std, (-1 - mu) / torch_std))
    none = [r[0] for r in con.sql(f"SELECT reward FROM ({GroupRelativeAdvantage(scale='none').sql('b')}) "
                                  "ORDER BY turn").fetchall()]
    assert none == pytest.approx([2 / 3, 2 / 3, -4 / 3, 2 / 3, 2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0])  # Dr. GRPO
    with pytest.raises(ValueError):
        GroupRelativeAdvantage("seed")  # the old per-seed grouping mixed seats and had no repeats


@pytest.mark.parametrize("tau", [0.001, 0.01, 0.3, 0.9])
def test_ema_is_exact_over_long_histories(tau):
    """Past the block length (where (1-tau)^-k would overflow) the SQL EMA still equals the loop."""
    n = 20_000
    rng = np.random.default_rng(1)
    r = rng.normal(size=n) * 3
    con = duckdb.connect()
    con.register("src0", pa.table({"round": np.arange(n) // 100, "game_id": [f"{i:06d}" for i in range(n)],
                                   "pid": np.zeros(n, dtype=np.int32), "is_learner": np.ones(n, bool),
                                   "reward": r}))
    got = con.sql(f"SELECT reward FROM ({RoleAdvantageFormatter(tau).sql('src0')}) ORDER BY round, game_id").fetchnumpy()
    b, ref = 0.0, np.empty(n)
    for i, x in enumerate(r):
        b = (1 - tau) * b + tau * x
        ref[i] = x - b
    np.testing.assert_allclose(got["reward"], ref, rtol=0, atol=1e-9)


def test_query_is_deterministic_for_a_seed(lake):
    rounds = window_rounds(Lake(lake).rounds(RUN), "all")
    tr = dict(final=parse_transforms(["RoleAdvantageByEnvFormatter()"], "final"),
              step=parse_transforms(["RewardForFormat(1.5)", "PenaltyForInvalidMove(1.0, -1.0)"], "step"),
              sampling=parse_transforms(["NormalizeRewardsByEnv(z_score=True)"], "sampling"))
    q1 = batch_query(RUN, rounds, 30, 3, **tr)
    assert q1 == batch_query(RUN, rounds, 30, 3, **tr)
    a = run_batch_query(Lake(lake).connect(), q1)
    b = run_batch_query(Lake(lake).connect(), q1)
    # Same rows in the same order; float aggregates may differ in the last bit across DuckDB threads.
    assert a.drop_columns(["advantage"]).select(["round", "game_id", "turn", "pid", "prompt"]).equals(
        b.select(["round", "game_id", "turn", "pid", "prompt"]))
    assert a.column("advantage").to_pylist() == pytest.approx(b.column("advantage").to_pylist(), abs=1e-12)
    c = run_batch_query(Lake(lake).connect(), batch_query(RUN, rounds, 30, 4, **tr))
    assert a.column("game_id").to_pylist() != c.column("game_id").to_pylist()


@pytest.mark.parametrize("unit,cols", [("seat", ("round", "game_id", "pid")), ("group", ("group_id", "pid"))])
def test_unit_sampling_takes_whole_units(lake, unit, cols):
    rounds = window_rounds(Lake(lake).rounds(RUN), "all")
    con = Lake(lake).connect()
    allrows = run_batch_query(con, batch_query(RUN, rounds, 10**6, 0, [], [], [])).to_pylist()
    got = run_batch_query(con, batch_query(RUN, rounds, 25, 5, [], [], [], unit=unit)).to_pylist()
    assert 0 < len(got) <= 25 or len({tuple(r[c] for c in cols) for r in got}) == 1
    for key in {tuple(r[c] for c in cols) for r in got}:  # every chosen unit comes with all its turns
        assert sum(tuple(r[c] for c in cols) == key for r in got) == sum(tuple(r[c] for c in cols) == key for r in allrows)
    again = run_batch_query(con, batch_query(RUN, rounds, 25, 5, [], [], [], unit=unit)).to_pylist()
    assert got == again


def test_parser_builds_objects_without_eval():
    assert parse_transform("RewardForFormat(1.5)", "step") == RewardForFormat(1.5, 0.0)
    assert parse_transform("PenaltyForInvalidMove(1.0, -1.0)", "step") == PenaltyForInvalidMove(1.0, -1.0)
    assert parse_transform("NormalizeRewardsByEnv(z_score=True)", "sampling") == NormalizeRewardsByEnv(True)
    assert parse_transform("RoleAdvantageFormatter", "final") == RoleAdvantageFormatter(0.001)
    assert parse_transform("StateRelativeAdvantage(0.5)", "step") == StateRelativeAdvantage(0.5)
    assert parse_transform("ExpertMove('kuhn-best', 0.5)", "step") == ExpertMove("kuhn-best", 0.5, 0.0)
    for bad, stage in [("__import__('os').system('x')", "step"), ("RewardForFormat(1.5)", "final"),
                       ("RewardForFormat(x)", "step"), ("RoleAdvantageFormatter(tau=2)", "final"),
                       ("Nope()", "sampling"), ("RewardForFormat(", "step"),
                       ("StateRelativeAdvantage()", "sampling"), ("ExpertMove('alphazero')", "step")]:
        with pytest.raises(JobError):
            parse_transform(bad, stage)


def test_raw_sql_transform_runs_on_its_stage_relation(lake):
    rounds = window_rounds(Lake(lake).rounds(RUN), "latest")
    step = [parse_transform("SELECT * REPLACE (reward * 2 AS reward) FROM steps", "step")]
    got = run_batch_query(Lake(lake).connect(), batch_query(RUN, rounds, 10**6, 0, [], step, []))
    for row in got.to_pylist():
        assert row["advantage"] == pytest.approx(2 * row["env_reward"], abs=1e-12)


@pytest.mark.parametrize("sql", ["COPY (SELECT 1) TO '/tmp/x.csv'", "DELETE FROM turns",
                                 "SELECT 1; DROP TABLE turns", "CREATE TABLE x AS SELECT 1", "SELECT FROM WHERE"])
def test_bad_or_writing_sql_is_a_job_error(sql):
    with pytest.raises(JobError):
        parse_transform(sql if sql.lstrip().upper().startswith(("SELECT", "WITH")) else "WITH a AS (SELECT 1) " + sql,
                        "step")


def test_sql_that_fails_at_run_time_or_drops_columns_is_a_job_error(lake):
    rounds = window_rounds(Lake(lake).rounds(RUN), "latest")
    con = Lake(lake).connect()
    for text in ["SELECT nope FROM steps", "SELECT game_id, reward FROM steps",
                 "SELECT * FROM read_csv('/etc/passwd')"]:
        with pytest.raises(JobError):
            run_batch_query(con, batch_query(RUN, rounds, 10, 0, [], [parse_transform(text, "step", con)], []))


@pytest.mark.parametrize("turns", [9, 11, 18, 20, 21])
def test_a_group_of_one_attempt_has_no_baseline_whatever_its_length(turns):
    """One attempt of 9, 11, 18, 20 or 21 turns: its weights 1/turns sum to 1.0000000000000002 in
    floats, but it is one game, so every advantage is exactly 0 (no baseline), in every scale."""
    con = duckdb.connect()
    con.register("b", pa.table({"group_id": ["x"] * turns, "pid": [0] * turns, "round": [0] * turns,
                                "game_id": ["a"] * turns, "turn": list(range(turns)), "reward": [1.0] * turns}))
    assert sum([1 / turns] * turns) > 1  # the float sum the count must not be
    for scale in ("group", "batch", "none"):
        got = con.sql(f"SELECT reward FROM ({GroupRelativeAdvantage(scale=scale).sql('b')})").fetchall()
        assert [r for (r,) in got] == [0.0] * turns, scale


def test_a_group_whose_attempts_scored_alike_is_dropped_despite_rounding():
    """Three attempts all scoring 0.1: GroupRelativeAdvantage gives about -1.4e-9, not 0 (float
    rounding of the mean), and the learner still drops the group as silent; a group whose rewards
    differ keeps every row."""
    from unstable_dask.learn.trainer import drop_silent_groups
    con = duckdb.connect()
    rewards = [0.1, 0.1, 0.1, 0.1, 0.2, 0.1]
    con.register("b", pa.table({"group_id": ["x"] * 3 + ["y"] * 3, "pid": [0] * 6, "round": [0] * 6,
                                "game_id": ["a", "b", "c", "d", "e", "f"], "turn": list(range(6)),
                                "reward": rewards, "step_reward": rewards}))  # as the batch query hands them on
    batch = con.sql(f"SELECT * FROM ({GroupRelativeAdvantage().sql('b')}) ORDER BY turn")
    table = batch.to_arrow_table().rename_columns(
        [c if c != "reward" else "advantage" for c in batch.columns])
    silent = table.column("advantage").to_pylist()[:3]
    assert all(a != 0.0 and abs(a) < 1e-8 for a in silent)  # rounding, not signal
    kept, m = drop_silent_groups(table)
    assert kept.column("group_id").to_pylist() == ["y"] * 3 and m == {"zero_std_group_frac": 0.5, "rows_dropped": 3}


def _states(env_id: str, seed: int, moves: int):
    """Real TextArena states: (observation of the player to move, board) along a random legal game,
    up to `moves` decisions or the game's end."""
    import random

    import textarena as ta
    register_envs()
    env, rng, cells = ta.make(env_id), random.Random(seed), ["."] * 9
    env.reset(num_players=2, seed=seed)
    out = []
    for i in range(moves):
        out.append((env.get_observation()[1], "".join(cells)))
        cell = rng.choice([c for c in range(9) if cells[c] == "."])
        cells[cell] = "O" if i % 2 == 0 else "X"  # player 0 moves first and plays O
        done, _ = env.step(f"[{cell}]")
        if done:
            break
    return out


def test_expert_move_scores_each_move_by_the_solver_s_best_moves_in_its_state():
    """ExpertMove's SQL and Python function over real TicTacToe states: r += reward exactly for the
    moves an independent negamax calls optimal (any spelling the env reads as that cell), else
    r += penalty: other cells, an occupied cell, no move at all; rows keep their order and count."""
    con = duckdb.connect()
    con.execute("CREATE TABLE turns (run VARCHAR, round BIGINT, game_id VARCHAR, turn INT, pid INT, env_id VARCHAR, "
                "observation VARCHAR, action VARCHAR)")
    con.execute("CREATE TABLE steps_0 (run VARCHAR, round BIGINT, game_id VARCHAR, turn INT, pid INT, reward DOUBLE)")
    want, turn = {}, 0
    for seed in range(10):
        for obs, board in _states("TicTacToe-v0-train", seed, 8):
            best = optimal_cells(board)
            assert 0 < len(best) < 9 or board == "." * 9  # the empty board: every cell draws
            taken = next((c for c in range(9) if board[c] != "."), None)
            actions = [f"[{c}]" for c in range(9) if board[c] == "."] + [f"I play [ {min(best)} ] now", "[", None]
            actions += [f"[{taken}]"] if taken is not None else []
            for action in actions:
                turn += 1
                m = None if action is None else re.search(r"\[\s*(\d+)\s*\]", action)
                ok = m is not None and board[int(m.group(1))] == "." and int(m.group(1)) in best
                con.execute("INSERT INTO turns VALUES ('r', 2, ?, ?, 0, 'TicTacToe-v0-train', ?, ?)", [f"g{seed}", turn, obs, action])
                con.execute("INSERT INTO steps_0 VALUES ('r', 2, ?, ?, 0, 0.25)", [f"g{seed}", turn])
                want[turn] = 0.25 + (1.5 if ok else -0.5)
    register_functions(con)
    register_functions(con)  # once per connection, however often asked
    got = dict(con.sql(f"SELECT turn, reward FROM ({ExpertMove('minimax', 1.5, -0.5).sql('steps_0')})").fetchall())
    bad = {k: (got[k], want[k]) for k in want if got.get(k) != want[k]}
    assert not bad, list(bad.items())[:5]
    assert 0.2 < sum(v > 1 for v in want.values()) / len(want) < 0.8  # both outcomes are well represented
