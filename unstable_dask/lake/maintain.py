"""Lake maintenance: `run compact` merges a run's small files, `run vacuum` deletes the files no
current snapshot needs, and both keep every query's result unchanged (`checksums` says so).

Compaction is a Delta `optimize` (a rewrite committed with data_change = false): each partition
(a run's round or learner iteration) ends up as one file per table instead of one per task, so a
reader opens rounds x tables files, not rounds x tasks x tables. The old files stay on disk, named
by older versions only, until `vacuum` removes those older than the retention; until then
`learn --at-version` and `connect(versions=...)` can still read the snapshots that named them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import duckdb

from unstable_dask.lake import delta as dl
from unstable_dask.lake.catalog import DELTA_TABLES, VIEWS, with_partitions
from unstable_dask.lake.lake import Lake

DEFAULT_RETENTION_HOURS = 168.0  # a week: long enough for any learner batch still being reproduced


def compact(lake: Union[str, Path, Lake], run_name: Optional[str] = None,
            target_mb: int = 128) -> dict[str, tuple[int, int]]:
    """Merge the small files of a run (every run when None) in every Delta table; returns
    {table: (files removed, files added)}. The duckdb shell's views are rewritten to the new files."""
    lake = Lake(lake)
    out = {}
    for table in DELTA_TABLES:
        m = dl.compact(lake.root, table, run_name, target_mb)
        out[table] = (int(m["removed"]), int(m["added"]))
    lake.refresh().refresh_catalog()
    return out


def vacuum(lake: Union[str, Path, Lake], retention_hours: float = DEFAULT_RETENTION_HOURS) -> list[str]:
    """Delete files that compaction replaced more than `retention_hours` ago; returns their paths,
    relative to the lake. Files no commit has named yet (a round being played) are never touched."""
    if retention_hours < 0:
        raise ValueError(f"vacuum: retention_hours must be >= 0, got {retention_hours}")
    lake = Lake(lake)
    removed = []
    for table in DELTA_TABLES:
        removed += [f"{table}/{p}" for p in dl.vacuum(lake.root, table, retention_hours)]
    lake.refresh().refresh_catalog()
    return sorted(removed)


def checksum_sql(table: str, source: str) -> str:
    """Row count and an order-independent hash of every row (partition columns included) of
    `table` as read from the relation `source`."""
    cols = ", ".join(f'"{c}"' for c in with_partitions(table).names)
    return f"SELECT count(*), coalesce(sum(hash(t)::HUGEINT), 0) FROM (SELECT {cols} FROM {source}) t"


def checksums(con: duckdb.DuckDBPyConnection) -> dict[str, tuple[int, int]]:
    """{table: (rows, checksum)} of every view of a lake connection: equal before and after any
    maintenance, or a query's answer changed."""
    out = {}
    for t in VIEWS:
        rows, checksum = con.execute(checksum_sql(t, t)).fetchall()[0]
        out[t] = (int(rows), int(checksum))
    return out
