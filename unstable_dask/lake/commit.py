"""The commit protocol: how files written by workers become a committed round or learner iteration.

A commit of a partition (a round, a learner iteration) takes three Delta commits, each keyed by
the application id `<run>/<partition>=<n>`:
  1. claim: the marker table (rounds / checkpoints) records the app id, with the path of the
     marker file (the row, naming every data file) in the commit's metadata. A second claim of
     the same app id is refused or conflicts: a partition is committed once.
  2. apply: each data table adds the named files, once (the same app id in its own log).
  3. publish: the marker table adds the marker file. Readers see a partition only from here on.
A driver killed between 1 and 3 leaves a claim that `finish_commits` completes from the log.

Functions here take the lake's root location; `Lake` (lake.py) is what jobs call.
"""
from __future__ import annotations

import logging
import re
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, Optional, Union

import pyarrow as pa
from deltalake.transaction import CommitProperties, Transaction

from unstable_dask.lake import delta as dl
from unstable_dask.lake import storage as st
from unstable_dask.lake.catalog import PARTITION, SCHEMAS, TABLES, counts, data_tables
from unstable_dask.lake.read import sql_str

log = logging.getLogger("unstable_dask.lake")


def now() -> datetime:
    """The lake's clock: timestamps of rows and commits (UTC)."""
    return datetime.now(timezone.utc)


def partition_dir(root: str, table: str, run_name: str, part: Optional[int] = None) -> str:
    """`<root>/<table>/run=<run>[/<round|iteration>=<n>]`: the one rule for where a table's files live."""
    parts = [table, f"run={run_name}"] + ([f"{PARTITION[table]}={part}"] if part is not None else [])
    return st.join(root, *parts)


def as_table(table: str, data: Union[pa.Table, list[dict]]) -> pa.Table:
    """Rows or an Arrow table in the catalog's schema of `table` (columns selected and cast)."""
    schema = SCHEMAS.get(table)
    if isinstance(data, list):
        return pa.Table.from_pylist(data, schema=schema) if schema is not None else pa.Table.from_pylist(data)
    if schema is None:
        return data
    # cast() takes the catalog schema's (empty) metadata: keep the caller's table-level metadata
    # (ratings_state records the rounds and parameters of its replay there).
    return data.select(schema.names).cast(schema).replace_schema_metadata(data.schema.metadata)


def file_location(root: str, table: str, run_name: str, part: Optional[int], key: str) -> str:
    """The location of one file of a table: `<partition dir>/<key>.parquet`."""
    return st.join(partition_dir(root, table, run_name, part), f"{key}.parquet")


def write_file(root: str, table: str, run_name: str, part: Optional[int], key: str, data: pa.Table) -> str:
    """Write one Parquet file of a partition; no reader sees it half written (storage.write_parquet)."""
    final = file_location(root, table, run_name, part, key)
    st.write_parquet(final, data)
    return final


def why_not_belongs(path: st.Location, table: str) -> tuple[Optional[str], Any]:
    """(None, its footer) if the file fits the table (whole, key columns with their types), else
    (why not, None). One footer read."""
    try:
        meta = st.read_metadata(path)
    except Exception:  # noqa: BLE001 - no magic bytes, a cut footer: any unreadable file is not whole
        return "not a whole Parquet file (torn write?)", None
    schema = meta.schema.to_arrow_schema()
    want = TABLES[table].schema
    for k in TABLES[table].keys:
        if k not in schema.names:
            return f"has no column {k!r}: not a {table} file", None
        if not schema.field(k).type.equals(want.field(k).type):
            return f"column {k!r} is {schema.field(k).type}, expected {want.field(k).type}", None
    return None, meta


def attempt_of(path: st.Location) -> Optional[str]:
    """The attempt id in a file's name (`task-0003.<attempt>.parquet`), if any."""
    parts = st.name(path).split(".")
    return parts[1] if len(parts) == 3 else None


