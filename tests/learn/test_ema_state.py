"""The role-advantage EMA's state in the lake (`baselines`, learn/ema.py): a batch that starts from
a stored state equals the batch of a scan of the run's whole history (to 1e-12), the state is the
EMA a plain loop over every past game gives, and a state is only reused by the identical chain."""
from __future__ import annotations

import uuid
from collections import defaultdict

import pytest

from unstable_dask.errors import JobError
from unstable_dask.lake import Lake
from unstable_dask.learn.ema import RoleAdvantageByEnvFormatter, RoleAdvantageFormatter, find_state, signature
from unstable_dask.learn.rewards import batch_query, run_batch_query, state_rows
from unstable_dask.learn.transforms import NoForfeitWins, PenaltyForInvalidMove, RewardForFormat, parse_transform

from helpers.lakes import RUN, make_lake

# A user's per-game SQL before the EMA: it changes the rewards the EMA averages.
SHIFT = "SELECT * REPLACE (reward * 2 + 0.25 AS reward) FROM final"
CHAINS = {
    "tau=0.3": [RoleAdvantageFormatter(0.3)],
    "by env": [RoleAdvantageByEnvFormatter(0.05)],
    "forfeits first": [NoForfeitWins(), RoleAdvantageByEnvFormatter(0.2)],
    "user sql first": [parse_transform(SHIFT, "final"), RoleAdvantageFormatter(0.1)],
    "two emas": [RoleAdvantageFormatter(0.3), RoleAdvantageByEnvFormatter(0.2)],
}
STEP = [RewardForFormat(1.5), PenaltyForInvalidMove(1.0, -1.0)]


def commit_state(root, iteration: int, rounds: list[int], final) -> int:
    """What a learner iteration over `rounds` commits: the state after max(rounds), with its checkpoint."""
    lake = Lake(root)
    con = lake.connect()
    rows = state_rows(con, RUN, rounds, final)
    con.close()
    attempt = uuid.uuid4().hex[:8]
    lake.write("baselines", RUN, iteration, f"baselines.{attempt}", rows)
    lake.commit("checkpoints", RUN, iteration, "checkpoint", dict(attempt=attempt, uid=f"ckpt-{iteration}",
                                                                 rounds_trained=rounds))
    return rows.num_rows


def by_key(table) -> dict:
    return {(r["round"], r["game_id"], r["turn"], r["pid"]): r for r in table.to_pylist()}


def assert_same_batch(con, rounds, final, state):
    """The batch from the state equals the full scan's, row for row."""
    with_state = by_key(run_batch_query(con, batch_query(RUN, rounds, 10**6, 0, final, STEP, [], state=state)))
    full = by_key(run_batch_query(con, batch_query(RUN, rounds, 10**6, 0, final, STEP, [])))
    assert with_state.keys() == full.keys() and full
    for k, row in full.items():
        assert with_state[k]["final_reward"] == pytest.approx(row["final_reward"], abs=1e-12, rel=0)
        assert with_state[k]["advantage"] == pytest.approx(row["advantage"], abs=1e-12, rel=0)


@pytest.fixture(scope="module")
def rounds_lake(tmp_path_factory):
    return make_lake(tmp_path_factory.mktemp("ema"), rounds=6, games=30)


@pytest.mark.parametrize("name", CHAINS)
def test_batches_from_the_stored_state_equal_the_full_history_scan(tmp_path, rounds_lake, name):
    """Iterations trained on the newest round each, as `learn.window = "latest"` does: every batch
    after the first starts from the state its predecessor committed, and scans one round."""
    import shutil
    shutil.copytree(rounds_lake, tmp_path / "lake")
    root, final = tmp_path / "lake", CHAINS[name]
    for r in range(1, 7):
        con = Lake(root).connect()
        state = find_state(con, RUN, [r], final)
        assert state == (None if r == 1 else r - 1)
        assert_same_batch(con, [r], final, state)
        sql = batch_query(RUN, [r], 10, 0, final, STEP, [], state=state)
        assert ("FROM baselines" in sql) == (state is not None)  # --show-sql shows where b0 comes from
        con.close()
        assert commit_state(root, r, [r], final) > 0
    # a window of three rounds starts from the state before them
    con = Lake(root).connect()
    assert find_state(con, RUN, [4, 5, 6], final) == 3
    assert_same_batch(con, [4, 5, 6], final, 3)
    assert find_state(con, RUN, [1, 2], final) is None  # window = "all": the full scan


