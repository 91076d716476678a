"""Delta Lake (delta-rs) under the lake: commits of pre-written files, snapshots, maintenance.

Workers write Parquet files into a table's partition folders; nothing here writes data rows. A
commit is a Delta transaction of `add` actions naming those files. Claims and idempotence use
Delta application transactions (`txn` actions): a commit carrying `txn(app_id)` is refused when
that app id is already in the log, and two racing commits with the same app id conflict (the
loser gets CommitFailedError), so a partition is claimed once and applied once.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable, Schema
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from deltalake.transaction import AddAction, CommitProperties, Transaction, create_table_with_add_actions

from unstable_dask.lake import storage as st
from unstable_dask.lake.catalog import TABLES, counts, with_partitions

log = logging.getLogger("unstable_dask.lake")
_METADATA_RETRIES = 5
MIXED = "unstable_dask.mixedSchemas"  # table property: some files lack columns of the catalog schema
# A marker file's footer key: its count columns were counted by the commit (commit.commit_marker),
# not set by a driver of a lake older than the counts, so readers may check the data against them.
COUNTED = "unstable_dask.counted"

Lake = Union[str, Path]


def table_uri(lake: Lake, table: str) -> str:
    return st.join(st.root(lake), table)


def app_id(run_name: str, partition: str, part: int) -> str:
    """The application-transaction id of one partition's commit, e.g. `demo/round=3`."""
    return f"{run_name}/{partition}={part}"


_log_reads = 0  # Delta logs opened by this process (bench/lake/bench_lake_requests.py counts them)


def log_reads() -> int:
    """How many times this process has read a table's Delta log."""
    return _log_reads


def load(lake: Lake, table: str, version: Optional[int] = None) -> Optional[DeltaTable]:
    """The table's snapshot (newest, or `version`), None when the table has no log yet."""
    global _log_reads
    _log_reads += 1
    try:
        return DeltaTable(table_uri(lake, table), version=version)
    except TableNotFoundError:
        return None


def _ensure(lake: Lake, table: str) -> DeltaTable:
    """Create the table (empty, version 0) if absent. Two writers may race to create it: with no
    commit retries the loser fails (version 0 exists) instead of retrying its creation as a second
    metaData commit, which would conflict with every commit racing it and could drop properties."""
    dt = load(lake, table)
    if dt is not None:
        return dt
    part = TABLES[table].partition
    try:
        create_table_with_add_actions(table_uri(lake, table), Schema.from_arrow(with_partitions(table)), [],
                                      mode="error", partition_by=["run", part] if part else ["run"],
                                      commit_properties=CommitProperties(max_commit_retries=0))
    except Exception:  # noqa: BLE001 - another writer created it first; load() below says
        pass
    dt = load(lake, table)
    if dt is None:
        raise RuntimeError(f"lake table {table_uri(lake, table)}: could not create its Delta log")
    return dt


@dataclass(frozen=True)
class FileFacts:
    """What a commit records of a file: its size, mtime and footer (read once, when it was checked)."""
    size: int
    mtime_ms: int
    metadata: pq.FileMetaData


def file_facts(lake: Lake, table: str, rel: str) -> FileFacts:
    """The facts of an existing file (`rel`: relative to the table folder), read from storage."""
    path = st.join(lake, table, rel)
    size, mtime_ms = st.stat(path)
    return FileFacts(size, mtime_ms, st.read_metadata(path))  # a torn file fails here, before a commit names it


def add_action(table: str, rel: str, facts: FileFacts) -> tuple[AddAction, bool]:
    """The add action of a file and whether it lacks columns of the catalog schema (written
    before they existed). A marker file's stats also carry its count columns (min = max: one
    row), so a snapshot knows how many rows each commit made visible without opening a file."""
    values = dict(part.split("=", 1) for part in rel.split("/")[:-1])
    names = set(facts.metadata.schema.to_arrow_schema().names)
    lacks = not set(TABLES[table].schema.names) <= names
    stats: dict = {"numRecords": facts.metadata.num_rows}
    counted = (facts.metadata.metadata or {}).get(COUNTED.encode()) == b"true"
    if TABLES[table].rule == "marker" and counted and facts.metadata.num_row_groups == 1:
        rg = facts.metadata.row_group(0)
        for i in range(rg.num_columns):
            col = rg.column(i)
            if col.path_in_schema in counts(table).values() and col.is_stats_set:
                if col.statistics.has_min_max:
                    stats.setdefault("minValues", {})[col.path_in_schema] = col.statistics.min
                    stats.setdefault("maxValues", {})[col.path_in_schema] = col.statistics.max
                stats.setdefault("nullCount", {})[col.path_in_schema] = col.statistics.null_count
    return AddAction(rel, facts.size, values, facts.mtime_ms, True, json.dumps(stats)), lacks


