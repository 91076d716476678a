"""Reading a snapshot of the lake with DuckDB: one view per table over its committed files.

`Snapshot` is what a reader sees: each Delta table's log read once (marker tables first, see
READ_ORDER), and its data files counted only where the partition's marker is published. Views
read an explicit file list, never a folder listing, and have every column of the catalog (NULL in
files written before a column existed). User SQL runs on a connection that may only read, and
only inside the lake (`check_select_only` plus DuckDB's own confinement).
"""
from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass, field
from typing import Optional

import duckdb
import pyarrow as pa

from unstable_dask.errors import JobError
from unstable_dask.lake import delta as dl
from unstable_dask.lake import storage as st
from unstable_dask.lake.catalog import DELTA_TABLES, HIVE_TYPES, PARTITION, TABLES, VIEWS, data_tables, with_partitions

# Marker tables are read before data tables: a commit applies data files before it publishes the
# marker, so a marker row seen here has all its data files in the data snapshots read after it.
# (Read the other way round, a commit landing in between would show a round without its games.)
READ_ORDER = tuple(sorted(DELTA_TABLES, key=lambda t: TABLES[t].rule != "marker"))


@dataclass
class Snapshot:
    """The Delta logs of a lake, each read once, on first use, and the files a reader sees.

    A data table's marker log is always read before its own (and kept), so every published
    marker row's data files are in the data snapshot, whenever the data log is read."""
    root: str
    pinned: dict[str, int] = field(default_factory=dict)  # {table: Delta version} to read instead of the newest
    _logs: dict[str, dl.Snapshot] = field(default_factory=dict)
    _replace_files: dict[str, list[str]] = field(default_factory=dict)  # listed on first use
    _checked: set[str] = field(default_factory=set)  # data tables whose row counts match their commits

    def log(self, table: str) -> dl.Snapshot:
        if table not in self._logs:
            marker = TABLES[table].marker
            if marker is not None:
                self.log(marker)
            self._logs[table] = dl.snapshot(self.root, table, self.pinned.get(table))
            if TABLES[table].rule == "marker" and self._logs[table].version is None:
                # A commit creates the marker's log before its data tables' logs: data without
                # the marker's log is a lake whose commits are lost, never an empty one.
                for data in data_tables(table):
                    if self.log(data).paths:
                        raise JobError(f"lake {self.root}: table {table!r} has no Delta log ({table}/_delta_log) but "
                                       f"{data!r} holds committed files: the log that says which {PARTITION[table]}s "
                                       "are committed is lost; restore it from a backup")
        return self._logs[table]

    @property
    def versions(self) -> dict[str, Optional[int]]:
        """The version of every Delta table (reads every log not read yet)."""
        return {t: self.log(t).version for t in READ_ORDER}

    def published(self, marker: str, run_name: Optional[str] = None) -> list[int]:
        """Partitions (rounds / iterations) whose marker is published, of one run or all, sorted."""
        s = self.log(marker)
        return sorted({p for r, p in zip(s.runs, s.parts) if p is not None and (run_name is None or r == run_name)})

    def files(self, table: str) -> tuple[list[str], bool]:
        """(absolute locations of the table's visible files, whether they differ in columns)."""
        if table not in DELTA_TABLES:
            if table not in self._replace_files:
                self._replace_files[table] = _replace_files(self.root, table)
            return self._replace_files[table], True
        s = self.log(table)
        # The log keeps no useful order; readers get (run, round/iteration, name) order, the order
        # a table scan without ORDER BY returns rows in, so that it is stable.
        keep = sorted(range(len(s.paths)), key=lambda i: (s.runs[i], s.parts[i] if s.parts[i] is not None else -1,
                                                          s.paths[i]))
        marker = TABLES[table].marker
        if marker is not None:
            m = self.log(marker)
            if table not in self._checked:
                check_counts(self.root, table, m, s)
                self._checked.add(table)
            published = set(zip(m.runs, m.parts))
            keep = [i for i in keep if (s.runs[i], s.parts[i]) in published]
        return [st.join(self.root, table, s.paths[i]) for i in keep], s.mixed


