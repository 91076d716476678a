"""Strength you can see: round.eval_baseline agents replaying the eval games, per-state probes read
from the lake's turns, and figures pooled over rounds, on real TextArena games."""
from __future__ import annotations

import pytest
import textarena as ta

from unstable_dask.config import BASE_UID, LEGAL_RANDOM_UID
from unstable_dask.errors import JobError
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.play.envs import register_envs
from unstable_dask.play.experts import value
from unstable_dask.play.opponents import list_checkpoints
from unstable_dask.play.schedule import schedule_round
from unstable_dask.play.task import play_task
from unstable_dask.report import strength
from unstable_dask.report.report import round_curves

from helpers.tictactoe import boards, recount

TTT = "TicTacToe-v0-train"


def _env(env_id: str, seed: int):
    register_envs()
    env = ta.make(env_id)
    env.reset(num_players=2, seed=seed)
    return env


def _job(tmp_path, **over):
    base = {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"), "model.max_new_tokens": 8,
            "round.train_games": 0, "round.games_per_task": 16, "round.concurrency": 16}
    return load_job("jobs/demo.toml", base | over)


# ---------------------------------------------------------------- the probes on real observations

def test_probes_read_real_tictactoe_states():
    env = _env(TTT, 0)
    for move in ("[0]", "[3]", "[1]"):  # O takes 0 and 1: X (to move) must block 2 and has no win
        env.step(move)
    _, obs = env.get_observation()
    # the lowest empty cell is 2 here: blocking is also the fill order's move; X has lost whatever it
    # plays (O answers with 4 and two threats), so no move gives value away and `optimal` is not probed
    assert strength.classify(TTT, obs, "I block: [2]") == {"forced-block": True, "first-free": True}
    assert strength.classify(TTT, obs, "[5]") == {"forced-block": False, "first-free": False}
    assert strength.classify(TTT, obs, "no move at all") == {"forced-block": False, "first-free": False}
    env.step("[4]")  # X blocks nothing; O can win at 2
    _, obs = env.get_observation()
    # anything but 2 or 5 lets X win at 5: a move that gives value away exists, so `optimal` is probed
    assert strength.classify(TTT, obs, "[2]") == {"take-a-win": True, "first-free": True, "optimal": True}
    assert strength.classify(TTT, obs, "[8] then [2]") == {"take-a-win": False, "first-free": False,
                                                          "optimal": False}  # the env reads the first
    first = _env(TTT, 0).get_observation()[1]
    assert strength.classify(TTT, first, "[4]") == {"first-free": False}  # nothing to win or block
    assert strength.classify(TTT, first, "[0]") == {"first-free": True}  # every first move draws: no `optimal`
    env = _env(TTT, 0)
    env.step("[4]")  # O in the centre: a corner draws, an edge loses
    _, obs = env.get_observation()
    assert strength.classify(TTT, obs, "[0]") == {"first-free": True, "optimal": True}
    assert strength.classify(TTT, obs, "[8]") == {"first-free": False, "optimal": True}
    assert strength.classify(TTT, obs, "[1]") == {"first-free": False, "optimal": False}
    env = _env(TTT, 0)
    for move in ("[0]", "[1]", "[3]", "[4]", "[2]", "[5]", "[7]", "[6]"):  # one empty cell left: no choice
        env.step(move)
    assert strength.classify(TTT, env.get_observation()[1], "[8]") == {}


def test_probes_read_real_kuhn_states():
    env_id = "KuhnPoker-v0-single-train"
    seen = set()
    for seed in range(40):
        env = _env(env_id, seed)
        _, obs = env.get_observation()  # player 1 opens the first hand
        card = obs.rsplit("Your card is: '", 1)[1][0]
        probe = "bet-with-K" if card == "K" else "bet-with-J-or-Q"  # where a bet pays, not only the K
        assert strength.classify(env_id, obs, "[bet]") == {probe: True}
        assert strength.classify(env_id, obs, "[check]") == {probe: False}
        assert strength.classify(env_id, obs, "[fold]") == {probe: False}  # illegal here: not a bet
        seen.add(card)
        env.step("[bet]")
        _, obs = env.get_observation()  # player 0 faces the bet
        card = obs.rsplit("Your card is: '", 1)[1][0]
        if card == "J":
            assert strength.classify(env_id, obs, "[Fold]") == {"fold-with-J": True}
            assert strength.classify(env_id, obs, "[call]") == {"fold-with-J": False}
            seen.add("J facing a bet")
        elif card == "Q":
            assert strength.classify(env_id, obs, "[fold]") == {}
    assert seen == {"K", "Q", "J", "J facing a bet"}