def commit(lake: Lake, table: str, rels: list[str], app: Optional[str] = None,
           metadata: Optional[dict] = None, facts: Optional[dict[str, FileFacts]] = None) -> bool:
    """One Delta commit adding `rels` (their facts taken from `facts` where known, else read);
    False (nothing done) when `app` is already in the log."""
    dt = _ensure(lake, table)
    adds: list = []
    mixed = False
    for rel in rels:
        known = (facts or {}).get(rel)
        a, lacks = add_action(table, rel, known if known is not None else file_facts(lake, table, rel))
        adds.append(a)
        mixed |= lacks
    if mixed and dt.metadata().configuration.get(MIXED) != "true":
        # Readers then match columns by name in every file (slower), instead of the first file's.
        dt.alter.set_table_properties({MIXED: "true"}, raise_if_not_exists=False)
        dt = _ensure(lake, table)
    part = TABLES[table].partition
    props = CommitProperties(custom_metadata=metadata, max_commit_retries=20,
                             app_transactions=[Transaction(app, 1, int(time.time() * 1000))] if app else None)
    # delta-rs retries plain append conflicts itself; a racing metaData commit (another writer
    # marking the table mixed) is a conflict it does not retry, so reload and try again here.
    tries = 0
    while True:
        if app is not None and dt.transaction_version(app) is not None:
            return False  # this partition's commit is in the log already (a retry, or a racing writer)
        try:
            dt.create_write_transaction(adds, "append", with_partitions(table), ["run", part] if part else ["run"],
                                        commit_properties=props)
            return True
        except CommitFailedError:
            tries += 1
            if tries == _METADATA_RETRIES:
                raise
            dt = _ensure(lake, table)


def claimed(lake: Lake, table: str, app: str) -> bool:
    dt = load(lake, table)
    return dt is not None and dt.transaction_version(app) is not None


def claim_metadata(lake: Lake, table: str, app: str, dt: Optional[DeltaTable] = None) -> Optional[dict]:
    """The custom metadata of the commit that claimed `app` (None if unclaimed) in `dt` (default:
    the newest log): from the history, read only to finish a commit whose driver died between
    claiming and publishing."""
    dt = dt or load(lake, table)
    if dt is None or dt.transaction_version(app) is None:
        return None
    for info in dt.history():
        if info.get("unstable_dask.claim") == app:
            return info
    return None


@dataclass
class Snapshot:
    table: str
    version: Optional[int]  # None: no log yet
    paths: list[str]  # relative to the table folder
    runs: list[str]
    parts: list[Optional[int]]  # round / iteration of each file (None for unpartitioned tables)
    mixed: bool
    log: Optional[DeltaTable] = None  # the log as read (its application transactions: claims)
    rows: list[Optional[int]] = field(default_factory=list)  # each file's row count, as its add action records it
    # marker tables: {count column: its value in each marker file} (None where the stats lack it)
    counts: dict[str, list[Optional[int]]] = field(default_factory=dict)

    def claimed(self, app: str) -> bool:
        """Whether `app` (a partition's commit) is in this version of the log."""
        return self.log is not None and self.log.transaction_version(app) is not None


def snapshot(lake: Lake, table: str, version: Optional[int] = None) -> Snapshot:
    dt = load(lake, table, version)
    if dt is None:
        return Snapshot(table, None, [], [], [], False)
    adds = pa.table(dt.get_add_actions(flatten=True))
    part = TABLES[table].partition
    n = adds.num_rows
    parts: list[Optional[int]] = ([int(v) for v in adds.column(f"partition.{part}").to_pylist()]
                                  if part and n else [None] * n)
    runs = adds.column("partition.run").to_pylist() if n else []

    def column(name: str) -> list[Optional[int]]:
        return adds.column(name).to_pylist() if n and name in adds.column_names else [None] * n

    marker_counts = {c: column(f"min.{c}") for c in counts(table).values()}
    return Snapshot(table, dt.version(), adds.column("path").to_pylist() if n else [], runs, parts,
                    dt.metadata().configuration.get(MIXED) == "true", dt, column("num_records"), marker_counts)


def compact(lake: Lake, table: str, run_name: Optional[str] = None, target_mb: int = 128) -> dict:
    """Merge a table's small files (of one run, or all) into files of up to `target_mb`.

    A `data_change = false` rewrite: every query reads the same rows before and after."""
    dt = load(lake, table)
    if dt is None:
        return {"table": table, "added": 0, "removed": 0}
    metrics = dt.optimize.compact(partition_filters=[("run", "=", run_name)] if run_name else None,
                                  target_size=target_mb * 2**20)
    return {"table": table, "added": metrics.get("numFilesAdded", 0), "removed": metrics.get("numFilesRemoved", 0)}


def vacuum(lake: Lake, table: str, retention_hours: float) -> tuple[list[str], set[str]]:
    """Delete files the log removed (compaction, rollback) more than `retention_hours` ago. Files
    never named by a commit (a round still being played) are left alone: `full=False`. Returns the
    deleted paths and every path the log still names (its files and its younger removals), all
    relative to the table."""
    dt = load(lake, table)
    if dt is None:
        return [], set()
    # delta-rs takes whole hours: round up, so no file younger than asked is ever deleted
    removed = dt.vacuum(retention_hours=math.ceil(retention_hours), dry_run=False, enforce_retention_duration=False)
    kept = dt.vacuum(retention_hours=0, dry_run=True, enforce_retention_duration=False)  # removals still on disk
    adds = pa.table(dt.get_add_actions(flatten=True))
    return removed, set(kept) | set(adds.column("path").to_pylist() if adds.num_rows else [])
