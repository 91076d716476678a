"""The lake: Delta tables of worker-written Parquet files, DuckDB views over committed snapshots.

Layout (documented column by column in lake/README.md, generated from catalog.py):

    <lake>/<table>/_delta_log/                           the commit log of each Delta table
    <lake>/<table>/run=<run>/round=<n>/<key>.parquet     games, turns, rounds (commit markers)
    <lake>/<table>/run=<run>/iteration=<k>/<key>.parquet checkpoints, learner_steps
    <lake>/<table>/run=<run>/<table>.parquet             ratings, rating_history, head_to_head
    <lake>/adapters/<run>/<uid>/                         LoRA adapters (peft format)
    <lake>/lake.duckdb                                   views for the duckdb shell (rewritten per commit)

`<lake>` is a local folder or an object-store URI (`s3://bucket/prefix`): storage.py does the I/O.

A commit of a partition (a round, a learner iteration) takes three Delta commits, each keyed by
the application id `<run>/<partition>=<n>`:
  1. claim: the marker table (rounds / checkpoints) records the app id, with the path of the
     marker file (the row, naming every data file) in the commit's metadata. A second claim of
     the same app id is refused or conflicts: a partition is committed once.
  2. apply: each data table adds the named files, once (the same app id in its own log).
  3. publish: the marker table adds the marker file. Readers see a partition only from here on.
A driver killed between 1 and 3 leaves a claim that `finish_commits` completes from the log.
"""
from __future__ import annotations

import functools
import logging
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Optional, Union

import duckdb
import pyarrow as pa

from unstable_dask.lake import delta as dl
from unstable_dask.lake import storage as st
from unstable_dask.lake.catalog import DELTA_TABLES, HIVE_TYPES, PARTITION, SCHEMAS, SEAT, TABLES, VIEWS, data_tables, with_partitions

__all__ = ["SCHEMAS", "PARTITION", "SEAT", "TABLES"]
_PARQUET_MAGIC = b"PAR1"
log = logging.getLogger("unstable_dask.lake")
Lake = Union[str, Path]


def now() -> datetime:
    return datetime.now(timezone.utc)


def table_dir(lake: Lake, table: str, run: str, part: Optional[int] = None) -> str:
    parts = [table, f"run={run}"] + ([f"{PARTITION[table]}={part}"] if part is not None else [])
    return st.join(lake, *parts)


def _as_table(table: str, data: Union[pa.Table, list[dict]]) -> pa.Table:
    schema = SCHEMAS.get(table)
    if isinstance(data, list):
        return pa.Table.from_pylist(data, schema=schema) if schema is not None else pa.Table.from_pylist(data)
    if schema is None:
        return data
    # cast() takes the catalog schema's (empty) metadata: keep the caller's table-level metadata
    # (ratings_state records the rounds and parameters of its replay there).
    return data.select(schema.names).cast(schema).replace_schema_metadata(data.schema.metadata)


def _write_file(lake: Lake, table: str, run: str, part: Optional[int], key: str, data: pa.Table) -> str:
    """Write one Parquet file of a partition; no reader sees it half written (storage.write_parquet)."""
    final = st.join(table_dir(lake, table, run, part), f"{key}.parquet")
    st.write_parquet(final, data)
    return final


def write_table(lake: Lake, table: str, run: str, part: Optional[int], key: str,
                data: Union[pa.Table, list[dict]], exclusive: bool = False) -> str:
    """Write one file of a table and return its path.

    Data tables (games, turns, learner_steps): a file, invisible until its partition's marker is
    committed; a retried task replaces its file (same key). Marker tables (rounds, checkpoints):
    the partition's commit (FileExistsError if it is committed already; `exclusive` is implied).
    Replace tables (ratings...): the run's file, replaced atomically and visible at once.
    """
    data = _as_table(table, data)
    rule = TABLES[table].rule if table in TABLES else "replace"
    if rule == "marker":
        return commit_marker(lake, table, run, part, key, data.to_pylist()[0])
    path = _write_file(lake, table, run, part, key, data)
    if rule == "replace" and table in VIEWS:
        refresh_catalog(lake)
    return path


