"""The lake on Delta: committed files named by the log, one commit per partition under races,
errors that name a missing file, time travel, migration of an old-format lake, the README's
column tables generated from the catalog."""
import multiprocessing as mp
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from unstable_dask.errors import JobError
from unstable_dask.lake import Lake, catalog, commit
from unstable_dask.lake import delta as dl
from unstable_dask.lake.maintain import checksums, compact, vacuum
from unstable_dask.lake.migrate import migrate

from helpers.lakes import commit_in_process, write_round

ROOT = Path(__file__).resolve().parents[2]


def test_a_deleted_data_file_of_a_committed_round_is_named(tmp_path):
    write_round(tmp_path, 0, "a")
    Lake(tmp_path).commit_round("r", 0, {"attempt": "a", "checkpoint_uid": "base"})
    victim = tmp_path / "games/run=r/round=0/task-0001.a.parquet"
    victim.unlink()
    with pytest.raises(JobError, match="task-0001.a.parquet"):
        Lake(tmp_path).sql("SELECT count(*) FROM games")
    other = tmp_path / "torn"
    write_round(other, 0, "a")
    Lake(other).commit_round("r", 0, {"attempt": "a", "checkpoint_uid": "base"})
    (other / "turns/run=r/round=0/task-0000.a.parquet").write_bytes(b"PAR1 torn")
    with pytest.raises(JobError, match="task-0000.a.parquet"):
        Lake(other).sql("SELECT count(*) FROM turns")


def test_two_drivers_racing_one_round_give_one_commit(tmp_path):
    """Two processes commit round 0 at the same instant, each with its own files: one wins, the
    other is refused, and readers see exactly the winner's files, once."""
    write_round(tmp_path, 0, "a")
    write_round(tmp_path, 0, "b")
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=commit_in_process, args=(str(tmp_path), a, barrier, out)) for a in ("a", "b")]
    [p.start() for p in procs]
    [p.join(120) for p in procs]
    results = sorted(out.get(timeout=5) for _ in procs)
    assert results[1] == "lost" and results[0] in ("a", "b")
    winner = results[0]
    games = Lake(tmp_path).sql("SELECT game_id FROM games ORDER BY 1").column(0).to_pylist()
    assert games == [f"{winner}-0-0", f"{winner}-0-1"]
    assert Lake(tmp_path).sql("SELECT attempt FROM rounds").column(0).to_pylist() == [winner]
    assert Lake(tmp_path).last_round("r") == 0


def test_a_commit_killed_after_its_claim_is_finished(tmp_path):
    """The driver dies between claiming round 0 and publishing it: readers see nothing of it, and
    the next driver finishes it from the log before playing round 1."""
    write_round(tmp_path, 0, "a")
    marker = commit.write_file(str(tmp_path), "rounds", "r", 0, "commit.a", commit.as_table("rounds", [{"attempt": "a", "checkpoint_uid": "base", "files": [
                                f"{t}/run=r/round=0/task-000{i}.a.parquet" for t in ("games", "turns") for i in (0, 1)]}]))
    app = dl.app_id("r", "round", 0)
    assert dl.commit(tmp_path, "rounds", [], app=app, metadata={"unstable_dask.claim": app,
                                                                 "unstable_dask.marker": str(Path(marker).relative_to(tmp_path / "rounds"))})
    assert Lake(tmp_path).sql("SELECT count(*) AS n FROM games").to_pylist() == [{"n": 0}]
    assert Lake(tmp_path).last_round("r") == 0  # claimed: nobody plays round 0 again
    assert Lake(tmp_path).finish_commits("rounds", "r") == [0]
    assert Lake(tmp_path).sql("SELECT count(*) AS n FROM games").to_pylist() == [{"n": 2}]
    assert Lake(tmp_path).finish_commits("rounds", "r") == []


