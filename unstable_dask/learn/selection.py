"""The batch of an algorithm that trains on selected turns (Spec.rows = "selected": SFT): the job's
one SELECT over `turns`, sampled as the learner samples, and rendered as the learner would play them.

The query: `turns` is bound to the run's turns of the iteration's rounds (every split and seat:
the job's SELECT, `learn.select`, picks), and up to batch_size of its rows are drawn by
ORDER BY hash(round, game_id, turn, pid, seed) (no random(): a batch is a function of lake, SQL and
seed), returned in (round, game_id, turn, pid) order. The default picks the turns of expert seats
(config.EXPERT_UIDS, their exact form, not `<expert>@<eps>`) outside eval games. The SELECT may call
expert_action(expert, env_id, observation), the expert's move in that state (play.agents.expert_move),
to relabel turns it did not play: the learner's own, for DAgger.

Rendering: the prompt is the row's observation in the learner's template for its env (the env's
`template` in round.*_envs, else model.template; the `chat` ones through the tokenizer's chat
template, as the engine renders them); the target is the action as that template asks for it
(prompts.render_action); both tokenized as the engine would (tokens.rendered_ids).
"""
from __future__ import annotations

from typing import Any, Sequence

import duckdb
import pyarrow as pa

from unstable_dask.config import EXPERT_UIDS, Job
from unstable_dask.errors import JobError
from unstable_dask.lake.read import check_select_only, sql_str
from unstable_dask.learn.transforms import register_functions
from unstable_dask.play.prompts import render_action, render_prompt

DEFAULT_SELECT = (f"SELECT * FROM turns WHERE model_uid IN ({', '.join(sql_str(e) for e in EXPERT_UIDS)}) "
                  "AND split <> 'eval' AND NOT coalesce(invalid_move, false)")
REQUIRED = ("round", "game_id", "turn", "pid", "env_id", "observation", "action")
_KEY = "learn.select"


def selection_query(run_name: str, rounds: Sequence[int], select: str, batch_size: int, seed: int) -> str:
    """The ONE query returning a batch of selected turns of `rounds`."""
    if not rounds:
        raise ValueError("empty window")
    rounds_sql = ", ".join(str(int(r)) for r in sorted(rounds))
    return f"""WITH turns AS NOT MATERIALIZED (
  SELECT * FROM main.turns WHERE run = {sql_str(run_name)} AND round IN ({rounds_sql})
),
selected AS NOT MATERIALIZED (
  {select.strip().rstrip(';')}
),
sample AS NOT MATERIALIZED (
  SELECT * FROM selected ORDER BY hash(round, game_id, turn, pid, {int(seed)}), round, game_id, turn, pid
  LIMIT {int(batch_size)}
)
SELECT * FROM sample ORDER BY round, game_id, turn, pid"""


def check_select(con: duckdb.DuckDBPyConnection, select: str) -> None:
    """`learn.select` is one SELECT statement (the query composes it as a CTE)."""
    check_select_only(con, select, what=_KEY)
    if len(con.extract_statements(select)) != 1:
        raise JobError(f"{_KEY}: must be exactly one SELECT statement")


def run_selection(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    """Run a selection query (read-only lake connection); a SQL mistake, a missing column or a row
    with nothing to render becomes JobError."""
    check_select_only(con, sql, what=f"{_KEY} query")
    register_functions(con)
    try:
        table = con.sql(sql).to_arrow_table()
    except duckdb.Error as e:
        raise JobError(f"{_KEY}: the query failed ({str(e).splitlines()[0]})") from None
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise JobError(f"{_KEY}: the selected rows lack column(s) {', '.join(missing)}; select whole turns "
                       "(SELECT * FROM turns WHERE ...)")
    for r in table.select(list(REQUIRED)).to_pylist():
        if r["observation"] is None or r["action"] is None:
            raise JobError(f"{_KEY}: turn {r['turn']} of game {r['game_id']} (round {r['round']}) has no "
                           f"{'observation' if r['observation'] is None else 'action'} to train on")
    return table


def learner_template(job: Job, env_id: str) -> str:
    """The template the learner plays `env_id` with: its env's own in round.*_envs, else model.template."""
    for spec in [*job.round.train_envs, *job.round.eval_envs]:
        if spec.env_id == env_id and spec.template is not None:
            return spec.template
    return job.model.template


def texts(job: Job, table: pa.Table, tokenizer: Any) -> tuple[list[str], list[str]]:
    """(prompt, target) text of each selected row, in the learner's template for its env."""
    from unstable_dask.inference.engine import chat_prompt
    prompts, targets = [], []
    for env_id, obs, action in zip(*(table.column(c).to_pylist() for c in ("env_id", "observation", "action"))):
        template = learner_template(job, env_id)
        prompts.append(render_prompt(template, obs, lambda text: chat_prompt(tokenizer, text)))
        targets.append(render_action(template, action))
    return prompts, targets


def token_ids(job: Job, table: pa.Table, tokenizer: Any) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, target ids) of the selected rows, as the engine would have fed and generated them."""
    from unstable_dask.inference.engine import prompt_budget
    from unstable_dask.learn.tokens import rendered_ids
    prompts, targets = texts(job, table, tokenizer)
    return rendered_ids(tokenizer, prompts, targets, prompt_budget(job.model), job.model.stop)
