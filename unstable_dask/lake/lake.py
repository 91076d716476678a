"""`Lake`: one lake, its storage and one snapshot of its Delta logs; it hands out tables.

    lake = Lake("lake")                        # a folder, or "s3://bucket/prefix"
    lake.table("checkpoints").rows(run_name="demo")
    lake.sql("SELECT split, count(*) FROM games GROUP BY 1")
    lake.commit_round("demo", 3, row)          # the round's commit (commit.py: claim, apply, publish)

The snapshot (every Delta table's log, marker tables first) is read once, on first use, and
every read of this object answers from it, so one job step sees one consistent lake and pays for
the logs once (on an object store each log read is a round of requests). A commit made through
the object refreshes it; `refresh()` does so by hand and `at(versions)` pins older versions
(time travel). Every path inside the lake is built here or in commit.partition_dir:

    <lake>/<table>/_delta_log/                           the commit log of each Delta table
    <lake>/<table>/run=<run>/round=<n>/<key>.parquet     games, turns, rounds (commit markers)
    <lake>/<table>/run=<run>/iteration=<k>/<key>.parquet checkpoints, learner_steps
    <lake>/<table>/run=<run>/<table>.parquet             ratings, rating_history, head_to_head, ratings_state
    <lake>/adapters/<run>/<uid>.<attempt>/               LoRA adapters (peft format + optimizer state)
    <lake>/lake.duckdb                                   views for the duckdb shell (rewritten per commit)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional, Union

import duckdb
import pyarrow as pa

from unstable_dask.errors import JobError
from unstable_dask.lake import commit, read
from unstable_dask.lake import storage as st
from unstable_dask.lake.catalog import DELTA_TABLES, TABLES, VIEWS


class Lake:
    def __init__(self, uri: Union[str, Path, "Lake"], versions: Optional[dict[str, int]] = None) -> None:
        self.uri: str = uri.uri if isinstance(uri, Lake) else str(uri)
        self.root = st.root(self.uri)  # canonical: an absolute path, or the URI without a trailing slash
        self.pinned = dict(versions or {})
        self._snapshot: Optional[read.Snapshot] = None

    def __repr__(self) -> str:
        return f"Lake({self.uri!r})"

    def __getstate__(self) -> dict:  # sent to workers without its snapshot
        return {**self.__dict__, "_snapshot": None}

    # ------------------------------------------------------------ locations

    @property
    def remote(self) -> bool:
        return st.is_remote(self.uri)

    def exists(self) -> bool:
        """Whether there is a lake here (a folder, or objects under the prefix)."""
        return st.is_dir(self.root)

    def location(self, rel: str) -> str:
        """A location inside the lake from a path relative to its root (as rows store them)."""
        return st.join(self.root, *rel.split("/"))

    def partition_dir(self, table: str, run_name: str, part: Optional[int] = None) -> str:
        return commit.partition_dir(self.root, table, run_name, part)

    def file(self, table: str, run_name: str, part: Optional[int], key: str) -> str:
        """The location of the file `write` writes for these arguments."""
        return commit.file_location(self.root, table, run_name, part, key)

    @staticmethod
    def adapter_rel(run_name: str, uid: str, attempt: str) -> str:
        """Where a learner attempt's adapter goes, relative to the root (checkpoints.adapter_path)."""
        return f"adapters/{run_name}/{uid}.{attempt}"

    def adapters_dir(self, run_name: str) -> str:
        """The folder of a run's adapters (every attempt's, committed or not)."""
        return self.location(f"adapters/{run_name}")

    # ------------------------------------------------------------ the snapshot

    @property
    def snapshot(self) -> read.Snapshot:
        if self._snapshot is None:
            self._snapshot = read.Snapshot(self.root, self.pinned)
        return self._snapshot

    def refresh(self) -> "Lake":
        """Forget the snapshot: the next read sees the lake as it is now."""
        self._snapshot = None
        return self

    def at(self, versions: dict[str, int]) -> "Lake":
        """This lake as of the given Delta table versions ({table: version}; others as of now)."""
        return Lake(self.uri, versions)

    @property
    def versions(self) -> dict[str, Optional[int]]:
        """The Delta version of every Delta table in the snapshot."""
        return self.snapshot.versions

    # ------------------------------------------------------------ reading

    def table(self, name: str) -> "Table":
        if name not in TABLES:
            raise JobError(f"lake {self.uri}: no table {name!r} (tables: {', '.join(TABLES)})")
        return Table(self, name)

    def connect(self, read_only: bool = True) -> duckdb.DuckDBPyConnection:
        """An in-memory DuckDB connection with a view per table over the snapshot (read.connect)."""
        return read.connect(self.snapshot, read_only, self.uri)

    def sql(self, query: str, params: Union[Iterable, dict] = ()) -> pa.Table:
        """A user's SELECT over the committed lake (read-only), as Arrow; `params`: ? values in order,
        or {name: value} for $name. A committed file that is missing or torn is an error naming it,
        never fewer rows."""
        con = self.connect()
        try:
            read.check_select_only(con, query)
            try:
                return con.sql(query, params=params if isinstance(params, dict) else (list(params) or None)).to_arrow_table()
            except duckdb.Error as e:
                raise JobError(f"SQL error: {str(e).splitlines()[0]}") from None
        finally:
            con.close()

    def rounds(self, run_name: str) -> list[int]:
        """The run's committed (published) rounds, oldest first."""
        return self.snapshot.published("rounds", run_name)

    def last_round(self, run_name: str) -> Optional[int]:
        """The run's newest claimed round (published, or claimed by a driver still publishing it)."""
        return self.last_claimed("rounds", run_name)

    def last_claimed(self, marker: str, run_name: str) -> Optional[int]:
        return commit.last_claimed(marker, run_name, self.snapshot.log(marker))

    # ------------------------------------------------------------ writing

    def write(self, table: str, run_name: str, part: Optional[int], key: str,
              data: Union[pa.Table, list[dict]]) -> str:
        """Write one file of a table and return its location.

        Data tables (games, turns, learner_steps): a file, invisible until its partition's marker
        is committed; a retried task replaces its file (same key). Replace tables (ratings...): the
        run's file, replaced atomically and visible at once. Marker tables are committed with
        `commit`, never written here."""
        rule = TABLES[table].rule
        if rule == "marker":
            raise ValueError(f"{table} rows are commits: use Lake.commit")
        path = commit.write_file(self.root, table, run_name, part, key, commit.as_table(table, data))
        if rule == "replace" and table in VIEWS:
            self.refresh().refresh_catalog()
        return path

    def commit(self, marker: str, run_name: str, part: int, key: str, row: dict) -> str:
        """Commit a partition (a round: marker "rounds"; a learner iteration: "checkpoints") with
        the data files of `row['attempt']`; FileExistsError if it is committed already."""
        try:
            return commit.commit_marker(self.root, marker, run_name, part, key,
                                        commit.as_table(marker, [row]).to_pylist()[0])
        finally:
            self.refresh().refresh_catalog()  # the next read sees the commit (read lazily)

    def commit_round(self, run_name: str, round_: int, row: dict) -> str:
        return self.commit("rounds", run_name, round_, "commit", row)

    def finish_commits(self, marker: str, run_name: str) -> list[int]:
        """Publish partitions of the run claimed by a driver that died before publishing them."""
        finished = commit.finish_commits(self.root, marker, run_name, self.snapshot.log(marker))
        if finished:
            self.refresh().refresh_catalog()
        return finished

    def retire(self, marker: str, run_name: str, parts: list[int]) -> None:
        """Take committed partitions (rounds, learner iterations) out of the lake; see commit.retire."""
        commit.retire(self.root, marker, run_name, parts)
        self.refresh().refresh_catalog()

    def remove_other_attempts(self, marker: str, run_name: str, part: int, attempt: str) -> list[str]:
        """After committing `attempt`: delete other attempts' files of the partition (commit.remove_other_attempts),
        never one the log names as read after the commit (this snapshot: `commit` refreshed it)."""
        return commit.remove_other_attempts(self.root, marker, run_name, part, attempt,
                                            lambda table: set(self.snapshot.log(table).paths))

    def refresh_catalog(self) -> Optional[str]:
        """Rewrite <lake>/lake.duckdb for the duckdb shell (local lakes only: the shell has no s3fs)."""
        return None if self.remote else read.write_shell_catalog(self.snapshot)