def is_whole_parquet(path: st.Location) -> bool:
    """Cheap check for a complete Parquet file: magic bytes at both ends."""
    try:
        size, head, tail = st.read_ends(path, 4)
        return size >= 12 and head == _PARQUET_MAGIC and tail == _PARQUET_MAGIC
    except OSError:
        return False


def why_not_belongs(path: st.Location, table: str) -> Optional[str]:
    """None if the file fits the table (whole, key columns with their types), else why not."""
    if not is_whole_parquet(path):
        return "not a whole Parquet file (torn write?)"
    try:
        schema = st.read_schema(path)
    except Exception as e:  # noqa: BLE001 - any unreadable footer is a foreign file
        return f"unreadable footer ({e})"
    want = TABLES[table].schema
    for k in TABLES[table].keys:
        if k not in schema.names:
            return f"has no column {k!r}: not a {table} file"
        if not schema.field(k).type.equals(want.field(k).type):
            return f"column {k!r} is {schema.field(k).type}, expected {want.field(k).type}"
    return None


def attempt_of(path: st.Location) -> Optional[str]:
    """The attempt id in a file's name (`task-0003.<attempt>.parquet`), if any."""
    parts = st.name(path).split(".")
    return parts[1] if len(parts) == 3 else None


# ---------------------------------------------------------------- commits

def partition_files(lake: Lake, table: str, run: str, part: int, attempt: Optional[str]) -> list[str]:
    """The files of one partition that a commit names, relative to the table folder: those of
    `attempt` (every file when None, as for lakes written before attempts), whole and of the
    table's schema; anything else there is skipped with a warning."""
    d = table_dir(lake, table, run, part)
    out = []
    for p in st.list_dir(d):
        n = st.name(p)
        if n.startswith(".") or not n.endswith(".parquet") or (attempt is not None and attempt_of(p) != attempt):
            continue
        why = why_not_belongs(p, table)
        if why is None:
            out.append(f"run={run}/{PARTITION[table]}={part}/{n}")
        else:
            log.warning("lake: not committing %s: %s", p, why)
    return out


def commit_marker(lake: Lake, marker: str, run: str, part: int, key: str, row: dict) -> str:
    """Commit a partition (round or learner iteration): claim, apply its data files, publish.

    FileExistsError when the partition is already claimed (by another driver, or an earlier run)."""
    app = dl.app_id(run, PARTITION[marker], part)
    if dl.claimed(lake, marker, app):
        raise FileExistsError(f"{marker} {app} is already committed in lake {lake}")
    attempt = row.get("attempt")
    files = {t: partition_files(lake, t, run, part, attempt) for t in data_tables(marker)}
    row = dict(row, files=[f"{t}/{rel}" for t, rels in files.items() for rel in rels])
    path = _write_file(lake, marker, run, part, f"{key}.{attempt or uuid.uuid4().hex[:8]}", _as_table(marker, [row]))
    try:
        claim_and_publish(lake, marker, run, part, path, files)
    except FileExistsError:
        st.delete(path)
        raise
    return path


def claim_and_publish(lake: Lake, marker: str, run: str, part: int, marker_file: st.Location,
                      files: dict[str, list[str]]) -> None:
    """Steps 1-3 of a commit for a marker file already written (also used by `migrate`)."""
    app = dl.app_id(run, PARTITION[marker], part)
    rel = f"run={run}/{PARTITION[marker]}={part}/{st.name(marker_file)}"
    if not dl.commit(lake, marker, [], app=app, metadata={"unstable_dask.claim": app, "unstable_dask.marker": rel}):
        raise FileExistsError(f"{marker} {app} was committed by another writer in lake {lake}")
    _publish(lake, marker, app, rel, files)


def _publish(lake: Lake, marker: str, app: str, marker_rel: str, files: dict[str, list[str]]) -> None:
    """Steps 2 and 3 of a commit; each is idempotent, so a finisher may repeat them."""
    for table, rels in files.items():
        dl.commit(lake, table, rels, app=app)
    dl.commit(lake, marker, [marker_rel])  # adding a path the log has already is a no-op
    refresh_catalog(lake)