def test_train_probes_pair_each_decision_with_its_seat_s_reward():
    """train_probe_rewards over real observations: per round and probe, the decisions, how many made
    the probed move, and the mean game reward after making it and after missing it."""
    import duckdb
    env = _env(TTT, 0)
    for move in ("[0]", "[3]", "[1]"):  # X (pid 1) to move must block 2
        env.step(move)
    block = env.get_observation()[1]
    empty = _env(TTT, 0).get_observation()[1]
    con = duckdb.connect()
    con.execute("CREATE TABLE turns (run VARCHAR, round BIGINT, game_id VARCHAR, pid INT, split VARCHAR, "
                "is_learner BOOLEAN, env_id VARCHAR, observation VARCHAR, action VARCHAR)")
    con.execute("CREATE TABLE seats (run VARCHAR, game_id VARCHAR, pid INT, reward DOUBLE)")
    rows = [  # game, pid, split, is_learner, observation, action, the seat's reward
        ("g1", 1, "train", True, block, "[2]", 0.0), ("g2", 1, "train", True, block, "[2]", 1.0),
        ("g3", 1, "train", True, block, "[5]", -1.0), ("g3", 1, "train", True, empty, "[0]", -1.0),
        ("g4", 0, "train", False, block, "[5]", 1.0),  # an opponent's decision: not the learner's
        ("g5", 1, "eval", True, block, "[5]", -1.0)]  # an eval game: not trained on
    for gid, pid, split, learner, obs, action, reward in rows:
        con.execute("INSERT INTO turns VALUES ('r', 4, ?, ?, ?, ?, ?, ?, ?)", [gid, pid, split, learner, TTT, obs, action])
        con.execute("INSERT INTO seats SELECT 'r', ?, ?, ? WHERE NOT EXISTS (SELECT 1 FROM seats WHERE game_id = ? AND pid = ?)",
                    [gid, pid, reward, gid, pid])
    got = strength.train_probe_rewards(con, "r")
    assert got[(4, "forced-block")] == {"decisions": 3, "made": 2, "reward_made": 0.5, "reward_missed": -1.0}
    # [2] is also the lowest empty cell there; the empty board's [0] too
    assert got[(4, "first-free")] == {"decisions": 4, "made": 3, "reward_made": pytest.approx(0.0), "reward_missed": -1.0}
    assert got.keys() == {(4, "forced-block"), (4, "first-free")}
    assert strength.train_probe_rewards(con, "other run") == {}


def test_wilson_interval_by_hand():
    # p = 0.375, n = 20: centre (p + z^2/2n) / (1 + z^2/n) = 0.3952, half-width 0.1954
    low, high = strength.wilson(7.5, 20)
    assert (round(low, 4), round(high, 4)) == (0.1998, 0.5905)
    assert strength.wilson(0, 5)[0] == 0 and strength.wilson(5, 5)[1] == 1


# ---------------------------------------------------------------- round.eval_baseline at load

def test_eval_baseline_keeps_its_boolean_form(tmp_path):
    assert _job(tmp_path, **{"round.eval_baseline": True}).round.eval_baseline == [LEGAL_RANDOM_UID]
    assert _job(tmp_path, **{"round.eval_baseline": False}).round.eval_baseline == []


@pytest.mark.parametrize("names,message", [
    (["minimax"], r"key 'round.eval_baseline\[0\]' names 'minimax': minimax has a solver for TicTacToe only, "
                  r"and would play KuhnPoker-v0-train"),
    (["legal-random", "ckpt-3"], r"key 'round.eval_baseline': 'ckpt-3' is no baseline agent: expected 'legal-random' or an expert"),
    (["kuhn-best", "kuhn-best"], r"names an agent twice"),
    (["kuhn-best@2"], r"eps a number in \[0, 1\]"),
])
def test_a_baseline_agent_that_cannot_play_is_refused_at_load(tmp_path, names, message):
    with pytest.raises(JobError, match=message):
        _job(tmp_path, **{"round.eval_baseline": names})  # demo.toml's eval games are Kuhn Poker


# ---------------------------------------------------------------- a real round

