"""`run migrate`: give a lake written by the pre-Delta format (commit-marker files found by
listing) a Delta log, in place, losing nothing.

The data files stay where they are; each committed round and learner iteration becomes one
commit naming exactly the files the old reader saw (the attempt its marker names, or every whole
file of the partition for markers older than attempts). Before and after, every table's row
count and an order-independent checksum of its rows are compared; a difference is an error.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

import duckdb
import pyarrow.parquet as pq

from unstable_dask.lake import commit
from unstable_dask.lake import delta as dl
from unstable_dask.lake.catalog import PARTITION, TABLES, VIEWS, data_tables
from unstable_dask.lake.lake import Lake
from unstable_dask.lake.maintain import checksum_sql, checksums
from unstable_dask.lake.read import view_sql


@dataclass
class Pending:
    marker: str
    run_name: str
    part: int
    marker_file: Path
    files: dict[str, dict]  # data table -> {path relative to the table folder: its facts}


def pending(lake: Union[str, Path]) -> list[Pending]:
    """The old-format commits of a lake that its Delta log does not hold yet."""
    out = []
    for marker in ("rounds", "checkpoints"):
        part_name = PARTITION[marker]
        for d in sorted((Path(lake) / marker).glob(f"run=*/{part_name}=*")):
            run_name, part = d.parent.name.split("=", 1)[1], int(d.name.split("=", 1)[1])
            if dl.claimed(lake, marker, dl.app_id(run_name, part_name, part)):
                continue
            markers = [p for p in sorted(d.glob("*.parquet")) if not p.name.startswith(".")
                       and commit.why_not_belongs(p, marker)[0] is None]
            if not markers:
                continue
            names = pq.read_schema(markers[0]).names
            attempt = pq.read_table(markers[0], columns=["attempt"]).column(0)[0].as_py() if "attempt" in names else None
            files = {t: commit.partition_files(str(lake), t, run_name, part, attempt) for t in data_tables(marker)}
            out.append(Pending(marker, run_name, part, markers[0], files))
    return out


def _old_view(con: duckdb.DuckDBPyConnection, lake: Path, table: str, todo: list[Pending]) -> str:
    """What a reader shows of `table` once the pending commits are in (the old reader's files of
    them, plus what the log commits already: a migration cut short and run again), as a relation."""
    files = Lake(lake).table(table).files()
    if table in data_tables("rounds") + data_tables("checkpoints"):
        files += [str(lake.resolve() / table / r) for p in todo for r in p.files.get(table, [])]
    elif TABLES[table].rule == "marker":
        files += [str(p.marker_file.resolve()) for p in todo if p.marker == table]
    name = f"_old_{table}"
    con.execute(f"CREATE VIEW {name} AS {view_sql(table, files, True)}")
    return name


def migrate(lake: Union[str, Path]) -> dict[str, tuple[int, int]]:
    """Commit every old-format round and iteration of `lake`; {table: (rows, checksum)}.

    Raises RuntimeError naming the table when rows or checksums differ after the migration."""
    lake = Path(lake).resolve()
    for marker in ("rounds", "checkpoints"):  # a migration killed between a claim and its publish
        for run_dir in sorted((lake / marker).glob("run=*")):
            Lake(lake).finish_commits(marker, run_dir.name.split("=", 1)[1])
    todo = pending(lake)
    if not todo:
        return {}
    old = duckdb.connect(":memory:")
    before = {t: tuple(int(v) for v in old.execute(checksum_sql(t, _old_view(old, lake, t, todo))).fetchall()[0])
              for t in VIEWS}
    for p in sorted(todo, key=lambda p: (p.marker, p.run_name, p.part)):
        commit.claim_and_publish(str(lake), p.marker, p.run_name, p.part, p.marker_file, p.files)
    done = Lake(lake)
    done.refresh_catalog()
    after = checksums(done.connect())
    for t in VIEWS:
        if before[t] != after[t]:
            raise RuntimeError(f"migrate: table {t!r} in lake {lake} changed: {before[t][0]} rows before, "
                               f"{after[t][0]} after (checksums {before[t][1]} vs {after[t][1]})")
    return after