def reference_state(root, tau: float, by_env: bool, upto: int) -> dict:
    """A plain loop over every train game of rounds <= upto: (is_learner, env_id, pid) -> (games, b)."""
    seats = Lake(root).connect().sql(f"SELECT round, game_id, env_id, pid, is_learner, reward FROM seats "
                                     f"WHERE run = '{RUN}' AND split = 'train' AND round <= {upto}").fetchall()
    state: dict = defaultdict(lambda: (0, 0.0))
    for _, _, env, pid, learner, r in sorted(seats, key=lambda s: (s[0], s[1])):
        key = (learner, env if by_env else None, pid)
        n, b = state[key]
        state[key] = (n + 1, (1 - tau) * b + tau * r)
    return dict(state)


def test_the_state_is_the_ema_of_every_past_game_for_learners_and_opponents(tmp_path):
    """The state after each round, carried from round to round, is the loop's b over the whole
    history, with the games counted; opponents' seats have their own keys; a key with no game in
    the newest round keeps its row."""
    root = make_lake(tmp_path / "lake", rounds=4, games=30)
    # round 5: only EnvA games, so EnvB's keys must be carried over unchanged
    make_lake(root, rounds=1, games=30, seed=3, first=5)
    for final, by_env in (([RoleAdvantageFormatter(0.3)], False), ([RoleAdvantageByEnvFormatter(0.05)], True)):
        for r in range(1, 6):
            commit_state(root, 10 * by_env + r, [r], final)
        got = Lake(root).sql("SELECT round, is_learner, env_id, pid, games, b FROM baselines WHERE transform = ?",
                             [signature(final, 0)]).to_pylist()
        for r in range(1, 6):
            ref = reference_state(root, final[0].tau, by_env, r)
            rows = {(g["is_learner"], g["env_id"], g["pid"]): (g["games"], g["b"]) for g in got if g["round"] == r}
            assert rows.keys() == ref.keys()
            assert {k[0] for k in ref} == {True, False}  # opponents' seats are keys of their own
            for k, (n, b) in ref.items():
                assert rows[k][0] == n and rows[k][1] == pytest.approx(b, abs=1e-12, rel=0)


def test_a_state_is_reused_only_by_the_identical_chain(tmp_path):
    """Another tau, another transform before the EMA or a user's SQL changed by one character
    finds no state: their batches are the full scan's, never one started from a stale b."""
    root = make_lake(tmp_path / "lake", rounds=3, games=30)
    final = CHAINS["user sql first"]
    for r in (1, 2):
        commit_state(root, r, [r], final)
    con = Lake(root).connect()
    assert find_state(con, RUN, [3], final) == 2
    others = [[parse_transform(SHIFT.replace("0.25", "0.26"), "final"), RoleAdvantageFormatter(0.1)],
              [RoleAdvantageFormatter(0.1)], [parse_transform(SHIFT, "final"), RoleAdvantageFormatter(0.2)],
              [NoForfeitWins(), parse_transform(SHIFT, "final"), RoleAdvantageFormatter(0.1)],
              [parse_transform(SHIFT, "final"), RoleAdvantageByEnvFormatter(0.1)]]
    for other in others:
        assert find_state(con, RUN, [3], other) is None
    # a chain that only appends a stateless transform after the EMA reuses it
    assert find_state(con, RUN, [3], final + [NoForfeitWins()]) == 2
    # the stale state, were it used, would give another batch: the signature is what keeps it out
    with_stale = run_batch_query(con, batch_query(RUN, [3], 10**6, 0, others[0], STEP, [], state=2))
    full = run_batch_query(con, batch_query(RUN, [3], 10**6, 0, others[0], STEP, []))
    assert max(abs(a - b) for a, b in zip(with_stale.column("advantage").to_pylist(),
                                          full.column("advantage").to_pylist())) > 1e-6


