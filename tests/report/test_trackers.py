"""Trackers mirror the lake: W&B offline and a local MLflow (sqlite) store, read back after syncing.

The logged series must equal the lake's, a second sync must log nothing, and a resumed loop must
continue the same tracker run without logging a step twice."""
from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from unstable_dask.errors import JobError
from unstable_dask.jobfile import default_job, load_job
from unstable_dask.lake import Lake
from unstable_dask.rate import ratings
from unstable_dask.report import trackers

from helpers import synthetic_lake as sl

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def wandb_rows(wandb_dir: Path, run: str) -> list[dict]:
    """Every history row the offline runs of id `run` hold, in the order they were logged."""
    files = [trackers.wandb_history(f) for f in (wandb_dir / "wandb").glob(f"offline-run-*/run-{run}.wandb")]
    rows = [r for f in sorted((f for f in files if f), key=lambda f: f[0]["_step"]) for r in f]
    assert [r["_step"] for r in rows] == list(range(len(rows)))  # one run, its global step never reused
    return rows


def mlflow_run(run: str):
    from mlflow import MlflowClient
    client = MlflowClient()
    exp = client.get_experiment_by_name(trackers.PROJECT)
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`{trackers.TAG}` = '{run}'")
    assert len(found) == 1  # found again by its tag, never a second run
    return client, found[0].info.run_id


def assert_mirrors(job, wandb_dir: Path) -> dict[str, list[dict]]:
    """The W&B and MLflow series equal the lake's, step by step, each step once."""
    want = trackers.lake_series(Lake(job.run.lake), job.run.name)
    assert all(want.values())  # rounds, ratings and learner steps all present
    got = wandb_rows(wandb_dir, job.run.name)
    for step in trackers.SERIES:
        mine = [{k: v for k, v in r.items() if not k.startswith("_")} for r in got if step in r]
        assert mine == want[step]
    client, run_id = mlflow_run(job.run.name)
    keys = Counter()
    for step, rows in want.items():
        for k in {k for r in rows for k in r}:
            hist = sorted((m.step, m.value) for m in client.get_metric_history(run_id, k))
            assert hist == [(int(r[step]), r[k]) for r in rows if k in r], k
            keys[k] += 1
    assert set(client.get_run(run_id).data.metrics) == set(keys)
    return want


def spot_check(job, series: dict[str, list[dict]]) -> None:
    """A few series against the lake read here with plain SQL, not through trackers.lake_series."""
    q = lambda sql: Lake(job.run.lake).sql(sql, [job.run.name]).to_pylist()  # noqa: E731
    games = {r["round"]: r["games"] for r in q("SELECT round, games FROM rounds WHERE run = ?")}
    assert {r["round"]: r["round/games"] for r in series["round"]} == games
    losses = [r["loss"] for r in q("SELECT loss FROM learner_steps WHERE run = ? ORDER BY iteration, \"update\"")]
    assert [r.get("learner/loss") for r in series["learner_step"]] == losses
    mu = {r["round"]: r["mu"] for r in q("""SELECT h.round, h.mu FROM rating_history h JOIN rounds c
        ON c.run = h.run AND c.round = h.round AND c.checkpoint_uid = h.model_uid WHERE h.run = ? AND h.env_id = '*'""")}
    assert {r["rated_round"]: r["rating/mu"] for r in series["rated_round"] if "rating/mu" in r} == mu and mu


def test_sync_mirrors_a_growing_lake_once(tmp_path: Path, offline: Path) -> None:
    lake_dir = tmp_path / "lake"
    sl.make_run(lake_dir, "syn", rounds=3, games_per_round=12, seed=3, hostile=True, commit_last=False)
    job = default_job()
    job.run.lake, job.run.name, job.run.trackers = str(lake_dir), "syn", ["wandb", "mlflow"]
    ratings.rate(job)
    first = trackers.sync(job)
    assert first["wandb"] == first["mlflow"] > 0
    # The run grows: round 2 is committed, rated, and a learner iteration lands.
    import pyarrow.parquet as pq
    games = pq.read_table(next((lake_dir / "games" / "run=syn" / "round=2").glob("*.parquet"))).to_pylist()
    sl.commit(lake_dir, "syn", 2, games, "ckpt-2")
    sl.write_checkpoint(lake_dir, "syn", 3, "ckpt-3", "ckpt-2", [{"iteration": 3, "step": 0, "update": 0, "loss": 0.25}])
    ratings.rate(job)
    second = trackers.sync(job)
    # exactly the new rows: round 2's stats and rating, one learner step
    assert second == {"wandb": 3, "mlflow": 3}
    assert trackers.sync(job) == {"wandb": 0, "mlflow": 0}
    series = assert_mirrors(job, offline)
    spot_check(job, series)
    assert any(k.startswith("rating/trueskill/") and "_img src_x onerror_" in k for r in series["rated_round"] for k in r)


def test_missing_tracker_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(JobError) as e:
        load_job(None, {"run.trackers": ["wandb", "mlflow"]})
    assert str(e.value) == "<default>: key 'run.trackers': wandb is not installed: pip install 'unstable-dask[trackers]'"


def test_track_command_needs_trackers(capsys: pytest.CaptureFixture) -> None:
    from unstable_dask.cli import main
    assert main(["track"]) == 2
    assert "key 'run.trackers' is empty" in capsys.readouterr().err


@pytest.mark.slow
def test_resumed_loop_continues_the_same_tracker_runs(tmp_path: Path, offline: Path) -> None:
    """Real rounds of the builtin tiny model: loop 1 round, then resume to 2; the trackers hold the
    lake's series once each, and a sync after the loop logs nothing."""
    from unstable_dask.loop import loop
    wn = {"env_id": "WinningNumber-v0-train", "num_players": 2, "num_actors": 1}
    job = load_job("jobs/demo.toml", {
        "run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"), "run.trackers": ["wandb", "mlflow"],
        "model.max_new_tokens": 8, "cluster.n_workers": 1, "cluster.dashboard": False,
        "round.train_games": 8, "round.eval_games": 8, "round.games_per_task": 16, "round.concurrency": 16,
        "round.train_envs": [wn], "round.eval_envs": [wn | {"opponents": ["random"]}],
        "round.opponents": {"strategy": "fixed", "fixed": ["random"]}, "ratings.bootstrap": 20,
        "learn.batch_size": 8, "learn.mini_batch_size": 8, "learn.gradient_checkpointing": False})
    loop(job, rounds=1)
    before = wandb_rows(offline, job.run.name)
    loop(job, rounds=2)
    assert wandb_rows(offline, job.run.name)[:len(before)] == before  # appended to, never rewritten
    assert trackers.sync(job) == {"wandb": 0, "mlflow": 0}
    series = assert_mirrors(job, offline)
    assert [r["round"] for r in series["round"]] == [0, 1]
    assert len(series["learner_step"]) == 2
    spot_check(job, series)
