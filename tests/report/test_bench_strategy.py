"""bench/report/bench_strategy.py's record of a run, on a lake written by real rounds: an SFT start
(learn.algorithm = "sft" on minimax's train moves), then REINFORCE, then an eval-only yardstick round;
`final` pooled over the last 3 rounds, the learner beside legal-random and minimax on the same eval
games, and its draw rate against minimax as an eval opponent."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from unstable_dask.config import LEGAL_RANDOM_UID
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.learn.learner import learn
from unstable_dask.play.round import play_round
from unstable_dask.report import strength

from helpers.tictactoe import boards, recount

ROOT = Path(__file__).resolve().parents[2]
TTT = {"env_id": "TicTacToe-v0-train", "num_players": 2, "num_actors": 1}


def _bench():
    spec = importlib.util.spec_from_file_location("bench_strategy", ROOT / "bench" / "report" / "bench_strategy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _job(tmp_path, extra: dict | None = None, **learn):
    over = {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"), "run.seed": 7,
            "model.max_new_tokens": 8, "round.train_games": 8, "round.eval_games": 8, "round.games_per_task": 8,
            "round.concurrency": 8, "round.train_envs": [TTT], "round.eval_envs": [TTT | {"opponents": ["random"]}],
            "round.opponents": {"strategy": "fixed", "fixed": ["minimax"]},
            "round.eval_baseline": [LEGAL_RANDOM_UID, "minimax"],
            "learn.batch_size": 8, "learn.mini_batch_size": 8, "learn.gradient_checkpointing": False}
    return load_job("jobs/demo.toml", over | (extra or {}) | {f"learn.{k}": v for k, v in learn.items()})


def _scores(lake: Lake, split: str, rounds: list[int], uid_is: str) -> tuple[float, int]:
    """Score (win, draws half) of the seats under study, straight from the seats (not the report's query)."""
    rows = lake.sql(f"""SELECT s.reward, max(o.reward) AS other FROM seats s JOIN seats o ON o.game_id = s.game_id
                        AND o.pid <> s.pid WHERE s.split = '{split}' AND {uid_is} AND list_contains(?, s.round)
                        GROUP BY s.game_id, s.pid, s.reward""", params=[rounds]).to_pylist()
    return sum(1.0 if r["reward"] > r["other"] else 0.5 if r["reward"] == r["other"] else 0.0 for r in rows) / len(rows), len(rows)


@pytest.mark.slow
def test_strategy_record_of_a_real_run(tmp_path, local_client):
    sft, rl = _job(tmp_path, algorithm="sft"), _job(tmp_path)
    play_round(sft, client=local_client)
    learn(sft)  # ckpt-1: SFT on minimax's train moves
    for _ in range(3):
        play_round(rl, client=local_client)
        learn(rl)
    lake = Lake(rl.run.lake)
    bench = _bench()
    con = lake.connect()
    try:
        rec = bench.run_rows(con, rl.run.name)
    finally:
        con.close()
    assert (rec["game"], rec["seed"], rec["model"], rec["start"]) == ("TicTacToe", 7, "builtin:tiny", "ckpt-1")
    assert rec["taught_by"] == []  # no ExpertMove: RL from the game's reward after the SFT start
    assert rec["job"]["round"]["eval_baseline"] == [LEGAL_RANDOM_UID, "minimax"] and rec["wall_minutes"] > 0
    f = rec["final"]
    assert f["rounds"] == [1, 2, 3] and f["games"] == 24 and f["legal_random_games"] == 24
    score, n = _scores(lake, "eval", [1, 2, 3], "s.is_learner")
    assert n == 24 and f["score"] == pytest.approx(score)
    assert f["score_ci"] == pytest.approx(list(strength.wilson(score * n, n)))
    lr, n = _scores(lake, "baseline", [1, 2, 3], f"s.model_uid = '{LEGAL_RANDOM_UID}'")
    assert n == 24 and f["legal_random_score"] == pytest.approx(lr)
    assert f["legal_random_ci"][0] <= lr <= f["legal_random_ci"][1]
    mm, n = _scores(lake, "baseline", [1, 2, 3], "s.model_uid = 'minimax'")
    assert f["baselines"]["minimax"]["score"] == pytest.approx(mm) and f["baselines"]["minimax"]["games"] == 24
    # the paired gap: the learner's score minus the agent's on the same eval game, recounted pair by pair
    for agent in (LEGAL_RANDOM_UID, "minimax"):
        pairs = lake.sql(f"""SELECT e.reward AS er, eo.reward AS eo, b.reward AS br, bo.reward AS bo
            FROM seats e JOIN seats eo ON eo.game_id = e.game_id AND eo.pid <> e.pid
            JOIN seats b ON b.round = e.round AND b.seed = e.seed AND b.pid = e.pid AND b.split = 'baseline'
                AND b.model_uid = '{agent}'
            JOIN seats bo ON bo.game_id = b.game_id AND bo.pid <> b.pid
            WHERE e.split = 'eval' AND e.is_learner AND e.round >= 1""").to_pylist()
        d = [(1.0 if p["er"] > p["eo"] else 0.5 if p["er"] == p["eo"] else 0.0)
             - (1.0 if p["br"] > p["bo"] else 0.5 if p["br"] == p["bo"] else 0.0) for p in pairs]
        mean = sum(d) / len(d)
        half = 1.959963984540054 * (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
        gap = f["baselines"][agent]["gap"]
        assert gap["pairs"] == len(d) == 24 and gap["gap"] == pytest.approx(mean)
        assert gap["ci"] == pytest.approx([mean - half, mean + half])
    assert f["legal_random_gap"] == f["baselines"][LEGAL_RANDOM_UID]["gap"]
    draws = lake.sql("""SELECT avg((s.reward = o.reward)::DOUBLE) AS d FROM seats s JOIN seats o ON o.game_id = s.game_id
                        AND o.pid <> s.pid WHERE s.split = 'baseline' AND s.model_uid = 'minimax' AND s.round >= 1""").to_pylist()
    assert f["minimax_draw_rate"] == pytest.approx(draws[0]["d"])
    probes = {(p["player"], p["probe"]): p for p in f["probes"]}
    assert {("learner", "first-free"), (LEGAL_RANDOM_UID, "first-free"), ("minimax", "take-a-win")} <= probes.keys()
    con = lake.connect()
    try:
        counts = strength.probe_counts(con, rl.run.name)
    finally:
        con.close()
    per_round = [p for r in (1, 2, 3) for p in strength.probe_rows(counts, [r])
                 if p["player"] == "learner" and p["probe"] == "first-free"]
    assert sum(p["decisions"] for p in per_round) == probes[("learner", "first-free")]["decisions"] > 0
    assert all("first-free" in r["learner_probes"] for r in rec["rounds"])

    # train_probes: the learner's train decisions recounted from each game's move sequence, with its seat's reward
    turns = lake.sql("""SELECT t.round, t.game_id, t.turn, t.pid, t.action, t.invalid_move, t.is_learner, s.reward
                        FROM turns t JOIN seats s ON s.game_id = t.game_id AND s.pid = t.pid
                        WHERE t.split = 'train' AND t.run = ?""", params=[rl.run.name]).to_pylist()
    by_game: dict[str, list[dict]] = {}
    for t in turns:
        by_game.setdefault(t["game_id"], []).append(t)
    expected: dict[tuple[int, str], dict] = {}
    for ts in by_game.values():
        learner, reward = {(t["pid"], t["reward"]) for t in ts if t["is_learner"]}.pop()
        for board, pid, action in boards(ts):
            for probe, hit in recount(board, action).items() if pid == learner else ():
                e = expected.setdefault((ts[0]["round"], probe), {"made": [], "missed": []})
                e["made" if hit else "missed"].append(reward)
    assert {k[0] for k in expected} == {0, 1, 2, 3}  # the tiny model's moves are rarely valid: mostly first-free here
    for r in rec["rounds"]:
        got = {(r["round"], p): t for p, t in r["train_probes"].items()}
        want = {k: v for k, v in expected.items() if k[0] == r["round"]}
        assert got.keys() == want.keys()
        for k, t in got.items():
            made, missed = want[k]["made"], want[k]["missed"]
            assert (t["decisions"], t["made"]) == (len(made) + len(missed), len(made))
            for mean, xs in ((t["reward_made"], made), (t["reward_missed"], missed)):
                assert mean == (pytest.approx(sum(xs) / len(xs)) if xs else None)

    # `loop`'s line and the run page pool the same rounds
    from unstable_dask.loop import round_summary
    from unstable_dask.report import report
    lines = "\n".join(round_summary(rl, 3))
    lo, hi = f["score_ci"]
    assert f"eval vs random pooled over rounds 1-3: score {f['score']:.2f} [{lo:.2f}, {hi:.2f}] (24 games" in lines
    assert f"; legal-random {f['legal_random_score']:.2f}" in lines and "; minimax " in lines
    html = report.report(rl).read_text()
    section = html[html.index('id="strength"'):html.index('id="history"')]
    assert "pooled over rounds 1-3" in section and 'id="probes-table"' in section
    for who in ("learner", LEGAL_RANDOM_UID, "minimax", "take-a-win"):
        assert f">{who}<" in section, who

    # An eval-only yardstick round, run with another job (no train games, no minimax replays, minimax
    # as an eval opponent, another algorithm): the record keeps the job that trained and the newest
    # checkpoint's algorithm, pools the new round in, and gives the learner's own draw rate against minimax.
    yard = _job(tmp_path, {"round.train_games": 0, "round.eval_envs": [TTT | {"opponents": ["random", "minimax"]}],
                           "round.eval_baseline": [LEGAL_RANDOM_UID]}, algorithm="sft")
    play_round(yard, client=local_client)
    con = lake.refresh().connect()
    try:
        rec = bench.run_rows(con, rl.run.name)
    finally:
        con.close()
    assert rec["job"]["round"]["train_games"] == 8 and rec["algorithm"] == "reinforce"
    assert rec["final"]["rounds"] == [2, 3, 4]
    vs_minimax = rec["final_by_opponent"]["minimax"]
    draws = lake.sql("""SELECT count(*) AS n, sum((s.reward = o.reward)::INT) AS d FROM seats s JOIN seats o
                        ON o.game_id = s.game_id AND o.pid <> s.pid
                        WHERE s.split = 'eval' AND s.is_learner AND s.round = 4 AND o.model_uid = 'minimax'""").to_pylist()[0]
    assert vs_minimax["games"] == draws["n"] > 0 and vs_minimax["rounds"] == [2, 3, 4]
    assert vs_minimax["minimax_draw_rate"] == pytest.approx(draws["d"] / draws["n"])


def test_keep_merges_records_by_run_seed_and_lake():
    """`--keep`: a job's seeds share its run name and are read from their own lakes; reading seed 1's
    lake again replaces seed 1's record only; the same run and seed in another lake (a rolled-back
    copy continued by another job) is a record of its own."""
    old = [{"run": "ttt", "seed": 0, "lake": "l0", "v": "a"}, {"run": "ttt", "seed": 1, "lake": "l1", "v": "b"},
           {"run": "kuhn", "seed": 1, "lake": "k1", "v": "c"}]
    new = [{"run": "ttt", "seed": 1, "lake": "l1", "v": "d"}, {"run": "ttt", "seed": 2, "lake": "l2", "v": "e"},
           {"run": "ttt", "seed": 0, "lake": "l0-branch", "v": "f"}]
    assert [r["v"] for r in _bench().merge_runs(old, new)] == ["a", "c", "d", "e", "f"]


def test_a_run_of_sft_checkpoints_only_started_from_base_and_is_labelled_by_its_checkpoints():
    """DAgger (every checkpoint `sft`) started from the base model; SFT then RL started from the last
    SFT checkpoint; the algorithm is the newest checkpoint's, not the newest round's job (an eval-only
    yardstick round may run another job)."""
    import duckdb
    bench, con = _bench(), duckdb.connect()
    con.execute("CREATE TABLE checkpoints (run VARCHAR, uid VARCHAR, algorithm VARCHAR, iteration INTEGER)")
    con.execute("""INSERT INTO checkpoints VALUES ('dagger', 'ckpt-1', 'sft', 1), ('dagger', 'ckpt-2', 'sft', 2),
                   ('rl', 'ckpt-1', 'sft', 1), ('rl', 'ckpt-2', 'reinforce', 2), ('rl', 'ckpt-3', 'reinforce', 3)""")
    assert (bench.start(con, "dagger"), bench.algorithm(con, "dagger")) == ("base", "sft")
    assert (bench.start(con, "rl"), bench.algorithm(con, "rl")) == ("ckpt-1", "reinforce")
    assert (bench.start(con, "none"), bench.algorithm(con, "none")) == ("base", None)