def test_a_commit_landing_while_a_reader_loads_its_snapshot_shows_all_or_nothing(tmp_path, monkeypatch):
    """Another driver commits round 1 while a reader is between loading one table's log and the
    next: the reader shows round 1 whole (games, turns and its rounds row) or not at all."""
    write_round(tmp_path, 0, "a")
    Lake(tmp_path).commit_round("r", 0, {"attempt": "a", "checkpoint_uid": "base"})
    write_round(tmp_path, 1, "b")
    real, landed = dl.snapshot, []

    def snapshot(lake, table, version=None):
        out = real(lake, table, version)
        if not landed:  # right after the reader's first table: the commit lands
            landed.append(table)
            Lake(tmp_path).commit_round("r", 1, {"attempt": "b", "checkpoint_uid": "base"})
        return out

    monkeypatch.setattr(dl, "snapshot", snapshot)
    con = Lake(tmp_path).connect()
    assert landed
    rounds = con.sql("SELECT round FROM rounds ORDER BY 1").fetchall()
    for table in ("games", "turns"):
        assert con.sql(f"SELECT DISTINCT round FROM {table} ORDER BY 1").fetchall() == rounds, table


def test_time_travel_reads_the_versions_a_batch_recorded(tmp_path):
    write_round(tmp_path, 0, "a")
    Lake(tmp_path).commit_round("r", 0, {"attempt": "a", "checkpoint_uid": "base"})
    then = Lake(tmp_path).versions
    write_round(tmp_path, 1, "b")
    Lake(tmp_path).commit_round("r", 1, {"attempt": "b", "checkpoint_uid": "base"})
    count = "SELECT count(*) FROM turns"
    assert Lake(tmp_path).connect().sql(count).fetchall() == [(4,)]
    assert Lake(tmp_path).at(then).connect().sql(count).fetchall() == [(2,)]


def test_migrate_keeps_every_row(tmp_path):
    """A lake in the old format (markers found by listing, a killed attempt's files beside the
    committed ones): migrate commits exactly what the old reader saw, rows and checksums equal."""
    for attempt in ("dead", "live"):
        write_round(tmp_path, 0, attempt)
    d = tmp_path / "rounds/run=r/round=0"
    d.mkdir(parents=True)
    pq.write_table(commit.as_table("rounds", [{"attempt": "live", "checkpoint_uid": "base"}]), d / "commit.parquet")
    write_round(tmp_path, 1, "x")  # played, never committed
    sums = migrate(tmp_path)
    assert sums["games"][0] == 2 and sums["turns"][0] == 2 and sums["rounds"][0] == 1
    assert Lake(tmp_path).sql("SELECT DISTINCT game_id[1:4] AS a FROM games").to_pylist() == [{"a": "live"}]
    assert migrate(tmp_path) == {}  # nothing left to do


def test_compact_and_vacuum_change_no_query_result(tmp_path):
    """Three rounds of 4 task files each, and a round whose files predate most turns columns:
    compaction leaves one file per round and table, vacuum deletes the replaced files once they
    are older than the retention, and every table reads the same rows (checksums) throughout."""
    import duckdb
    import pyarrow as pa

    for rnd in range(3):
        write_round(tmp_path, rnd, f"a{rnd}", n=4)
        Lake(tmp_path).commit_round("r", rnd, {"attempt": f"a{rnd}", "checkpoint_uid": "base"})
    d = tmp_path / "turns/run=r/round=3"
    d.mkdir(parents=True)
    for i in range(2):  # the columns of an older lake only
        pq.write_table(pa.table({"game_id": [f"old-{i}"], "turn": pa.array([0], pa.int32()),
                                 "pid": pa.array([0], pa.int32()), "completion": ["c"]}), d / f"task-{i:04d}.old.parquet")
    Lake(tmp_path).commit_round("r", 3, {"attempt": "old", "checkpoint_uid": "base"})
    before, then = checksums(Lake(tmp_path).connect()), Lake(tmp_path).versions
    assert before["turns"][0] == 14 and len(Lake(tmp_path).table("turns").files()) == 14

    merged = compact(tmp_path, run_name="r")
    assert merged["games"] == (12, 3) and merged["turns"] == (14, 4)
    assert len(Lake(tmp_path).table("turns").files()) == 4
    assert checksums(Lake(tmp_path).connect()) == before
    shell = duckdb.connect(str(tmp_path / "lake.duckdb"), read_only=True)  # the duckdb shell's views follow
    assert shell.sql("SELECT count(*) FROM turns").fetchall() == [(14,)]
    shell.close()

    assert vacuum(tmp_path, retention_hours=1) == []  # replaced a moment ago: kept for older snapshots
    assert checksums(Lake(tmp_path).at(then).connect()) == before
    removed = vacuum(tmp_path, retention_hours=0)
    assert len(removed) == 26 and not any((tmp_path / p).exists() for p in removed)
    assert "turns/run=r/round=0/task-0000.a0.parquet" in removed
    assert checksums(Lake(tmp_path).connect()) == before
    with pytest.raises(JobError, match=r"run=r/round=\d/task-000\d\.a\d\.parquet"):  # the old snapshot's files: named
        Lake(tmp_path).at(then).connect()