def finish_commits(lake: Lake, marker: str, run: str) -> list[int]:
    """Publish the partitions of `run` that were claimed but not published (a driver killed
    mid-commit): the marker file named in the claim lists the files. Returns their numbers."""
    done, part = [], _last_visible(lake, marker, run)
    while True:
        part = -1 if part is None else part
        app = dl.app_id(run, PARTITION[marker], part + 1)
        meta = dl.claim_metadata(lake, marker, app)
        if meta is None:
            return done
        rel = meta["unstable_dask.marker"]
        names = st.read_table(st.join(lake, marker, rel), columns=["files"]).column(0)[0].as_py() or []
        files: dict[str, list[str]] = {t: [] for t in data_tables(marker)}
        for name in names:
            t, r = name.split("/", 1)
            files[t].append(r)
        _publish(lake, marker, app, rel, files)
        part += 1
        done.append(part)


def _last_visible(lake: Lake, marker: str, run: str) -> Optional[int]:
    snap = dl.snapshot(lake, marker)
    parts = [p for r, p in zip(snap.runs, snap.parts) if r == run]
    return max(parts) if parts else None


def last_claimed(lake: Lake, marker: str, run: str) -> Optional[int]:
    """The newest partition of `run` that is claimed (published or still being published)."""
    part = _last_visible(lake, marker, run)
    while dl.claimed(lake, marker, dl.app_id(run, PARTITION[marker], 0 if part is None else part + 1)):
        part = 0 if part is None else part + 1
    return part


def commit_round(lake: Lake, run: str, round_: int, row: dict) -> Path:
    """Commit a round (its games and turns files of `row['attempt']`); FileExistsError if it is
    committed already."""
    return commit_marker(lake, "rounds", run, round_, "commit", _as_table("rounds", [row]).to_pylist()[0])


def remove_other_attempts(lake: Lake, marker: str, run: str, part: int, attempt: str) -> int:
    """After a commit: delete files other attempts left behind (no commit names them), and temp
    files of writers killed mid-write: once the partition is committed none can ever count."""
    removed = 0
    for table in data_tables(marker):
        for p in st.list_dir(table_dir(lake, table, run, part)):
            n = st.name(p)
            stale_tmp = n.startswith(".") and n.endswith(".tmp")
            if stale_tmp or (n.endswith(".parquet") and attempt_of(p) != attempt):
                st.delete(p)
                removed += 1
    return removed


def last_committed_round(lake: Lake, run: str) -> Optional[int]:
    return last_claimed(lake, "rounds", run)


# ---------------------------------------------------------------- reading

def _replace_files(lake: Lake, table: str) -> list[str]:
    """A replace table's files: one per run (a listing of the run folders, not of the data)."""
    return [p for run_dir in st.list_dir(st.join(lake, table)) if st.name(run_dir).startswith("run=")
            for p in st.list_dir(run_dir)
            if p.endswith(".parquet") and not st.name(p).startswith(".") and is_whole_parquet(p)]


# Marker tables are read before data tables: a commit applies data files before it publishes the
# marker, so a marker row seen here has all its data files in the data snapshots read after it.
# (Read the other way round, a commit landing in between would show a round without its games.)
READ_ORDER = tuple(sorted(DELTA_TABLES, key=lambda t: TABLES[t].rule != "marker"))


def snapshot_files(lake: Lake, versions: Optional[dict[str, int]] = None,
                   tables: Optional[Iterable[str]] = None) -> dict[str, tuple[list[str], bool, Optional[int]]]:
    """table -> (absolute paths of its committed files, files differ in columns, Delta version),
    for every table or those in `tables`.

    Data files count only in partitions whose marker is published; `versions` reads Delta
    tables as of those versions (time travel), the others as of now."""
    versions = versions or {}
    root = st.root(lake)
    wanted = set(TABLES if tables is None else tables)
    logs = wanted | {TABLES[t].marker for t in wanted if TABLES[t].marker is not None}
    snaps = {t: dl.snapshot(lake, t, versions.get(t)) for t in READ_ORDER if t in logs}
    out = {}
    for t, s in snaps.items():
        if t not in wanted:
            continue
        # The log keeps no useful order; readers get (run, round/iteration, name) order, the
        # order a table scan without ORDER BY returns rows in, so that it is stable.
        keep = sorted(range(len(s.paths)), key=lambda i: (s.runs[i], s.parts[i] if s.parts[i] is not None else -1, s.paths[i]))
        marker = TABLES[t].marker
        if marker is not None:
            published = set(zip(snaps[marker].runs, snaps[marker].parts))
            keep = [i for i in keep if (s.runs[i], s.parts[i]) in published]
        out[t] = ([st.join(root, t, s.paths[i]) for i in keep], s.mixed, s.version)
    for t in TABLES:
        if t in wanted and t not in out:
            out[t] = (_replace_files(lake, t), True, None)
    return out