class Table:
    """One table of a lake's snapshot."""

    def __init__(self, lake: Lake, name: str) -> None:
        self.lake, self.name = lake, name

    def __repr__(self) -> str:
        return f"Table({self.lake.uri!r}, {self.name!r})"

    @property
    def version(self) -> Optional[int]:
        """Its Delta version in the snapshot (None: not a Delta table, or no log yet)."""
        return self.lake.snapshot.log(self.name).version if self.name in DELTA_TABLES else None

    def files(self) -> list[str]:
        """Locations of the files a reader sees (committed data, published markers, runs' files)."""
        return self.lake.snapshot.files(self.name)[0]

    def read(self, where: str = "", params: Iterable = (), order_by: str = "") -> pa.Table:
        """The visible rows, optionally filtered by a SQL condition with ? parameters, as Arrow."""
        con = self.lake.connect()
        try:
            sql = (f"SELECT * FROM {self.name}" + (f" WHERE {where}" if where else "")
                   + (f" ORDER BY {order_by}" if order_by else ""))
            return con.sql(sql, params=list(params) or None).to_arrow_table()
        finally:
            con.close()

    def rows(self, run_name: Optional[str] = None, order_by: str = "") -> list[dict[str, Any]]:
        """The visible rows of one run (or of all), as dicts."""
        if not self.files():  # no file yet: nothing to open a connection for
            return []
        where, params = ("run = ?", [run_name]) if run_name is not None else ("", [])
        return self.read(where, params, order_by).to_pylist()
