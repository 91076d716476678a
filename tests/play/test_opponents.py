"""Opponent sampling on lakes written by real rounds, learn and rate jobs (builtin:tiny, TicTacToe,
the learner in one seat): match quality with the newest checkpoint's inherited rating, and
UnstableBaselines' win-rate gate."""
from __future__ import annotations

import numpy as np
import pytest
import trueskill

from unstable_dask.errors import JobError
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.learn.learner import learn
from unstable_dask.play.opponents import OpponentPool, list_checkpoints
from unstable_dask.play.round import play_round
from unstable_dask.rate.ratings import rate


def _job(tmp_path, **over):
    base = {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"),
            "round.train_games": 6, "round.eval_games": 0, "round.games_per_task": 4, "round.concurrency": 4,
            "round.train_envs": [{"env_id": "TicTacToe-v0-train", "num_actors": 1}],
            "model.max_new_tokens": 8, "model.lora": {"rank": 4, "alpha": 8},
            "learn.batch_size": 8, "learn.mini_batch_size": 8, "learn.gradient_checkpointing": False}
    return load_job("jobs/demo.toml", base | over)


def _pool(job) -> OpponentPool:
    cks = list_checkpoints(Lake(job.run.lake), job.run.name)
    return OpponentPool(job, Lake(job.run.lake), cks[-1], cks)


def _opponents(job, round_: int) -> set[str]:
    rows = Lake(job.run.lake).sql("SELECT DISTINCT model_uid FROM seats WHERE round = ? AND NOT is_learner", [round_])
    return set(rows.column("model_uid").to_pylist())


@pytest.mark.slow
def test_match_quality_weighs_the_new_checkpoint_by_its_inherited_rating(tmp_path, local_client):
    job = _job(tmp_path, **{"round.opponents": {"strategy": "match-quality", "fixed": ["random"]}})
    assert _pool(job).candidates() == ["random"]  # round 0: the base model may not face itself
    play_round(job, client=local_client)
    assert learn(job).uid == "ckpt-1"
    rate(job)
    rated = {r["model_uid"]: (r["mu"], r["sigma"]) for r in Lake(job.run.lake).sql("SELECT model_uid, mu, sigma FROM ratings WHERE env_id = '*'").to_pylist()}
    assert set(rated) == {"base", "random"}  # ckpt-1 has not played

    pool = _pool(job)
    assert pool.current.uid == "ckpt-1" and pool.candidates() == ["base", "random"]  # not itself
    cfg = job.ratings
    mu, sigma = rated["base"]  # ckpt-1's parent: its mu, its sigma inflated and capped, as `rate` will do
    prior = (mu, min(sigma * cfg.inherit_sigma_factor, cfg.sigma))
    assert pool.rating("ckpt-1") == prior
    env = trueskill.TrueSkill(mu=cfg.mu, sigma=cfg.sigma, beta=cfg.beta, tau=cfg.tau,
                              draw_probability=cfg.draw_probability)
    q = np.array([trueskill.quality_1vs1(env.create_rating(*prior), env.create_rating(*rated[n]), env=env)
                  for n in ("base", "random")])
    w = pool.weights(["base", "random"])
    np.testing.assert_allclose(w, q / q.sum(), rtol=1e-12)
    # The random agent beats the untrained model, so base's child is the closer match.
    assert rated["random"][0] > rated["base"][0] and w[0] > w[1]

    play_round(job, client=local_client)
    assert _opponents(job, 1) <= {"base", "random"}


def _last_wins(job, learner: str, opponent: str, n: int) -> list[bool]:
    """The learner's last n train games against `opponent`, newest first, straight from the seats."""
    return Lake(job.run.lake).sql("""
        SELECT l.reward > o.reward AS win FROM seats l JOIN seats o USING (run, round, game_id)
        WHERE l.is_learner AND NOT o.is_learner AND l.split = 'train'
          AND l.model_uid = ? AND o.model_uid = ?
        ORDER BY round DESC, game_id DESC LIMIT ?""", [learner, opponent, n]).column("win").to_pylist()


@pytest.mark.slow
def test_win_rate_gate_moves_on_exactly_when_the_lake_win_rate_passes_the_threshold(tmp_path, local_client):
    def gated(threshold: float, games: int = 4):
        return _job(tmp_path, **{"round.train_games": 8, "round.opponents": {
            "strategy": "win-rate", "win_rate_threshold": threshold, "win_rate_games": games}})

    job = gated(0.7)
    assert _pool(job).candidates() == ["base"]  # the first opponent: a snapshot of the learner itself
    play_round(job, client=local_client)  # round 0: base vs base, mirror games that do not count
    learn(job)
    assert _pool(job).candidates() == ["base"]  # no game against base counted yet
    play_round(job, client=local_client)  # round 1: ckpt-1 vs base
    assert _opponents(job, 1) == {"base"}

    wins = _last_wins(job, "ckpt-1", "base", 4)
    assert len(wins) == 4
    rate_ = sum(wins) / 4
    # Both models write garbage, so the first to repeat an invalid move loses; the learner's seat
    # alternates with the game index, so it wins some and loses some.
    assert 0 < rate_ < 1, wins
    assert _pool(gated(rate_)).candidates() == ["base"]  # at the threshold: keep
    assert _pool(gated(rate_ - 0.01)).candidates() == ["ckpt-1"]  # above it: the checkpoint about to play
    assert _pool(gated(0.0, games=9)).candidates() == ["base"]  # only 8 games against base so far
    assert _pool(gated(0.0, games=8)).candidates() == ["ckpt-1"]  # a win among all 8 (the last 4 hold one)

    moved = gated(rate_ - 0.01)
    play_round(moved, client=local_client)  # round 2: the gate took ckpt-1 (mirror games again)
    assert _opponents(moved, 2) == {"ckpt-1"}
    learn(moved)
    # The gate still holds ckpt-1 for ckpt-2: its count restarted at round 2 and has no game yet.
    assert _pool(moved).current.uid == "ckpt-2" and _pool(moved).candidates() == ["ckpt-1"]


def test_a_round_naming_a_checkpoint_its_run_lacks_fails_with_the_key_and_commits_nothing(tmp_path, local_client):
    # ckpt-<k> passes the load-time check by its form; only the round can see the run has no ckpt-3.
    job = _job(tmp_path, **{"round.opponents": {"strategy": "fixed", "fixed": ["random", "ckpt-3"]}})
    with pytest.raises(JobError, match=r"key 'round.opponents.fixed\[1\]' names opponent 'ckpt-3'.*"
                                       r"a checkpoint uid of run 'demo'"):
        play_round(job, client=local_client)
    assert Lake(job.run.lake).sql("SELECT count(*) AS n FROM rounds").column("n").to_pylist() == [0]
