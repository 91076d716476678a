"""The learner's batch: the job's reward transforms (transforms.py) composed into ONE DuckDB query.

The composed query's CTEs, in order:

  final_0 .. final    seats of train games of the run, rounds <= the window's last round
                      (run, round, game_id, env_id, seed, pid, role, model_uid, is_learner,
                      env_reward, reward); only learner seats reach `steps`. With a
                      role-advantage state stored at a round s < the window (ema.py), only
                      rounds > s, each key's EMA starting at its stored b (final_<i>_state)
  steps_0 .. steps    learner turns of the window's rounds joined with their seat's final reward
                      (+ turn, group_id, format_ok, invalid_move, token counts, truncated,
                      final_reward; no text: join `turns` for it)
  batch_0 .. batch    `batch_size` rows of `steps`, chosen by ORDER BY hash(round, game_id, turn,
                      pid, seed) LIMIT n (deterministic, no random()), plus step_reward; or whole
                      seats / (group_id, pid) groups in hash order up to batch_size rows (at least
                      one); batch_0 adds prompt, completion, completion_token_ids and logprobs from
                      `turns` and the round's temperature and top_p from `rounds`
and the query returns `batch` with `reward` renamed `advantage`, ordered by (round, game_id, turn).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import duckdb
import pyarrow as pa

from unstable_dask.errors import JobError
from unstable_dask.lake.read import check_select_only, sql_str
from unstable_dask.learn.ema import RoleAdvantageFormatter, find_state, state_cte, stateful
from unstable_dask.learn.transforms import Transform, register_functions

STEP_COLUMNS = ("turn", "group_id", "model_uid", "format_ok", "invalid_move", "prompt_tokens", "completion_tokens",
                "truncated")
# Text columns are joined to the sampled rows only: carrying 1M prompts through the join and the
# top-N sort costs seconds, fetching a batch's worth costs milliseconds.
TEXT_COLUMNS = ("prompt", "completion", "completion_token_ids", "logprobs", "adapter_sha256")
# The sampling settings of each row's round (its commit row): the learner's log-probs use them.
ROUND_COLUMNS = ("temperature", "top_p")

_UNITS = {"seat": "round, game_id, pid", "group": "group_id, pid"}


def batch_query(run_name: str, rounds: Sequence[int], batch_size: int, seed: int,
                final: Sequence[Transform], step: Sequence[Transform], sampling: Sequence[Transform],
                unit: str = "turn", state: Optional[int] = None) -> str:
    """The ONE query returning the learner's batch for the given (already resolved) window.

    `unit` is what is sampled: single turns (REINFORCE), whole seats of a game (A2C needs a seat's
    turns in order for GAE) or whole (group_id, pid) groups (GRPO normalises inside a group).
    `state`: a round < min(rounds) whose role-advantage state the lake holds (ema.find_state): the
    final transforms then scan only the rounds after it; None scans the run's whole history.
    """
    if not rounds:
        raise ValueError("empty window")
    rounds_sql = ", ".join(str(int(r)) for r in sorted(rounds))
    if state is not None and state >= min(rounds):
        raise ValueError(f"a state at round {state} cannot start a window from round {min(rounds)}")
    # Final transforms see the run's history up to the window (role advantage is an EMA over all
    # past games, or over the games after its stored state); without any, the window's games
    # suffice, and the query's cost stays flat in the rounds.
    ctes = _final(run_name, _history(max(rounds), state) if final else f"round IN ({rounds_sql})", state, final)
    cols = ", ".join(f"t.{c}" for c in STEP_COLUMNS)
    ctes.append(("steps_0", f"""SELECT f.run, f.round, f.game_id, f.env_id, f.seed, f.pid, f.role, {cols},
         f.env_reward, f.reward AS final_reward, f.reward
  FROM turns t JOIN final f ON t.run = f.run AND t.round = f.round AND t.game_id = f.game_id AND t.pid = f.pid
  WHERE t.run = {sql_str(run_name)} AND t.round IN ({rounds_sql}) AND t.split = 'train' AND t.is_learner
    AND t.prompt_tokens > 0"""))
    _chain(ctes, "steps", step, "steps_0")
    if unit == "turn":
        ctes.append(("sample", f"""SELECT *, reward AS step_reward FROM steps
  ORDER BY hash(round, game_id, turn, pid, {int(seed)}), round, game_id, turn, pid
  LIMIT {int(batch_size)}"""))
    else:  # whole units in hash order until batch_size turns are taken (at least one unit)
        cols = _UNITS[unit]
        ctes.append(("sample", f"""SELECT s.*, s.reward AS step_reward FROM steps s SEMI JOIN (
    SELECT {cols} FROM (
      SELECT {cols}, row_number() OVER w AS _k, sum(_n) OVER w AS _cum
      FROM (SELECT {cols}, count(*) AS _n FROM steps GROUP BY {cols})
      WINDOW w AS (ORDER BY hash({cols}, {int(seed)}), {cols} ROWS UNBOUNDED PRECEDING))
    WHERE _cum <= {int(batch_size)} OR _k = 1) u USING ({cols})"""))
    text = ", ".join([f"t.{c}" for c in TEXT_COLUMNS] + [f"r.{c}" for c in ROUND_COLUMNS])
    ctes.append(("batch_0", f"""SELECT b.*, {text}
  FROM sample b JOIN turns t ON t.run = b.run AND t.round = b.round AND t.game_id = b.game_id AND t.turn = b.turn
    JOIN rounds r ON r.run = b.run AND r.round = b.round
  WHERE t.run = {sql_str(run_name)} AND t.round IN ({rounds_sql})"""))
    _chain(ctes, "batch", sampling, "batch_0")
    return f"{_with(ctes)}\nSELECT * EXCLUDE (reward), reward AS advantage FROM batch\nORDER BY round, game_id, turn, pid"


def _history(upto: int, state: Optional[int]) -> str:
    """The rounds the final chain reads: all up to `upto`, or those after the stored state's."""
    return f"round <= {int(upto)}" if state is None else f"round > {int(state)} AND round <= {int(upto)}"


