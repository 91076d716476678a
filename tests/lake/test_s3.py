"""A lake on an object store: `run.lake = "s3://bucket/prefix"` against a real S3-compatible
server process (moto's standalone server, started here on a free port), credentials and endpoint
from the environment as on a cluster. Nothing of the lake may land on local disk."""
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("moto", reason="the S3 tests need moto[s3] and flask (the [dev] extra)")
pytest.importorskip("s3fs", reason="DuckDB reads an s3:// lake through s3fs (the [s3] extra)")

from unstable_dask.lake import (
    Lake,
    storage,  # noqa: E402
)

BUCKET = "lake"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The server process, the AWS_* environment pointing at it (inherited by Dask workers and
    spawned drivers) and a fresh bucket; yields a function making a new lake URI."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = pytest.MonkeyPatch()
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, "moto server did not start"
                time.sleep(0.1)
        for k, v in dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
                         AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
                         AWS_ALLOW_HTTP="true",
                         UNSTABLE_DASK_CACHE=str(tmp_path_factory.mktemp("cache"))).items():
            env.setenv(k, v)
        storage.forget_remote_filesystems()  # filesystems are built from the environment
        import boto3
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        n = iter(range(1000))
        yield lambda: f"s3://{BUCKET}/lakes/{next(n)}"
    finally:
        env.undo()
        storage.forget_remote_filesystems()
        server.kill()
        server.wait()


def _objects(prefix: str) -> list[str]:
    import boto3
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def test_two_drivers_racing_one_round_on_s3_give_one_commit(s3):
    """delta-rs commits with S3 conditional writes (no lock service): of two processes committing
    round 0 at once, one wins and readers see exactly its files, once."""
    from helpers.lakes import commit_in_process, write_round
    lake = s3()
    write_round(lake, 0, "a")
    write_round(lake, 0, "b")
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=commit_in_process, args=(lake, a, barrier, out)) for a in ("a", "b")]
    [p.start() for p in procs]
    [p.join(120) for p in procs]
    results = sorted(out.get(timeout=5) for _ in procs)
    assert results[1] == "lost" and results[0] in ("a", "b")
    winner = results[0]
    assert Lake(lake).sql("SELECT game_id FROM games ORDER BY 1").column(0).to_pylist() == [f"{winner}-0-0", f"{winner}-0-1"]
    assert Lake(lake).sql("SELECT attempt FROM rounds").column(0).to_pylist() == [winner]


def test_a_deleted_file_of_a_committed_round_on_s3_is_named(s3):
    from helpers.lakes import write_round
    lake = s3()
    write_round(lake, 0, "a")
    Lake(lake).commit_round("r", 0, {"attempt": "a", "checkpoint_uid": "base"})
    assert Lake(lake).sql("SELECT count(*) AS n FROM games").to_pylist() == [{"n": 2}]
    storage.delete(f"{lake}/games/run=r/round=0/task-0001.a.parquet")
    from unstable_dask.errors import JobError
    with pytest.raises(JobError, match="task-0001.a.parquet"):
        Lake(lake).sql("SELECT count(*) FROM games")


def test_compact_vacuum_and_time_travel_on_s3(s3):
    from unstable_dask.lake.maintain import checksums, compact, vacuum

    from helpers.lakes import write_round
    lake = s3()
    for rnd in range(2):
        write_round(lake, rnd, f"a{rnd}", n=3)
        Lake(lake).commit_round("r", rnd, {"attempt": f"a{rnd}", "checkpoint_uid": "base"})
    before, then = checksums(Lake(lake).connect()), Lake(lake).versions
    assert compact(lake, run_name="r")["games"] == (6, 2)
    assert len(Lake(lake).table("games").files()) == 2 and checksums(Lake(lake).connect()) == before
    removed = vacuum(lake, retention_hours=0)
    assert len(removed) == 12 and not any(storage.size(f"{lake}/{p}") for p in removed)
    assert checksums(Lake(lake).connect()) == before
    assert Lake(lake).versions["games"] > then["games"]