def test_lake_commands_migrate_compact_vacuum(tmp_path, capsys):
    """`run migrate`, `run compact`, `run vacuum` on an old-format lake of two 2-task rounds."""
    from unstable_dask.cli import main
    for rnd in range(2):
        write_round(tmp_path, rnd, "x")
        d = tmp_path / f"rounds/run=r/round={rnd}"
        d.mkdir(parents=True)
        pq.write_table(commit.as_table("rounds", [{"attempt": "x", "checkpoint_uid": "base"}]).drop_columns(["files"]),
                       d / "commit.parquet")
    lake = str(tmp_path)
    assert main(["migrate", "--lake", lake]) == 0 and "rows and checksums equal" in capsys.readouterr().out
    assert main(["migrate", "--lake", lake]) == 0 and "nothing to do" in capsys.readouterr().out
    assert main(["compact", "--lake", lake, "--run", "r"]) == 0
    assert len(Lake(tmp_path).table("games").files()) == 2
    assert main(["vacuum", "--lake", lake, "--retention-hours", "0"]) == 0
    assert "8 file(s)" in capsys.readouterr().out
    assert Lake(tmp_path).sql("SELECT count(*) AS n FROM turns").to_pylist() == [{"n": 4}]
    assert main(["migrate", "--lake", str(tmp_path / "nope")]) == 2
    assert main(["vacuum", "--lake", lake, "--retention-hours", "-1"]) == 2


def test_readme_column_tables_are_generated_from_the_catalog():
    text = (ROOT / "lake/README.md").read_text()
    begin, end = "<!-- tables: generated from unstable_dask/lake/catalog.py -->", "<!-- end of generated tables -->"
    assert begin in text and end in text, "lake/README.md lost its generated-tables markers"
    current = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert current == catalog.readme_tables().strip(), (
        "lake/README.md column tables drifted from the catalog: regenerate with "
        "python -m unstable_dask.lake.catalog > the section between the markers")


@pytest.mark.slow
def test_loop_compacts_every_k_rounds(tmp_path):
    """`run.compact_every = 2`: after rounds 0 and 1 the loop merges the run's per-task files, one
    file per round and table, and the tables read as the rounds wrote them."""
    from unstable_dask.jobfile import load_job
    from unstable_dask.loop import loop
    job = load_job(None, {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"),
                          "run.compact_every": 2, "round.train_games": 4, "round.eval_games": 0,
                          "round.games_per_task": 1, "model.max_new_tokens": 8, "cluster.n_workers": 1,
                          "cluster.dashboard": False})
    loop(job, 1, rate=False)  # round 0: not yet compacted
    assert len(Lake(job.run.lake).table("games").files()) == 4
    loop(job, 2, rate=False)
    files = Lake(job.run.lake).table("games").files()
    assert len(files) == 2 and not any(Path(f).name.startswith("task-") for f in files)  # delta-rs' merged files
    assert Lake(job.run.lake).sql("SELECT round, count(*) AS n FROM games GROUP BY 1 ORDER BY 1").to_pylist() == [
        {"round": 0, "n": 4}, {"round": 1, "n": 4}]
    assert Lake(job.run.lake).sql("SELECT count(*) AS n FROM turns").to_pylist() == Lake(job.run.lake).sql("SELECT sum(num_turns) AS n FROM games").to_pylist()