def visible_files(lake: Lake, table: str) -> list[str]:
    """Files a reader sees: committed data, published markers, the runs' ratings files (reads
    the log of `table` and of its marker table only)."""
    return snapshot_files(lake, tables=[table])[table][0]


def committed_rounds(lake: Lake, run: Optional[str] = None) -> set[tuple[str, int]]:
    s = dl.snapshot(lake, "rounds")
    return {(r, p) for r, p in zip(s.runs, s.parts) if run is None or r == run}


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def read_sql(table: str, files: list[str], mixed: bool) -> str:
    """read_parquet over an explicit file list: no listing, hive columns typed and prunable.
    Only tables holding files of older schemas pay for matching columns by name in every file."""
    names = ", ".join(_sql_str(p) for p in files)
    cols = ["run"] + ([PARTITION[table]] if table in PARTITION else [])
    types = "{" + ", ".join(f"'{c}': '{'VARCHAR' if HIVE_TYPES[c] == pa.string() else 'BIGINT'}'" for c in cols) + "}"
    return (f"SELECT * FROM read_parquet([{names}], hive_partitioning=true, hive_types={types}"
            f"{', union_by_name=true' if mixed else ''})")


# unnest() in the select list, not a lateral `FROM games g, UNNEST(g.seats)`: DuckDB pushes a
# filter on run/round through the former into the file list (one round's files read, not all).
SEATS_VIEW = """CREATE OR REPLACE VIEW seats AS
    SELECT run, round, game_id, split, env_id, seed, group_id, num_players, num_turns,
           s.pid, s.model_uid, s.is_learner, s.role, s.reward, s.invalid_move, s.reason
    FROM (SELECT run, round, game_id, split, env_id, seed, group_id, num_players, num_turns, unnest(seats) AS s
          FROM games)"""


def create_views(con: duckdb.DuckDBPyConnection, lake: Optional[Lake],
                 versions: Optional[dict[str, int]] = None) -> list[str]:
    """(Re)create one view per table over its committed files, plus the derived `seats` view.

    Every view has every column of the catalog (typed): a table whose files predate a column
    reads it as NULL. `lake=None`: every view empty, as on a fresh lake."""
    snap = snapshot_files(lake, versions) if lake is not None else {}
    for table in VIEWS:
        files, mixed, _ = snap.get(table, ([], False, None))
        try:
            con.execute(f"CREATE OR REPLACE VIEW {table} AS {view_sql(table, files, mixed)}")
        except (duckdb.IOException, duckdb.InvalidInputException) as e:  # a committed file is gone or torn: say which, never read fewer rows
            from unstable_dask.errors import JobError
            raise JobError(f"lake {lake}: table {table!r} names a file that cannot be read "
                           f"({str(e).splitlines()[0]})") from None
    con.execute(SEATS_VIEW)
    return list(VIEWS) + ["seats"]


@functools.lru_cache(maxsize=None)
def empty_sql(table: str) -> str:
    """A typed relation with every column of the table and no rows, in plain SQL (it must live
    in lake.duckdb too, where no Arrow table can be registered)."""
    con = duckdb.connect(":memory:")
    con.register("t", with_partitions(table).empty_table())
    cols = con.execute("DESCRIBE t").fetchall()
    con.close()
    return "SELECT " + ", ".join(f'CAST(NULL AS {typ}) AS "{name}"' for name, typ, *_ in cols) + " WHERE false"


