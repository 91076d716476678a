"""Lake maintenance: `run compact` merges a run's small files, `run vacuum` deletes the files no
current snapshot needs (replaced files, leftovers of killed jobs, stale adapters), and both keep
every query's result unchanged (`checksums` says so). Leftovers are vacuum's, not a separate
command's: the same retention protects whatever a live job or an older snapshot may still read.

Compaction is a Delta `optimize` (a rewrite committed with data_change = false): each partition
(a run's round or learner iteration) ends up as one file per table instead of one per task, so a
reader opens rounds x tables files, not rounds x tasks x tables. The old files stay on disk, named
by older versions only, until `vacuum` removes those older than the retention; until then
`learn --at-version` and `connect(versions=...)` can still read the snapshots that named them.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional, Union

import duckdb

from unstable_dask.lake import delta as dl
from unstable_dask.lake import storage as st
from unstable_dask.lake.catalog import DELTA_TABLES, PARTITION, TABLES, VIEWS, with_partitions
from unstable_dask.lake.lake import Lake

DEFAULT_RETENTION_HOURS = 168.0  # a week: long enough for any learner batch still being reproduced
# Leftovers are taken only when at least this old, whatever the retention: a live job's file (a
# compaction's part before its commit, a learner's temp adapter) is never older than that.
LEFTOVER_MIN_AGE_HOURS = 1.0


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
    """Delete, once older than `retention_hours`, what no snapshot needs; returns the removed paths,
    relative to the lake (an adapter folder ends with "/"):

    - files that compaction or a rollback replaced (the Delta log's removals);
    - leftovers of killed or losing jobs in committed partitions: files no version of the log names
      (a killed compaction's parts, a losing driver's late task files, temp files of killed writers);
    - adapter folders no checkpoint names: attempts of killed learners, checkpoints retired by
      `run rollback`, temp folders (`.ckpt-<k>.*.tmp`) of learners killed while saving. Only of
      iterations already decided (claimed), so a learner still training keeps its folder.

    Leftovers go only once older than LEFTOVER_MIN_AGE_HOURS too, even with a shorter retention.

    Nothing a current commit names is ever touched, nor a partition not yet committed (a round
    being played: the next driver of that round cleans it up)."""
    if not retention_hours >= 0:
        raise ValueError(f"vacuum: retention_hours must be >= 0, got {retention_hours}")
    lake = Lake(lake)
    cutoff_ms = (time.time() - max(retention_hours, LEFTOVER_MIN_AGE_HOURS) * 3600) * 1000
    removed = []
    for table in DELTA_TABLES:
        gone, named = dl.vacuum(lake.root, table, retention_hours)
        removed += [f"{table}/{p}" for p in gone]
        removed += _leftovers(lake, table, named | set(gone), cutoff_ms)
    removed += _stale_adapters(lake, cutoff_ms)
    lake.refresh().refresh_catalog()
    return sorted(removed)


def _leftovers(lake: Lake, table: str, named: set[str], cutoff_ms: float) -> list[str]:
    """Files in the table's committed partitions that no version of its log names, older than the cutoff."""
    marker = TABLES[table].marker or table
    committed = set(zip(*[lake.snapshot.log(marker).runs, lake.snapshot.log(marker).parts]))
    folder = st.join(lake.root, table)
    out = []
    for f in st.list_files(folder, recursive=True):
        rel = f.path[len(folder):].lstrip("/")
        parts = dict(p.split("=", 1) for p in rel.split("/")[:-1] if "=" in p)
        part = parts.get(PARTITION[table])
        if (rel.startswith("_delta_log/") or rel in named or f.mtime_ms > cutoff_ms or part is None
                or (parts.get("run"), int(part)) not in committed):
            continue
        st.delete(f.path)
        out.append(f"{table}/{rel}")
    return out


def _stale_adapters(lake: Lake, cutoff_ms: float) -> list[str]:
    """Adapter folders (adapters/<run>/<uid>.<attempt>/, or a learner's temp folder) that no
    checkpoint names, of an iteration already claimed (or a temp folder), older than the cutoff."""
    named = {r["adapter_path"] for r in lake.table("checkpoints").rows() if r["adapter_path"]}
    mtimes: dict[str, list[int]] = {}  # <run>/<folder> -> the mtimes of the files in it
    root = lake.location("adapters")
    for f in st.list_files(root, recursive=True):
        rel = f.path[len(root):].lstrip("/").split("/")
        if len(rel) >= 3:
            mtimes.setdefault(f"{rel[0]}/{rel[1]}", []).append(f.mtime_ms)
    out = []
    for folder, times in sorted(mtimes.items()):
        run_name, name = folder.split("/")
        m = re.fullmatch(r"\.?ckpt-(\d+)\.[0-9a-f]{8}(\.[0-9a-f]{8}\.tmp)?", name)
        if m is None or f"adapters/{folder}" in named or max(times) > cutoff_ms:
            continue
        temp = m.group(2) is not None
        if not temp and int(m.group(1)) > (lake.last_claimed("checkpoints", run_name) or 0):
            continue  # an iteration not decided yet: its learner may still commit this folder
        st.delete(lake.location(f"adapters/{folder}"))
        out.append(f"adapters/{folder}/")
    return out


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