# What a round's or learner's attempt writes into a partition, and nothing else: `<key>.<attempt>.parquet`
# (attempt: 8 hex digits from uuid4) and the temp files of those writes (storage.write_parquet). A
# compacted file (`part-00000-<uuid>-c000.zstd.parquet`) or anything else never matches.
ATTEMPT_FILE = re.compile(r"(?P<key>(task-\d+|steps|baselines))\.(?P<attempt>[0-9a-f]{8})\.parquet")
ATTEMPT_TEMP = re.compile(r"\.(task-\d+|steps|baselines)\.[0-9a-f]{8}\.[0-9a-f]{8}\.tmp")


def partition_files(root: str, table: str, run_name: str, part: int,
                    attempt: Optional[str]) -> dict[str, dl.FileFacts]:
    """The files of one partition that a commit names, relative to the table folder, with what the
    commit records of them: those of `attempt` (every file when None, as for lakes written before
    attempts), whole and of the table's schema; anything else there is skipped with a warning.
    One listing, then one footer read a file."""
    out = {}
    for f in st.list_files(partition_dir(root, table, run_name, part)):
        n = st.name(f.path)
        if n.startswith(".") or not n.endswith(".parquet") or (attempt is not None and attempt_of(f.path) != attempt):
            continue
        why, meta = why_not_belongs(f.path, table)
        if why is None:
            out[f"run={run_name}/{PARTITION[table]}={part}/{n}"] = dl.FileFacts(f.size, f.mtime_ms, meta)
        else:
            log.warning("lake: not committing %s: %s", f.path, why)
    return out


def commit_marker(root: str, marker: str, run_name: str, part: int, key: str, row: dict) -> str:
    """Commit a partition (round or learner iteration): claim, apply its data files, publish.

    FileExistsError when the partition is already claimed (by another driver, or an earlier run)."""
    attempt = row.get("attempt")
    files = {t: partition_files(root, t, run_name, part, attempt) for t in data_tables(marker)}
    # The count columns say how many rows the commit makes visible: every reader checks them.
    row = dict(row, files=[f"{t}/{rel}" for t, rels in files.items() for rel in rels],
               **{col: sum(f.metadata.num_rows for f in files[t].values()) for t, col in counts(marker).items()})
    data = as_table(marker, [row]).replace_schema_metadata({dl.COUNTED: "true"})
    path = write_file(root, marker, run_name, part, f"{key}.{attempt or uuid.uuid4().hex[:8]}", data)
    try:
        claim_and_publish(root, marker, run_name, part, path, files)
    except FileExistsError:
        st.delete(path)
        raise
    return path


def claim_and_publish(root: str, marker: str, run_name: str, part: int, marker_file: st.Location,
                      files: dict[str, dict[str, dl.FileFacts]]) -> None:
    """Steps 1-3 of a commit for a marker file already written (also used by `migrate`)."""
    app = dl.app_id(run_name, PARTITION[marker], part)
    rel = f"run={run_name}/{PARTITION[marker]}={part}/{st.name(marker_file)}"
    if not dl.commit(root, marker, [], app=app, metadata={"unstable_dask.claim": app, "unstable_dask.marker": rel}):
        raise FileExistsError(f"{marker} {app} was committed by another writer in lake {root}")
    publish(root, marker, app, rel, files)


def publish(root: str, marker: str, app: str, marker_rel: str, files: dict[str, dict[str, dl.FileFacts]]) -> None:
    """Steps 2 and 3 of a commit; each is idempotent, so a finisher may repeat them. `files`:
    data table -> {path relative to the table: its facts, or {} to read them}."""
    for table, rels in files.items():
        dl.commit(root, table, list(rels), app=app, facts={r: f for r, f in rels.items() if f is not None})
    dl.commit(root, marker, [marker_rel])  # adding a path the log has already is a no-op


def _first(marker: str) -> int:
    """The number of a run's first partition: rounds count from 0, learner iterations from 1."""
    return 1 if PARTITION[marker] == "iteration" else 0