def view_sql(table: str, files: list[str], mixed: bool) -> str:
    """The view of a table: its files, plus the typed empty relation so that every column exists
    (NULL in files written before the column did)."""
    return f"{read_sql(table, files, mixed)} UNION ALL BY NAME {empty_sql(table)}" if files else empty_sql(table)


def table_versions(lake: Lake) -> dict[str, Optional[int]]:
    """The Delta version of every Delta table now: what a reader of the lake sees."""
    return {t: dl.snapshot(lake, t).version for t in READ_ORDER}


def connect(lake: Lake = "lake", read_only: bool = True,
            versions: Optional[dict[str, int]] = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with views over the committed snapshot of `lake`
    (as of `versions`, {table: Delta version}, when given).

    `read_only=True` (the default) confines file access to the lake folder and locks the
    configuration; together with `query` (SELECT statements only) user SQL can read the lake and
    write nothing.
    """
    con = duckdb.connect(":memory:")
    st.register_duckdb(con, lake)
    create_views(con, lake, versions)
    if read_only:
        # (an object store's files are read through the registered fsspec filesystem, which these
        # settings do not confine: user SQL there reads what the credentials allow, and writes nothing)
        root = st.root(lake) + ("/" if st.is_remote(lake) else os.sep)
        con.execute("SET allowed_directories = [?]", [root])
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    return con


def connect_empty() -> duckdb.DuckDBPyConnection:
    """The views of a fresh lake (typed, empty) and no file access: SQL binds against the lake's
    schemas with no lake present, so a job's SQL is checked when the job is loaded."""
    con = duckdb.connect(":memory:")
    create_views(con, None)
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def check_select_only(con: duckdb.DuckDBPyConnection, sql: str, what: str = "SQL") -> None:
    """Raise JobError unless `sql` is one or more SELECT statements (no COPY, INSERT, ATTACH...)."""
    from unstable_dask.errors import JobError
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise JobError(f"{what}: does not parse ({str(e).splitlines()[0]})") from None
    for stmt in statements:
        if stmt.type != duckdb.StatementType.SELECT:
            raise JobError(f"{what}: only SELECT queries may run against the lake, got a {stmt.type.name} statement")


def query(lake: Lake, sql: str, params: Iterable = ()) -> pa.Table:
    """Run a user's SELECT over the committed lake (read-only) and return Arrow.

    A committed file that is missing or torn is an error naming it, never fewer rows."""
    from unstable_dask.errors import JobError
    con = connect(lake)
    try:
        check_select_only(con, sql)
        try:
            return con.sql(sql, params=list(params) or None).to_arrow_table()
        except duckdb.Error as e:
            raise JobError(f"SQL error: {str(e).splitlines()[0]}") from None
    finally:
        con.close()


def read_table(lake: Lake, table: str, where: str = "", params: Iterable = ()) -> pa.Table:
    """A visible table (optionally filtered) as Arrow, through DuckDB."""
    con = connect(lake)
    try:
        sql = f"SELECT * FROM {table}" + (f" WHERE {where}" if where else "")
        return con.sql(sql, params=list(params) or None).to_arrow_table()
    finally:
        con.close()


def refresh_catalog(lake: Lake) -> Optional[Path]:
    """Rewrite <lake>/lake.duckdb: views over the committed snapshot for the duckdb shell
    (`duckdb lake/lake.duckdb`). Called after every commit, so the shell never lags. Not for an
    object-store lake (None): the shell has no s3fs; `run sql` reads it."""
    if st.is_remote(lake):
        return None
    lake = Path(lake)
    lake.mkdir(parents=True, exist_ok=True)
    final = lake / "lake.duckdb"
    tmp = lake / f".lake.{uuid.uuid4().hex[:8]}.duckdb.tmp"
    con = duckdb.connect(str(tmp))
    try:
        snap = snapshot_files(lake)
        for table in VIEWS:
            con.execute(f"CREATE OR REPLACE VIEW {table} AS {view_sql(table, *snap[table][:2])}")
        con.execute(SEATS_VIEW)
    finally:
        con.close()
    os.replace(tmp, final)
    Path(str(tmp) + ".wal").unlink(missing_ok=True)
    return final
