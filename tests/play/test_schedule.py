"""Opponent and env sampling: lagged over recent checkpoints, match quality without ratings, weighted
envs. Pure functions of the lake and the job (match quality and the win-rate gate on real lakes:
tests/test_opponents.py)."""
from collections import Counter

import pytest

from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.play.opponents import Checkpoint
from unstable_dask.play.schedule import schedule_games


def _job(tmp_path, **over):
    return load_job(None, {"run.lake": str(tmp_path), "round.train_games": 400, "round.eval_games": 0,
                           "round.train_envs": [{"env_id": "TicTacToe-v0-train", "num_actors": 1}]} | over)


def _ckpts(n):
    return [Checkpoint("base", None, 0)] + [Checkpoint(f"ckpt-{i}", f"/a/ckpt-{i}", i) for i in range(1, n + 1)]


def _opponents(games):
    return Counter(s.model_uid for g in games for s in g.seats if not s.is_learner)


def test_lagged_samples_the_last_k_older_checkpoints(tmp_path):
    job = _job(tmp_path, **{"round.opponents": {"strategy": "lagged", "lag": 3}})
    cks = _ckpts(6)
    seen = _opponents(schedule_games(job, Lake(job.run.lake), 7, cks[-1], cks))
    assert set(seen) == {"ckpt-3", "ckpt-4", "ckpt-5"}
    assert min(seen.values()) > 100  # uniform: ~133 each of 400
    first = schedule_games(job, Lake(job.run.lake), 0, cks[0], cks[:1])  # nothing older yet: mirror
    assert set(_opponents(first)) == {"base"}


def test_match_quality_is_uniform_without_ratings_and_never_picks_the_checkpoint_itself(tmp_path):
    job = _job(tmp_path, **{"round.opponents": {"strategy": "match-quality", "fixed": ["random"]}})
    cks = _ckpts(2)
    seen = _opponents(schedule_games(job, Lake(job.run.lake), 3, cks[-1], cks))
    assert set(seen) == {"base", "ckpt-1", "random"} and min(seen.values()) > 100  # ~133 each of 400
    only = _job(tmp_path, **{"round.opponents": {"strategy": "match-quality", "fixed": []}})
    assert set(_opponents(schedule_games(only, Lake(only.run.lake), 0, cks[0], cks[:1]))) == {"base"}  # nobody else yet: mirror


def test_weighted_env_sampling_follows_weights(tmp_path):
    job = _job(tmp_path, **{"round.env_sampling": "weighted", "round.train_envs": [
        {"env_id": "TicTacToe-v0-train", "weight": 3.0}, {"env_id": "KuhnPoker-v0-train", "weight": 1.0}]})
    base = _ckpts(0)
    envs = Counter(g.env_id for g in schedule_games(job, Lake(job.run.lake), 0, base[-1], base))
    assert envs["TicTacToe-v0-train"] == pytest.approx(300, abs=45)
    uniform_job = _job(tmp_path, **{"round.train_envs": [e.model_dump() for e in job.round.train_envs]})
    uniform = Counter(g.env_id for g in schedule_games(uniform_job, Lake(uniform_job.run.lake), 0, base[-1], base))
    assert uniform["TicTacToe-v0-train"] == pytest.approx(200, abs=45)