def _last_published(log: dl.Snapshot, run_name: str) -> int:
    """The run's newest published partition, else the number before its first: the claims after
    it are contiguous (a rollback retires published partitions, never their claims)."""
    return max((p for r, p in zip(log.runs, log.parts) if r == run_name and p is not None),
               default=_first(log.table) - 1)


def finish_commits(root: str, marker: str, run_name: str, log: dl.Snapshot) -> list[int]:
    """Publish the partitions of `run_name` that the marker's log (`log`) shows claimed but not
    published (a driver killed mid-commit): the marker file named in the claim lists the files.
    Returns their numbers."""
    done: list[int] = []
    part = _last_published(log, run_name)
    while True:
        app = dl.app_id(run_name, PARTITION[marker], part + 1)
        if log.claimed(retired_app(app)):  # taken out by `run rollback`: not a commit to finish
            part += 1
            continue
        meta = dl.claim_metadata(root, marker, app, log.log) if log.claimed(app) else None
        if meta is None:
            return done
        rel = meta["unstable_dask.marker"]
        names = st.read_table(st.join(root, marker, rel), columns=["files"]).column(0)[0].as_py() or []
        files: dict[str, dict] = {t: {} for t in data_tables(marker)}
        for name in names:
            t, r = name.split("/", 1)
            files[t][r] = None  # read again: the driver that checked them is gone
        publish(root, marker, app, rel, files)
        part += 1
        done.append(part)


def last_claimed(marker: str, run_name: str, log: dl.Snapshot) -> Optional[int]:
    """The newest partition of `run_name` claimed in the marker's log (published or being published)."""
    part = _last_published(log, run_name)
    while log.claimed(dl.app_id(run_name, PARTITION[marker], part + 1)):
        part += 1
    return None if part < _first(marker) else part


def remove_other_attempts(root: str, marker: str, run_name: str, part: int, attempt: str,
                          logged: Callable[[str], set[str]]) -> list[str]:
    """After a commit: delete the files other attempts of the same partition left behind, and the
    temp files of their writers killed mid-write: once the partition is committed none can ever
    count. Only names an attempt writes (ATTEMPT_FILE, ATTEMPT_TEMP) of another attempt, and never
    a file the post-commit Delta log names (`logged(table)`: paths relative to the table, asked
    only when there is something to delete): a compaction committing meanwhile writes files of its
    own that must stay. Returns the removed locations."""
    removed = []
    for table in data_tables(marker):
        rel = f"run={run_name}/{PARTITION[table]}={part}/"
        stale = []
        for p in st.list_dir(partition_dir(root, table, run_name, part)):
            m = ATTEMPT_FILE.fullmatch(st.name(p))
            if (m is not None and m["attempt"] != attempt) or ATTEMPT_TEMP.fullmatch(st.name(p)):
                stale.append(p)
        keep = logged(table) if stale else set()
        for p in stale:
            if rel + st.name(p) not in keep:
                st.delete(p)
                removed.append(p)
    return removed


def retire(root: str, marker: str, run_name: str, parts: list[int]) -> None:
    """Take committed partitions out of the lake (`run rollback`): the marker table's files first,
    so readers stop seeing the partitions at once, then their data files, each a Delta delete on
    the partition columns (files removed, none rewritten). The claims stay in the marker's log, so
    those numbers are never committed again; the marker's delete also records `retired:<app id>`
    for each, so `finish_commits` never mistakes them for commits a killed driver left unpublished."""
    if not parts:
        return
    predicate = f"run = {sql_str(run_name)} AND {PARTITION[marker]} IN ({', '.join(str(int(p)) for p in sorted(parts))})"
    retired = [Transaction(retired_app(dl.app_id(run_name, PARTITION[marker], p)), 1) for p in parts]
    for table in [marker, *data_tables(marker)]:
        dt = dl.load(root, table)
        if dt is not None:
            props = CommitProperties(app_transactions=retired) if table == marker else None
            dt.delete(predicate, commit_properties=props)


def retired_app(app: str) -> str:
    """The application id recording that the partition of `app` was retired."""
    return f"retired:{app}"
