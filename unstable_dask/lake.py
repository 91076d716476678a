"""The lake: hive-partitioned Parquet files plus DuckDB views over the committed ones.

Layout (documented column by column in lake/README.md):

    <lake>/<table>/run=<run>/round=<n>/<key>.parquet     games, turns, rounds (commit markers)
    <lake>/<table>/run=<run>/iteration=<k>/<key>.parquet checkpoints, learner_steps
    <lake>/<table>/run=<run>/<key>.parquet               ratings, rating_history, head_to_head
    <lake>/adapters/<run>/<uid>/                         LoRA adapters (peft format)
    <lake>/lake.duckdb                                   views for the duckdb shell (a snapshot)

Every write goes to a `.tmp` name in the same folder and is renamed into place, so a reader sees
a whole file or none, and a retried task replaces its file instead of adding a second copy.
Games and turns become visible only once the round's commit marker exists; learner_steps only
once their checkpoint row exists.
"""
from __future__ import annotations

import logging
import os
import re
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Optional, Union

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

SEAT = pa.struct([
    ("pid", pa.int32()),
    ("model_uid", pa.string()),  # checkpoint uid, "base", "random", an adapter dir's name, an endpoint's model id
    ("is_learner", pa.bool_()),  # seat played by the checkpoint this round trains/evaluates
    ("role", pa.string()),
    ("reward", pa.float64()),  # final reward from the env
    ("invalid_move", pa.bool_()),  # the game ended because this seat made an invalid move
    ("reason", pa.string()),
])