def check_counts(root: str, table: str, marker: dl.Snapshot, data: dl.Snapshot) -> None:
    """A data table holds exactly the rows each published commit counted (the marker's count
    column against the row counts of the data log's add actions, both already in the snapshot):
    a data log that lost a commit, or is gone, is an error naming the table and partition, never a
    smaller table. Commits written before the counts existed are not checked."""
    if not marker.paths:
        return
    part = PARTITION[marker.table]
    col = TABLES[table].counted_by
    if data.version is None and TABLES[table].optional and col is not None and not any(marker.counts[col]):
        return  # no commit made rows of it visible: a lake from before the table
    if data.version is None:
        raise JobError(f"lake {root}: table {table!r} has no Delta log ({table}/_delta_log), but {marker.table!r} "
                       f"commits {len(marker.paths)} {part}(s) of it (run {marker.runs[0]!r}, {part} {marker.parts[0]}, "
                       "...): its committed files are lost to readers; restore the log from a backup")
    col = TABLES[table].counted_by
    if col is None:
        return
    expected = {(r, p): c for r, p, c in zip(marker.runs, marker.parts, marker.counts[col]) if c is not None}
    held: dict[tuple, int] = dict.fromkeys(expected, 0)
    unknown = set()  # partitions with a file whose add action records no row count: not checked
    for r, p, n in zip(data.runs, data.parts, data.rows):
        if (r, p) in held:
            if n is None:
                unknown.add((r, p))
            else:
                held[(r, p)] += n
    bad = sorted(k for k, c in expected.items() if held[k] != c and k not in unknown)
    if bad:
        (r, p), more = bad[-1], f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise JobError(f"lake {root}: table {table!r} holds {held[(r, p)]} rows of {part} {p} of run {r!r}, but its "
                       f"commit in {marker.table!r} made {expected[(r, p)]} visible{more}: {table}/_delta_log lost a "
                       "commit or was edited; restore it from a backup")


def _replace_files(root: str, table: str) -> list[str]:
    """A replace table's files: one per run (a listing of the run folders, not of the data)."""
    return [p for run_dir in st.list_dir(st.join(root, table)) if st.name(run_dir).startswith("run=")
            for p in st.list_dir(run_dir)
            if p.endswith(".parquet") and not st.name(p).startswith(".") and st.is_whole_parquet(p)]


def sql_str(s: str) -> str:
    """A string as an SQL literal: single-quoted, its quotes doubled (the one quoting helper)."""
    return "'" + s.replace("'", "''") + "'"


def read_sql(table: str, files: list[str], mixed: bool) -> str:
    """read_parquet over an explicit file list: no listing, hive columns typed and prunable.
    Only tables holding files of older schemas pay for matching columns by name in every file."""
    names = ", ".join(sql_str(p) for p in files)
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


def create_views(con: duckdb.DuckDBPyConnection, snap: Optional[Snapshot], where: str = "") -> list[str]:
    """(Re)create one view per table over its committed files, plus the derived `seats` view.

    `snap=None`: every view empty, as on a fresh lake. A committed file that is missing or torn
    is an error naming it (`where` says which lake), never fewer rows."""
    for table in VIEWS:
        files, mixed = snap.files(table) if snap is not None else ([], False)
        try:
            con.execute(f"CREATE OR REPLACE VIEW {table} AS {view_sql(table, files, mixed)}")
        except (duckdb.IOException, duckdb.InvalidInputException) as e:
            raise JobError(f"lake {where}: table {table!r} names a file that cannot be read "
                           f"({str(e).splitlines()[0]})") from None
    con.execute(SEATS_VIEW)
    return list(VIEWS) + ["seats"]


def connect(snap: Snapshot, read_only: bool = True, where: str = "") -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with views over `snap`.

    `read_only=True` confines file access to the lake folder and locks the configuration;
    together with `check_select_only` user SQL can read the lake and write nothing."""
    con = duckdb.connect(":memory:")
    st.register_duckdb(con, snap.root)
    create_views(con, snap, where or snap.root)
    if read_only:
        # (an object store's files are read through the registered fsspec filesystem, which these
        # settings do not confine: user SQL there reads what the credentials allow, and writes nothing)
        root = snap.root + ("/" if st.is_remote(snap.root) else os.sep)
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
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise JobError(f"{what}: does not parse ({str(e).splitlines()[0]})") from None
    if not statements:
        raise JobError(f"{what}: no statement to run (the query is empty)")
    for stmt in statements:
        if stmt.type != duckdb.StatementType.SELECT:
            raise JobError(f"{what}: only SELECT queries may run against the lake, got a {stmt.type.name} statement")


def write_shell_catalog(snap: Snapshot) -> Optional[str]:
    """Rewrite <lake>/lake.duckdb: views over `snap` for the duckdb shell (`duckdb lake/lake.duckdb`),
    swapped in whole. Not for an object-store lake (None): the shell has no s3fs; `run sql` reads it."""
    if st.is_remote(snap.root):
        return None
    os.makedirs(snap.root, exist_ok=True)
    final = os.path.join(snap.root, "lake.duckdb")
    tmp = os.path.join(snap.root, f".lake.{uuid.uuid4().hex[:8]}.duckdb.tmp")
    con = duckdb.connect(tmp)
    try:
        for table in VIEWS:
            con.execute(f"CREATE OR REPLACE VIEW {table} AS {view_sql(table, *snap.files(table))}")
        con.execute(SEATS_VIEW)
    finally:
        con.close()
    os.replace(tmp, final)
    if os.path.exists(tmp + ".wal"):
        os.remove(tmp + ".wal")
    return final
