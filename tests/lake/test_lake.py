"""The lake: atomic writes, commit markers, and readback through DuckDB, pandas and pyarrow."""
import os

import duckdb
import pyarrow.parquet as pq
import pytest

from unstable_dask.lake import Lake
from unstable_dask.lake.commit import now


def _game(gid: str, reward: float = 1.0) -> dict:
    t = now()
    seat = lambda pid, r: dict(pid=pid, model_uid="base", is_learner=True, role=f"Player {pid}", reward=r,
                               invalid_move=False, reason="")
    return dict(game_id=gid, split="train", env_id="SimpleTak-v0-train", seed=1, num_players=2, num_turns=5,
                started_at=t, finished_at=t, worker="w", task="task-0000", seats=[seat(0, reward), seat(1, -reward)])


def _commit(lake, run, rnd):
    t = now()
    return Lake(lake).commit_round(run, rnd, dict(checkpoint_uid="base", games=1, turns=0, tasks=1,
                                                completion_tokens=0, job_fingerprint="f", job="{}",
                                                started_at=t, committed_at=t))


def test_uncommitted_rounds_are_invisible(tmp_path):
    Lake(tmp_path).write("games", "r1", 0, "task-0000", [_game("a")])
    Lake(tmp_path).write("games", "r1", 1, "task-0000", [_game("b")])
    _commit(tmp_path, "r1", 0)
    con = Lake(tmp_path).connect()
    assert con.sql("SELECT game_id FROM games").fetchall() == [("a",)]
    assert con.sql("SELECT count(*) FROM seats").fetchall() == [(2,)]
    _commit(tmp_path, "r1", 1)
    assert Lake(tmp_path).connect().sql("SELECT count(*) FROM games").fetchall() == [(2,)]


def test_commit_marker_is_exclusive(tmp_path):
    _commit(tmp_path, "r1", 0)
    with pytest.raises(FileExistsError):
        _commit(tmp_path, "r1", 0)


def test_retried_task_replaces_its_file(tmp_path):
    Lake(tmp_path).write("games", "r1", 0, "task-0000", [_game("a", 1.0)])
    Lake(tmp_path).write("games", "r1", 0, "task-0000", [_game("a", -1.0)])  # the retry
    _commit(tmp_path, "r1", 0)
    rows = Lake(tmp_path).sql("SELECT game_id, reward FROM seats WHERE pid = 0").to_pylist()
    assert rows == [{"game_id": "a", "reward": -1.0}]
    assert [p.name for p in (tmp_path / "games/run=r1/round=0").iterdir()] == ["task-0000.parquet"]


def test_torn_and_temp_files_are_skipped(tmp_path):
    Lake(tmp_path).write("games", "r1", 0, "task-0000", [_game("a")])
    d = tmp_path / "games/run=r1/round=0"
    good = (d / "task-0000.parquet").read_bytes()
    (d / "task-0001.parquet").write_bytes(good[: len(good) // 2])  # no footer
    (d / "task-0002.parquet").write_bytes(b"")
    (d / ".task-0003.abcd.tmp").write_bytes(good)
    _commit(tmp_path, "r1", 0)
    assert Lake(tmp_path).sql("SELECT count(*) AS n FROM games").to_pylist() == [{"n": 1}]


def test_empty_lake_has_typed_empty_views(tmp_path):
    con = Lake(tmp_path).connect()
    assert con.sql("SELECT count(*) FROM turns WHERE format_ok").fetchall() == [(0,)]
    assert con.sql("SELECT count(*) FROM seats").fetchall() == [(0,)]


def test_readback_pandas_pyarrow_and_duckdb_shell_file(tmp_path):
    Lake(tmp_path).write("games", "r1", 0, "task-0000", [_game("a")])
    _commit(tmp_path, "r1", 0)
    df = Lake(tmp_path).connect().sql("SELECT * FROM games").df()
    assert df.loc[0, "game_id"] == "a" and df.loc[0, "round"] == 0 and len(df.loc[0, "seats"]) == 2
    table = pq.read_table(tmp_path / "games")  # plain pyarrow reads the hive layout too
    assert table.column("run").to_pylist() == ["r1"] and table.num_rows == 1
    catalog = Lake(tmp_path).refresh_catalog()
    con = duckdb.connect(str(catalog), read_only=True)
    assert con.sql("SELECT model_uid, count(*) FROM seats GROUP BY 1").fetchall() == [("base", 2)]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_user_sql_cannot_write_or_read_outside(tmp_path):
    from unstable_dask.errors import JobError
    for sql in [f"COPY (SELECT 1) TO '{tmp_path}/x.csv'", "CREATE TABLE t AS SELECT 1", "ATTACH 'x.db'",
                "INSTALL httpfs", "SET enable_external_access = true"]:
        with pytest.raises(JobError):
            Lake(tmp_path).sql(sql)
    with pytest.raises(JobError):
        Lake(tmp_path).sql("SELECT * FROM read_csv('/etc/passwd')")
    assert not (tmp_path / "x.csv").exists()


def test_sql_command_prints_table_csv_and_json(tmp_path, capsys):
    import json

    from unstable_dask import cli as run
    Lake(tmp_path).write("games", "r1", 0, "task-0000", [_game("a"), _game("b")])
    _commit(tmp_path, "r1", 0)
    q = "SELECT game_id, count(*) AS seats FROM seats GROUP BY 1 ORDER BY 1"
    assert run.main(["sql", q, "--lake", str(tmp_path), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ['"game_id","seats"', '"a",2', '"b",2']
    assert run.main(["sql", q, "--lake", str(tmp_path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"game_id": "a", "seats": 2}, {"game_id": "b", "seats": 2}]
    assert run.main(["sql", q, "--lake", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "game_id" in out and "│ a" in out


def test_sql_table_shows_model_text_as_written(tmp_path, capsys):
    """Moves are bracketed ("[bet]", "[3]"): the table prints them, not as rich markup (which drops them)."""
    from unstable_dask import cli as run
    Lake(tmp_path).write("games", "r1", 0, "task-0000", [_game("a")])
    _commit(tmp_path, "r1", 0)
    q = "SELECT '[bet] then [red]x[/red]' AS \"[move]\", game_id FROM games"
    assert run.main(["sql", q, "--lake", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[bet] then [red]x[/red]" in out and "[move]" in out


def test_a_lake_uri_other_than_s3_is_refused_when_the_job_loads():
    from unstable_dask.errors import JobError
    from unstable_dask.jobfile import load_job
    for uri in ("gs://bucket/lake", "s3://", "file:///tmp/lake"):
        with pytest.raises(JobError, match=r"run\.lake.*local folder or an s3://bucket/prefix URI"):
            load_job(None, {"run.lake": uri})
    assert load_job(None, {"run.lake": "s3://bucket/lake"}).run.lake == "s3://bucket/lake"