SCHEMAS: dict[str, pa.Schema] = {
    "games": pa.schema([
        ("game_id", pa.string()),
        ("split", pa.string()),  # train | eval
        ("env_id", pa.string()),
        ("seed", pa.int64()),  # the env seed (reset(seed=...)); shared by the games of a group
        ("group_id", pa.string()),  # games of one start state: same env, seed, seats (round.group_size)
        ("num_players", pa.int32()),
        ("num_turns", pa.int32()),
        ("started_at", pa.timestamp("us", tz="UTC")),
        ("finished_at", pa.timestamp("us", tz="UTC")),
        ("worker", pa.string()),
        ("task", pa.string()),
        ("seats", pa.list_(SEAT)),
    ]),
    "turns": pa.schema([
        ("game_id", pa.string()),
        ("turn", pa.int32()),  # 0-based index over all moves of the game
        ("pid", pa.int32()),
        ("model_uid", pa.string()),
        ("is_learner", pa.bool_()),
        ("split", pa.string()),
        ("env_id", pa.string()),
        ("seed", pa.int64()),  # the game's env seed
        ("group_id", pa.string()),  # the game's group (GRPO compares the (group_id, pid) attempts)
        ("observation", pa.string()),
        ("prompt", pa.string()),  # exact text fed to the model (null for the random agent)
        ("completion", pa.string()),  # raw model output
        ("action", pa.string()),  # what was sent to the env
        ("format_ok", pa.bool_()),  # a non-empty \boxed{} answer was found
        ("invalid_move", pa.bool_()),
        ("step_info", pa.string()),  # JSON
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        # the exact ids the engine generated (EOS included when generated); null for the random agent
        ("completion_token_ids", pa.list_(pa.int32())),
        ("truncated", pa.bool_()),  # generation stopped at max_new_tokens
        # behaviour log-prob of each completion token: sampling.sampling_logprobs(logits, T, top_p)
        ("logprobs", pa.list_(pa.float32())),
        ("latency_s", pa.float64()),  # wall time of the batched generate call this turn was in (endpoints: its request)
        ("error", pa.string()),  # why an endpoint request finally failed (completion null); null otherwise
    ]),
    "rounds": pa.schema([
        ("attempt", pa.string()),  # the driver attempt whose files are the round's data
        ("checkpoint_uid", pa.string()),  # the checkpoint this round played
        ("games", pa.int64()),
        ("turns", pa.int64()),
        ("tasks", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("temperature", pa.float64()),  # the sampling settings the round's games were played with
        ("top_p", pa.float64()),
        ("max_new_tokens", pa.int64()),
        ("job_fingerprint", pa.string()),
        ("job", pa.string()),  # the validated job as JSON
        ("started_at", pa.timestamp("us", tz="UTC")),
        ("committed_at", pa.timestamp("us", tz="UTC")),
    ]),
    "checkpoints": pa.schema([
        ("attempt", pa.string()),  # the learner attempt whose adapter and learner_steps are this checkpoint's
        ("uid", pa.string()),
        ("parent_uid", pa.string()),
        ("adapter_path", pa.string()),  # relative to the lake root; null for the base model
        ("base_model", pa.string()),
        ("rounds_trained", pa.list_(pa.int64())),
        ("algorithm", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]),
}

# How each table is partitioned below run=<run>/.
PARTITION = {"games": "round", "turns": "round", "rounds": "round",
             "checkpoints": "iteration", "learner_steps": "iteration"}
HIVE_TYPES = {"run": "VARCHAR", "round": "BIGINT", "iteration": "BIGINT"}

_PARQUET_MAGIC = b"PAR1"
log = logging.getLogger("unstable_dask.lake")


def now() -> datetime:
    return datetime.now(timezone.utc)


def table_dir(lake: Union[str, Path], table: str, run: str, part: Optional[int] = None) -> Path:
    d = Path(lake) / table / f"run={run}"
    if part is not None:
        d = d / f"{PARTITION[table]}={part}"
    return d


def write_table(lake: Union[str, Path], table: str, run: str, part: Optional[int], key: str,
                data: Union[pa.Table, list[dict]], exclusive: bool = False) -> Path:
    """Atomically write one Parquet file to its deterministic name and return the path.

    `exclusive=True` refuses to replace an existing file (used for commit markers, so two drivers
    cannot both commit the same round); it raises FileExistsError.
    """
    if isinstance(data, list):
        schema = SCHEMAS.get(table)
        data = pa.Table.from_pylist(data, schema=schema) if schema is not None else pa.Table.from_pylist(data)
    elif table in SCHEMAS:
        data = data.select(SCHEMAS[table].names).cast(SCHEMAS[table])
    d = table_dir(lake, table, run, part)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"{key}.parquet"
    tmp = d / f".{key}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        pq.write_table(data, tmp, compression="zstd")
        pq.read_metadata(tmp)  # a torn write fails here, never behind the final name
        if exclusive:
            os.link(tmp, final)  # atomic create-if-absent
        else:
            os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def is_whole_parquet(path: Path) -> bool:
    """Cheap check for a complete Parquet file: magic bytes at both ends."""
    try:
        size = path.stat().st_size
        if size < 12:
            return False
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(-4, os.SEEK_END)
            return head == _PARQUET_MAGIC and f.read(4) == _PARQUET_MAGIC
    except OSError:
        return False


_PART_RE = re.compile(r"^(run|round|iteration)=(.+)$")


def _partition_values(path: Path, root: Path) -> dict:
    vals = {}
    for part in path.relative_to(root).parts[:-1]:
        m = _PART_RE.match(part)
        if m:
            vals[m.group(1)] = m.group(2) if m.group(1) == "run" else int(m.group(2))
    return vals


# Columns a file must have (with these types) to belong to a table. Other columns may be missing:
# files written before a column was added still read, with nulls in it.
KEY_COLUMNS = {"games": ("game_id", "seats"), "turns": ("game_id", "turn", "pid"),
               "rounds": ("checkpoint_uid",), "checkpoints": ("uid",)}


def _belongs(path: Path, table: str) -> Optional[str]:
    """None if the file fits the table, else why not."""
    if not is_whole_parquet(path):
        return "not a whole Parquet file (torn write?)"
    keys = KEY_COLUMNS.get(table)
    if not keys:
        return None
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # noqa: BLE001 - any unreadable footer is a foreign file
        return f"unreadable footer ({e})"
    want = SCHEMAS[table]
    for k in keys:
        if k not in schema.names:
            return f"has no column {k!r}: not a {table} file"
        if not schema.field(k).type.equals(want.field(k).type):
            return f"column {k!r} is {schema.field(k).type}, expected {want.field(k).type}"
    return None


def list_files(lake: Union[str, Path], table: str) -> list[Path]:
    """Parquet files of a table; temp files are ignored, torn or foreign files skipped with a warning."""
    root = Path(lake) / table
    if not root.is_dir():
        return []
    out = []
    for p in sorted(p for p in root.rglob("*.parquet") if not p.name.startswith(".")):
        why = _belongs(p, table)
        if why is None:
            out.append(p)
        else:
            log.warning("lake: skipping %s: %s", p, why)
    return out


# Tables whose files become visible through a commit marker: table -> (marker table, partition).
COMMITTED_BY = {"games": ("rounds", "round"), "turns": ("rounds", "round"),
                "learner_steps": ("checkpoints", "iteration")}


def committed_attempts(lake: Union[str, Path], marker: str = "rounds",
                       run: Optional[str] = None) -> dict[tuple[str, int], Optional[str]]:
    """(run, round or iteration) -> the attempt id its commit marker records (None: every file
    counts, as in lakes written before attempts existed)."""
    root = Path(lake) / marker
    part = PARTITION[marker]
    out = {}
    for p in list_files(lake, marker):
        v = _partition_values(p, root)
        if part in v and (run is None or v["run"] == run):
            names = pq.read_schema(p).names
            attempt = pq.read_table(p, columns=["attempt"]).column(0)[0].as_py() if "attempt" in names else None
            out[(v["run"], v[part])] = attempt
    return out


def committed_rounds(lake: Union[str, Path], run: Optional[str] = None) -> set[tuple[str, int]]:
    root = Path(lake) / "rounds"
    return {(v["run"], v["round"]) for v in (_partition_values(p, root) for p in list_files(lake, "rounds"))
            if "round" in v and (run is None or v["run"] == run)}


def attempt_of(path: Path) -> Optional[str]:
    """The attempt id in a file's name (`task-0003.<attempt>.parquet`), if any."""
    parts = path.name.split(".")
    return parts[1] if len(parts) == 3 else None


def visible_files(lake: Union[str, Path], table: str) -> list[Path]:
    """Files a reader may see: committed rounds for games/turns, committed checkpoints for steps."""
    files = list_files(lake, table)
    if table not in COMMITTED_BY:
        return files
    marker, part = COMMITTED_BY[table]
    ok = committed_attempts(lake, marker)
    root = Path(lake) / table
    keep = []
    for p in files:
        v = _partition_values(p, root)
        key = (v.get("run"), v.get(part))
        if key in ok and (ok[key] is None or attempt_of(p) == ok[key]):
            keep.append(p)
    return keep


def last_committed_round(lake: Union[str, Path], run: str) -> Optional[int]:
    rounds = [r for (_, r) in committed_rounds(lake, run)]
    return max(rounds) if rounds else None


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def view_sql(lake: Union[str, Path], table: str, absolute: bool = True) -> Optional[str]:
    """SELECT over the visible files of a table, or None when there are none."""
    files = visible_files(lake, table)
    if not files:
        return None
    names = ", ".join(_sql_str(str(p.resolve() if absolute else p)) for p in files)
    part = PARTITION.get(table)
    types = {"run": "VARCHAR"} | ({part: "BIGINT"} if part else {})
    hive_types = "{" + ", ".join(f"'{k}': '{v}'" for k, v in types.items()) + "}"
    return (f"SELECT * FROM read_parquet([{names}], hive_partitioning=true, union_by_name=true, "
            f"hive_types={hive_types})")


TABLES = ("games", "turns", "rounds", "checkpoints", "learner_steps", "ratings", "rating_history", "head_to_head")


SEATS_VIEW = """CREATE OR REPLACE VIEW seats AS
    SELECT g.run, g.round, g.game_id, g.split, g.env_id, g.seed, g.group_id, g.num_players, g.num_turns,
           s.pid, s.model_uid, s.is_learner, s.role, s.reward, s.invalid_move, s.reason
    FROM games g, UNNEST(g.seats) AS t(s)"""


def _schema(table: str) -> Optional[pa.Schema]:
    if table in SCHEMAS:
        return SCHEMAS[table]
    # The jobs that write these tables own their schemas (imported late: they import this module).
    if table == "learner_steps":
        from .learn import LEARNER_STEPS
        return LEARNER_STEPS
    from .ratings import SCHEMAS as RATINGS_SCHEMAS
    return RATINGS_SCHEMAS.get(table)


def _empty_relation(con: duckdb.DuckDBPyConnection, table: str) -> Optional[str]:
    schema = _schema(table)
    if schema is None:
        return None
    part = PARTITION.get(table)
    extra = [("run", pa.string())] + ([(part, pa.int64())] if part else [])
    full = pa.schema(list(schema) + [pa.field(n, t) for n, t in extra])
    name = f"_empty_{table}"
    con.register(name, pa.Table.from_pylist([], schema=full))
    return f"SELECT * FROM {name}"


def create_views(con: duckdb.DuckDBPyConnection, lake: Union[str, Path, None]) -> list[str]:
    """(Re)create one view per table over its visible files, plus the derived `seats` view.

    `lake=None`: every view empty, as on a fresh lake."""
    made = []
    for table in TABLES:
        sql = view_sql(lake, table) if lake is not None else None
        empty = _empty_relation(con, table)  # every column of the table's schema, typed, no rows
        if sql is None:  # a fresh lake: empty views, so queries work
            sql = empty
            if sql is None:
                continue
        elif empty is not None:
            # Files written before a column was added lack it: it reads as NULL, not a binder error.
            sql = f"{sql} UNION ALL BY NAME {empty}"
        con.execute(f"CREATE OR REPLACE VIEW {table} AS {sql}")
        made.append(table)
    con.execute(SEATS_VIEW)
    made.append("seats")
    return made


def connect(lake: Union[str, Path] = "lake", read_only: bool = True) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with views over the committed data of `lake`.

    `read_only=True` (the default) confines file access to the lake folder and locks the
    configuration; together with `query` (SELECT statements only) user SQL can read the lake and
    write nothing.
    """
    con = duckdb.connect(":memory:")
    create_views(con, lake)
    if read_only:
        root = str(Path(lake).resolve()) + os.sep
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
    from .config import JobError
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise JobError(f"{what}: does not parse ({str(e).splitlines()[0]})") from None
    for st in statements:
        if st.type != duckdb.StatementType.SELECT:
            raise JobError(f"{what}: only SELECT queries may run against the lake, got a {st.type.name} statement")


def query(lake: Union[str, Path], sql: str, params: Iterable = ()) -> pa.Table:
    """Run a user's SELECT over the committed lake (read-only) and return Arrow."""
    from .config import JobError
    con = connect(lake)
    try:
        check_select_only(con, sql)
        try:
            return con.sql(sql, params=list(params) or None).to_arrow_table()
        except duckdb.Error as e:
            raise JobError(f"SQL error: {str(e).splitlines()[0]}") from None
    finally:
        con.close()


def refresh_catalog(lake: Union[str, Path]) -> Path:
    """Rewrite <lake>/lake.duckdb: views for the duckdb shell (`duckdb lake/lake.duckdb`)."""
    lake = Path(lake)
    lake.mkdir(parents=True, exist_ok=True)
    final = lake / "lake.duckdb"
    tmp = lake / f".lake.{uuid.uuid4().hex[:8]}.duckdb.tmp"
    con = duckdb.connect(str(tmp))
    try:
        for table in TABLES:
            sql = view_sql(lake, table)
            if sql is not None:
                con.execute(f"CREATE OR REPLACE VIEW {table} AS {sql}")
        if view_sql(lake, "games") is not None:
            con.execute(SEATS_VIEW)
    finally:
        con.close()
    os.replace(tmp, final)
    Path(str(tmp) + ".wal").unlink(missing_ok=True)
    return final


def read_table(lake: Union[str, Path], table: str, where: str = "", params: Iterable = ()) -> pa.Table:
    """A visible table (optionally filtered) as Arrow, through DuckDB."""
    con = connect(lake)
    try:
        sql = f"SELECT * FROM {table}" + (f" WHERE {where}" if where else "")
        return con.sql(sql, params=list(params) or None).to_arrow_table()
    finally:
        con.close()


def commit_round(lake: Union[str, Path], run: str, round_: int, row: dict) -> Path:
    """Write a round's commit marker; FileExistsError if that round is already committed."""
    return write_table(lake, "rounds", run, round_, "commit", [row], exclusive=True)


def remove_other_attempts(lake: Union[str, Path], marker: str, run: str, part: int, attempt: str) -> int:
    """After a commit: delete files other attempts left behind (they can never be visible)."""
    removed = 0
    for table in [t for t, (m, _) in COMMITTED_BY.items() if m == marker]:
        d = table_dir(lake, table, run, part)
        for p in d.glob("*.parquet") if d.is_dir() else []:
            if attempt_of(p) != attempt:
                p.unlink(missing_ok=True)
                removed += 1
    return removed