def _final(run_name: str, history: str, state: Optional[int], final: Sequence[Transform]) -> list[tuple[str, str]]:
    """The CTEs final_0 .. final: seats of the run's train games of the `history` rounds, through
    the final chain (stateful transforms starting from their state after round `state`)."""
    # All seats of train games: filtering is_learner here (a field of the unnested struct) makes
    # DuckDB's join below ~10x slower; learner rows are picked on the turns side instead.
    ctes = [("final_0", f"""SELECT run, round, game_id, env_id, seed, pid, role, model_uid, is_learner,
         reward AS env_reward, reward
  FROM seats
  WHERE run = {sql_str(run_name)} AND split = 'train' AND {history}""")]
    _chain(ctes, "final", final, "final_0", _states(run_name, state, final))
    return ctes


def _states(run_name: str, state: Optional[int], final: Sequence[Transform]) -> dict[int, tuple[str, str]]:
    """{position in the final chain: (CTE name, SQL) of its stored state} when starting from `state`."""
    if state is None:
        return {}
    return {i: (f"final_{i + 1}_state", state_cte(run_name, state, t, sig)) for i, t, sig in stateful(final)}


def state_query(run_name: str, upto: int, state: Optional[int], final: Sequence[Transform]) -> str:
    """The rows of `baselines` after round `upto` (columns: round, transform, is_learner, env_id,
    pid, games, b): the final chain of the batch query, over the same games, ended at each
    stateful transform's input by its `state_sql`."""
    ctes = _final(run_name, _history(upto, state), state, final)
    states = _states(run_name, state, final)
    parts = [f"SELECT {int(upto)} AS round, {sql_str(sig)} AS transform, * FROM ("
             f"{t.state_sql(f'final_{i}', states[i][0] if i in states else None)})"
             for i, t, sig in stateful(final)]
    return f"{_with(ctes)}\n" + "\nUNION ALL BY NAME\n".join(parts)


def state_rows(con: duckdb.DuckDBPyConnection, run_name: str, rounds: Sequence[int], final: Sequence[Transform]):
    """What a learner iteration over `rounds` commits to `baselines` (None: no stateful transform):
    the state after max(rounds), continued from the state its batches started from."""
    if not stateful(final):
        return None
    try:
        return con.sql(state_query(run_name, max(rounds), find_state(con, run_name, rounds, final), final)).to_arrow_table()
    except duckdb.Error as e:
        raise JobError(f"learn.final_transforms: the baselines query failed ({str(e).splitlines()[0]})") from None