def test_a_lake_from_before_the_table_reads_as_empty_and_a_lost_log_is_still_an_error(tmp_path):
    """A lake whose learner commits predate `baselines` has no log of it: it reads as an empty
    table and batches are full scans. A lake whose commits counted rows of it and lost its log is
    an error naming the table, never an empty table."""
    import shutil
    root = make_lake(tmp_path / "lake", rounds=2, games=12)
    Lake(root).commit("checkpoints", RUN, 1, "checkpoint", dict(attempt="0000aaaa", uid="ckpt-1", rounds_trained=[1]))
    shutil.rmtree(root / "baselines")
    con = Lake(root).connect()
    assert con.sql("SELECT count(*) FROM baselines").fetchall() == [(0,)]
    assert find_state(con, RUN, [2], CHAINS["tau=0.3"]) is None
    commit_state(root, 2, [2], CHAINS["tau=0.3"])
    assert Lake(root).sql("SELECT baselines FROM checkpoints WHERE iteration = 2").column(0).to_pylist() == [
        Lake(root).sql("SELECT count(*) FROM baselines").column(0)[0].as_py()]
    shutil.rmtree(root / "baselines" / "_delta_log")
    with pytest.raises(JobError, match="table 'baselines' has no Delta log"):
        Lake(root).sql("SELECT count(*) FROM baselines")


@pytest.mark.slow
def test_the_learner_commits_the_state_and_its_next_batch_equals_the_full_scan(tmp_path, local_client):
    """REAL rounds (the demo job, builtin:tiny, REINFORCE's RoleAdvantageByEnvFormatter): the first
    iteration scans everything and commits the state after round 0 with its checkpoint; the next
    iteration's query starts from it (`--show-sql` reads `baselines`), its batch equals the full
    scan's, and the state it commits after round 1 equals the one a full scan gives."""
    from unstable_dask.jobfile import load_job
    from unstable_dask.learn.learner import batch_seed, build_query, learn, plan
    from unstable_dask.learn.rewards import state_query
    from unstable_dask.learn.transforms import parse_transforms
    from unstable_dask.play.round import play_round
    job = load_job("jobs/demo.toml", {
        "run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"), "round.train_games": 8,
        "round.eval_games": 0, "model.max_new_tokens": 8, "learn.batch_size": 8, "learn.mini_batch_size": 4,
        "learn.gradient_checkpointing": False, "learn.final_transforms": ["RoleAdvantageByEnvFormatter(0.2)"]})
    final = parse_transforms(job.learn.final_transforms, "final")
    play_round(job, client=local_client)
    assert "FROM baselines" not in learn(job, show_sql=True)
    learn(job)
    lake = Lake(job.run.lake)
    n = lake.sql("SELECT baselines FROM checkpoints WHERE iteration = 1").column(0).to_pylist()
    assert n == [lake.sql("SELECT count(*) FROM baselines WHERE round = 0 AND iteration = 1").column(0)[0].as_py()] != [0]
    play_round(job, client=local_client)
    p = plan(job)
    con = Lake(job.run.lake).connect()
    sql = build_query(job, p, 0, con)
    assert "FROM baselines" in sql and learn(job, show_sql=True) == sql
    full = by_key(run_batch_query(con, batch_query(
        p.run_name, p.rounds, job.learn.batch_size, batch_seed(job, p.iteration, 0), final,
        parse_transforms(job.learn.step_transforms, "step"), parse_transforms(job.learn.sampling_transforms, "sampling"))))
    got = by_key(run_batch_query(con, sql))
    assert got.keys() == full.keys() and got
    for k, row in full.items():
        assert got[k]["advantage"] == pytest.approx(row["advantage"], abs=1e-12, rel=0)
    learn(job)
    ref = {(r["is_learner"], r["env_id"], r["pid"]): (r["games"], r["b"])
           for r in con.sql(state_query(job.run.name, 1, None, final)).to_arrow_table().to_pylist()}
    con.close()
    rows = Lake(job.run.lake).sql("SELECT is_learner, env_id, pid, games, b FROM baselines WHERE round = 1").to_pylist()
    assert {(r["is_learner"], r["env_id"], r["pid"]) for r in rows} == ref.keys()
    for r in rows:
        n, b = ref[(r["is_learner"], r["env_id"], r["pid"])]
        assert r["games"] == n and r["b"] == pytest.approx(b, abs=1e-12, rel=0)