@pytest.mark.slow
def test_round_learn_round_rate_report_on_s3(s3, tmp_path, monkeypatch):
    """The whole cycle on an s3:// lake: Dask workers write rounds there, the learner reads its
    batch there and uploads the adapter, the next round's workers download and play it, the next
    learner resumes from it (adapter and optimizer state downloaded), the ratings job rates the
    checkpoints, the report renders; nothing of the lake on local disk."""
    from unstable_dask.jobfile import load_job
    from unstable_dask.learn.learner import learn
    from unstable_dask.play.round import play_round
    from unstable_dask.rate.ratings import rate
    from unstable_dask.report.report import report
    monkeypatch.chdir(tmp_path)  # a lake URI mistaken for a path would appear here as ./s3:
    lake = s3()
    prefix = lake.split("/", 3)[3]
    job = load_job(None, {"run.lake": lake, "run.reports": str(tmp_path / "reports"), "run.name": "s3run",
                          "round.train_games": 4, "round.eval_games": 2, "round.games_per_task": 2,
                          "model.max_new_tokens": 8, "cluster.n_workers": 2, "cluster.dashboard": False,
                          "learn.batch_size": 4, "learn.mini_batch_size": 4})
    first = play_round(job)
    assert (first.round, first.games) == (0, 6)
    trained = learn(job)
    assert trained.uid == "ckpt-1" and trained.adapter_path.startswith("adapters/s3run/ckpt-1.")
    adapter_keys = _objects(f"{prefix}/{trained.adapter_path}/")
    assert any(k.endswith("adapter_model.safetensors") for k in adapter_keys), adapter_keys
    second = play_round(job)
    assert (second.round, second.checkpoint_uid, second.games) == (1, "ckpt-1", 6)
    resumed = learn(job)
    assert resumed.uid == "ckpt-2" and resumed.rounds == [1]
    import boto3
    state = boto3.client("s3").get_object(Bucket=BUCKET, Key=f"{prefix}/{resumed.adapter_path}/trainer_state.json")
    assert json.loads(state["Body"].read())["updates"] == 2  # counted on from ckpt-1's downloaded state
    rate(job)
    page = report(job)

    assert Lake(lake).sql("SELECT round, count(*) AS n FROM games GROUP BY 1 ORDER BY 1").to_pylist() == [
        {"round": 0, "n": 6}, {"round": 1, "n": 6}]
    seats = Lake(lake).sql("SELECT DISTINCT model_uid FROM seats WHERE round = 1 AND is_learner").column(0).to_pylist()
    assert seats == ["ckpt-1"]  # round 1's learner seats played the downloaded adapter
    assert Lake(lake).sql("SELECT count(*) AS n FROM learner_steps WHERE checkpoint_uid = 'ckpt-1'").to_pylist()[0]["n"] >= 1
    assert Lake(lake).sql("SELECT uid, parent_uid FROM checkpoints ORDER BY iteration").to_pylist() == [
        {"uid": "ckpt-1", "parent_uid": "base"}, {"uid": "ckpt-2", "parent_uid": "ckpt-1"}]
    rated = set(Lake(lake).sql("SELECT model_uid FROM ratings WHERE env_id = '*'").column(0).to_pylist())
    assert {"base", "ckpt-1"} <= rated
    assert "ckpt-1" in page.read_text()
    assert not (tmp_path / "s3:").exists() and not Path("lake").exists()
    keys = _objects(prefix + "/")
    assert any(k.startswith(f"{prefix}/games/_delta_log/") for k in keys)
    assert not any(k.endswith("lake.duckdb") for k in keys)  # the shell's catalog is for local lakes
    assert os.listdir(Path(os.environ["UNSTABLE_DASK_CACHE"]) / "remote")  # the adapter was downloaded once