def _chain(ctes: list[tuple[str, str]], name: str, transforms: Sequence[Transform], start: str,
           states: Optional[dict[int, tuple[str, str]]] = None) -> None:
    """Append one CTE per transform, each reading the previous, and `name` for the last;
    `states`: {position: (name, SQL)} of stored states a stateful transform starts from."""
    prev, states = start, states or {}
    for i, t in enumerate(transforms):
        if i in states and isinstance(t, RoleAdvantageFormatter):
            ctes.append(states[i])
            ctes.append((f"{name}_{i + 1}", t.sql(prev, states[i][0])))
        else:
            ctes.append((f"{name}_{i + 1}", t.sql(prev)))
        prev = f"{name}_{i + 1}"
    ctes.append((name, f"SELECT * FROM {prev}"))


def _with(ctes: list[tuple[str, str]]) -> str:
    # Inlined, not materialized: a materialized 1M-row CTE chain costs seconds (DuckDB 1.4+ materializes by default).
    return "WITH " + ",\n".join(f"{n} AS NOT MATERIALIZED (\n  {s}\n)" for n, s in ctes)


def transform_values(sampling: Sequence[Transform], batch, values: Sequence[float]) -> list[float]:
    """The sampling transforms over the batch's rows with `reward` = `values`; the values they
    return, in row order. For algorithms whose sampling transforms act on their own advantages
    (A2C's GAE): the same SQL as in the batch query, run on the in-memory batch."""
    if not sampling:
        return [float(v) for v in values]
    rows = batch.drop_columns([c for c in ("advantage", "reward", "_row") if c in batch.column_names])
    rows = rows.append_column("reward", pa.array(values, pa.float64())).append_column(
        "_row", pa.array(range(batch.num_rows), pa.int64()))
    con = duckdb.connect(":memory:")
    try:
        con.register("batch_0", rows)
        ctes: list[tuple[str, str]] = []
        _chain(ctes, "batch", sampling, "batch_0")
        out = con.sql(f"{_with(ctes)}\nSELECT reward FROM batch ORDER BY _row").fetchall()
    except duckdb.Error as e:
        raise JobError(f"learn.sampling_transforms: failed on the advantages ({str(e).splitlines()[0]})") from None
    finally:
        con.close()
    if len(out) != batch.num_rows:
        raise JobError(f"learn.sampling_transforms: returned {len(out)} rows for a batch of {batch.num_rows}; "
                       "sampling transforms must keep every row")
    return [r[0] for r in out]


def window_rounds(committed: Sequence[int], window: Union[str, int], trained: Optional[int] = None) -> list[int]:
    """The committed rounds a learner samples from: "latest" (the rounds after `trained`, the newest
    round the parent checkpoint trained on; the newest round alone when None), "all", or the last k."""
    rounds = sorted(committed)
    if not rounds:
        return []
    if window == "latest":
        return [r for r in rounds if r > trained] if trained is not None else rounds[-1:]
    if window == "all":
        return rounds
    if isinstance(window, int) and window > 0:
        return rounds[-window:]
    raise JobError(f"learn.window must be 'latest', 'all' or a positive integer, got {window!r}")


def run_batch_query(con: duckdb.DuckDBPyConnection, sql: str):
    """Run the composed query on a read-only lake connection; SQL mistakes become JobError."""
    check_select_only(con, sql, what="learner batch query")
    register_functions(con)
    try:
        table = con.sql(sql).to_arrow_table()
    except duckdb.Error as e:
        raise JobError(f"learn.*_transforms: the batch query failed ({str(e).splitlines()[0]})") from None
    missing = {"prompt", "completion", "advantage", "env_id", "game_id", "turn"} - set(table.column_names)
    if missing:
        raise JobError(f"learn.*_transforms: the batch lacks column(s) {', '.join(sorted(missing))}; "
                       "SQL transforms must keep every input column")
    return table