def test_cleanup_after_a_commit_keeps_a_compaction_committed_meanwhile(tmp_path):
    """A compaction commits between a round's publish and its cleanup of other attempts' files: the
    cleanup removes the killed attempt's files and temp files, never the compacted file."""
    write_round(tmp_path, 0, "dead0001")
    write_round(tmp_path, 0, "0123abcd")
    d = tmp_path / "games/run=r/round=0"
    (d / ".task-0000.dead0001.89abcdef.tmp").write_bytes(b"half")
    Lake(tmp_path).commit_round("r", 0, {"attempt": "0123abcd", "checkpoint_uid": "base"})
    before = checksums(Lake(tmp_path).connect())
    assert compact(tmp_path, "r")["games"] == (2, 1)
    removed = Lake(tmp_path).remove_other_attempts("rounds", "r", 0, "0123abcd")
    assert checksums(Lake(tmp_path).connect()) == before
    assert len(list(d.glob("part-*.parquet"))) == 1
    assert sorted(str(Path(p).relative_to(tmp_path)) for p in removed) == [
        "games/run=r/round=0/.task-0000.dead0001.89abcdef.tmp"] + [
        f"{t}/run=r/round=0/task-000{i}.dead0001.parquet" for t in ("games", "turns") for i in (0, 1)]


def _two_rounds(lake):
    for rnd in (0, 1):
        write_round(lake, rnd, f"a000000{rnd}")
        Lake(lake).commit_round("r", rnd, {"attempt": f"a000000{rnd}", "checkpoint_uid": "base"})