@pytest.mark.slow
def test_baseline_agents_replay_the_eval_games_and_the_probes_count_their_moves(tmp_path):
    """eval_baseline = [legal-random, minimax] on TicTacToe against random and minimax: each agent
    replays every eval game in the learner's seat (the minimax replays against minimax all draw,
    though both seats are named minimax); the probes equal a recount from the games' move sequences;
    minimax blocks whenever blocking is not already lost."""
    ttt = {"env_id": TTT, "num_players": 2, "num_actors": 1, "opponents": ["random", "minimax"]}
    job = _job(tmp_path, **{"round.eval_envs": [ttt], "round.eval_games": 40,
                            "round.eval_baseline": ["legal-random", "minimax"], "round.pool_rounds": 2})
    lake = Lake(job.run.lake)
    cks = list_checkpoints(lake, "demo")
    tasks = schedule_round(job, lake, 0, cks[-1], cks)
    games = [g for t in tasks for g in t.games]
    evals = [g for g in games if g.split == "eval"]
    assert len(games) == 3 * 40 and len({g.game_id for g in games}) == 120
    subject = {}  # game_id -> the pid the learner (or the agent in its place) holds
    for agent in (LEGAL_RANDOM_UID, "minimax"):
        twins = [g for g in games if g.split == "baseline" and ("-baseline-minimax-" in g.game_id) == (agent == "minimax")]
        assert len(twins) == 40
        for e, b in zip(evals, twins):
            assert (b.env_id, b.seed) == (e.env_id, e.seed)
            assert [agent if s.is_learner else s.model_uid for s in e.seats] == [s.model_uid for s in b.seats]
            assert not any(s.is_learner for s in b.seats)
            subject[b.game_id] = next(s.pid for s in e.seats if s.is_learner)
    for t in tasks:
        play_task(t, job.model, job.round, lake)
    lake.commit_round("demo", 0, dict(attempt="0", checkpoint_uid=BASE_UID, games=120, temperature=1.0, top_p=1.0,
                                      max_new_tokens=8))
    lake = Lake(job.run.lake)
    con = lake.connect()
    try:
        curves = round_curves(con, "demo", 0)
        counts = strength.probe_counts(con, "demo")
        turns = con.sql("SELECT game_id, turn, pid, action, invalid_move FROM turns WHERE split = 'baseline'").to_arrow_table().to_pylist()
    finally:
        con.close()
    rows = {(r["split"], strength.who(r["split"], r["player"]), r["opponent"]): r for r in curves if r["opponent"] != "*"}
    assert {r["player"] for r in curves if r["split"] == "eval"} == {BASE_UID}
    vs_minimax = sum(1 for e in evals if any(s.model_uid == "minimax" for s in e.seats))
    assert 0 < vs_minimax < 40
    assert rows[("baseline", "minimax", "minimax")]["games"] == vs_minimax
    assert rows[("baseline", "minimax", "minimax")]["draws"] == vs_minimax  # perfect play both ways: all drawn
    assert rows[("baseline", "minimax", "random")]["losses"] == 0
    assert rows[("baseline", LEGAL_RANDOM_UID, "random")]["games"] == 40 - vs_minimax

    expected: dict[tuple[str, str], list[int]] = {}
    by_game: dict[str, list[dict]] = {}
    for t in turns:
        by_game.setdefault(t["game_id"], []).append(t)
    for gid, ts in by_game.items():
        player = "minimax" if "-baseline-minimax-" in gid else LEGAL_RANDOM_UID
        for board, pid, action in boards(ts):
            if pid != subject[gid]:
                continue
            for probe, hit in recount(board, action).items():
                c = expected.setdefault((player, probe), [0, 0])
                c[0], c[1] = c[0] + 1, c[1] + hit
                if player == "minimax" and probe == "forced-block" and value(board) > -1:
                    assert hit, f"minimax let a win through in {gid} on {board}"
    got = {(p, probe): c for (r, split, p, probe), c in counts.items() if split == "baseline"}
    assert got == expected
    rate = {k: hits / n for k, (n, hits) in got.items()}
    assert 0 < rate[(LEGAL_RANDOM_UID, "take-a-win")] < 1
    assert rate[("minimax", "take-a-win")] > rate[(LEGAL_RANDOM_UID, "take-a-win")]

    from unstable_dask.loop import round_summary
    lines = "\n".join(round_summary(job, 0))
    assert f"baseline minimax vs minimax ({vs_minimax} games): win rate 0.50" in lines
    pooled = {(p["split"], p["player"], p["opponent"]): p for p in strength.pooled(curves, [0])}
    for key, p in pooled.items():  # one round pooled is that round's row of the curves query
        assert (p["score"], p["low"], p["high"]) == pytest.approx(
            (rows[key]["win_rate"], rows[key]["win_rate_low"], rows[key]["win_rate_high"]))
    lr = pooled[("baseline", LEGAL_RANDOM_UID, "random")]
    assert ("eval vs random pooled over round 0: score" in lines
            and f"; legal-random {lr['score']:.2f} [{lr['low']:.2f}, {lr['high']:.2f}] ({lr['games']} games" in lines)
    n, hits = got[("minimax", "take-a-win")]
    assert f"minimax {hits / n:.2f} of {n}, pooled {hits / n:.2f}" in lines