def test_a_data_table_that_lost_its_newest_log_entry_is_an_error_naming_it(tmp_path, capsys):
    """`games` loses its newest Delta log entry (the apply of round 1): `sql` over games fails with
    one line naming the table and the round, instead of answering with round 0's rows only."""
    from unstable_dask.cli import main
    _two_rounds(tmp_path)
    entries = sorted((tmp_path / "games/_delta_log").glob("*.json"))
    entries[-1].unlink()
    assert main(["sql", "SELECT count(*) FROM games", "--lake", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "table 'games' holds 0 rows of round 1 of run 'r'" in err and "made 2 visible" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(JobError, match="'games'"):  # every reader, not only the CLI
        Lake(tmp_path).table("games").rows()


@pytest.mark.parametrize("table", ["games", "rounds"])
def test_a_lost_delta_log_is_an_error_naming_the_table(tmp_path, table):
    """A table's whole `_delta_log` is gone: every read names the table; none shows an empty lake."""
    import shutil
    _two_rounds(tmp_path)
    shutil.rmtree(tmp_path / table / "_delta_log")
    with pytest.raises(JobError, match=f"table '{table}' has no Delta log"):
        Lake(tmp_path).sql("SELECT count(*) FROM turns")


def test_vacuum_removes_leftovers_of_killed_jobs_and_nothing_a_commit_names(tmp_path, capsys):
    """What killed or losing jobs leave behind, each named as its writer names it: a learner's temp
    adapter folder, the adapter of a learner attempt that lost its iteration, the adapter of a
    checkpoint retired by rollback, a killed compaction's part, a losing driver's late task file, a
    killed writer's temp file. `run vacuum` removes them once older than the retention, and reports
    them; committed files and adapters, a round being played and a learner still training stay."""
    import os
    import time

    import pyarrow as pa

    from unstable_dask.cli import main
    lake = Lake(tmp_path)
    _two_rounds(tmp_path)
    adapters = {}
    for k, attempt in ((1, "a0000001"), (2, "a0000002")):
        rel = Lake.adapter_rel("r", f"ckpt-{k}", attempt)
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "adapter_model.safetensors").write_bytes(b"w")
        lake.write("learner_steps", "r", k, f"steps.{attempt}", [{"update": 0}])
        lake.commit("checkpoints", "r", k, "checkpoint", {"attempt": attempt, "uid": f"ckpt-{k}", "adapter_path": rel})
        adapters[k] = rel
    lake.retire("checkpoints", "r", [2])  # run rollback --to ckpt-1
    leftovers = {
        "adapters/r/.ckpt-3.b0000003.c0000003.tmp/adapter_model.safetensors",  # learner killed while saving
        f"{Lake.adapter_rel('r', 'ckpt-1', 'dead0001')}/adapter_model.safetensors",  # lost iteration 1's commit
        "games/run=r/round=0/part-00000-1b7a4f9e-0000-4000-8000-000000000000-c000.zstd.parquet",  # killed compact
        "turns/run=r/round=1/task-0000.10537001.parquet",  # a losing driver's task, written after the commit
        "games/run=r/round=1/.task-0001.10537001.5eed0001.tmp",  # its writer killed mid-write
    }
    for rel in leftovers:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"game_id": ["x"]}), tmp_path / rel)
    kept = {"adapters/r/ckpt-9.e0000009/adapter_model.safetensors",  # a learner still training iteration 9? keep
            "games/run=r/round=2/task-0000.f0000002.parquet"}  # round 2 being played
    for rel in kept:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"game_id": ["x"]}), tmp_path / rel)
    before = checksums(Lake(tmp_path).connect())
    assert main(["vacuum", "--lake", str(tmp_path), "--retention-hours", "1"]) == 0
    assert "0 file(s) and 0 adapter folder(s)" in capsys.readouterr().out  # all younger than an hour
    old = time.time() - 2 * 3600
    for dirpath, _, names in os.walk(tmp_path):
        for n in names:
            os.utime(os.path.join(dirpath, n), (old, old))
    assert main(["vacuum", "--lake", str(tmp_path), "--retention-hours", "1"]) == 0
    out = capsys.readouterr().out
    files = {p for p in leftovers if not p.startswith("adapters/")}
    folders = {p.rsplit("/", 1)[0] + "/" for p in leftovers if p.startswith("adapters/")} | {adapters[2] + "/"}
    assert f"{len(files)} file(s) and {len(folders)} adapter folder(s)" in out
    for p in files | folders:
        assert f"  {p}" in out and not (tmp_path / p).exists(), p
    for p in kept | {adapters[1] + "/adapter_model.safetensors"}:
        assert (tmp_path / p).exists(), p
    assert checksums(Lake(tmp_path).connect()) == before  # every committed row reads the same


def test_rolled_back_to_base_the_next_iteration_is_after_every_claimed_one(tmp_path):
    """Every checkpoint retired (`rollback --to base`): the claimed iterations still count, so the
    next learner takes iteration 3, not iteration 1 again (whose claim a retired commit holds)."""
    lake = Lake(tmp_path)
    for k in (1, 2):
        lake.write("learner_steps", "r", k, f"steps.a000000{k}", [{"update": 0}])
        lake.commit("checkpoints", "r", k, "checkpoint", {"attempt": f"a000000{k}", "uid": f"ckpt-{k}"})
    lake.retire("checkpoints", "r", [1, 2])
    assert Lake(tmp_path).table("checkpoints").rows("r") == []
    assert Lake(tmp_path).last_claimed("checkpoints", "r") == 2
    assert Lake(tmp_path).finish_commits("checkpoints", "r") == []
    assert Lake(tmp_path / "fresh").last_claimed("checkpoints", "r") is None
