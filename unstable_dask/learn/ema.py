"""The role-advantage EMA (UnstableBaselines' RoleAdvantageFormatter) and its state in the lake.

The EMA needs every past train game of the run: b <- (1-tau) b + tau r per key over games in
(round, game_id) order, from b0 = 0. Scanning the whole history every update makes the batch
query linear in the run's length, so each learner iteration also commits, with its checkpoint,
the EMA's state after the newest round of its window (table `baselines`: per transform and key,
the games seen and b). The next batch query starts each key at the b of the newest state row set
at a round s < min(window) and scans only the rounds after s.

The state is a cache of a pure function of committed games: b after the train games of rounds
<= round. It stays valid because a round's number is claimed after every older round of the run
was published, finished or given up (play/round.py finishes claims first), and a rollback retires
the rounds it drops together with the learner iterations (and their `baselines` rows) that saw
them. Every transform before a stateful one feeds its input rewards, so a state is keyed by the
canonical text of the final chain up to and including it (`signature`): another tau, another
transform before it, or a user's SQL edited by one character never reuses a state. User SQL in
`learn.final_transforms` before a role advantage must therefore be per game (most are: they
rewrite a seat's reward from its own game); one that mixes games across rounds would see only
the rounds after the state, as it sees only rounds up to the window today.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import duckdb

from unstable_dask.lake.read import sql_str


def sql_num(x: float) -> str:
    """A float as an exact SQL DOUBLE literal (repr round-trips)."""
    return f"CAST({float(x)!r} AS DOUBLE)"


@dataclass(frozen=True)
class RoleAdvantageFormatter:
    """A = r - b with b <- (1-tau) b + tau r per pid over games in (round, game_id) order, b0 = 0.

    The baseline of learner seats is fed by learner seats only (opponents get separate EMAs).

    The EMA is a linear recurrence, b_n = tau * sum_k (1-tau)^(n-k) r_k, so it is a windowed sum.
    Weights (1-tau)^-k overflow for long histories, so rows are cut into blocks of K where
    (1-tau)^K < 1e-18: inside a block the weights stay below 1e18, and a block only needs the
    previous block's last b (anything older has decayed below double precision). The first
    block's previous b is the key's stored b when the scan starts from a state (`state`: a
    relation of keys, b, games), else 0: b_n = tau q^i cs + q^(i+1) prev, q = 1 - tau.
    """
    tau: float = 0.001
    stage: ClassVar[str] = "final"
    keys: ClassVar[str] = "is_learner, pid"  # `final` holds opponents' seats too; they get their own EMA

    def __post_init__(self) -> None:
        if not 0.0 < self.tau < 1.0:
            raise ValueError(f"tau must be in (0, 1), got {self.tau}")

    def sql(self, src: str, state: Optional[str] = None) -> str:
        return f"SELECT * EXCLUDE (_b, _g0) REPLACE (reward - _b AS reward) FROM ({self._ema(src, state)})"

    def state_sql(self, src: str, state: Optional[str] = None) -> str:
        """One row per key (is_learner, env_id (NULL unless by env), pid, games, b): the EMA after
        the key's last game of `src`, started from `state`; keys of `state` without a game in `src`
        keep their row."""
        keys = self.keys
        env = "" if "env_id" in keys else "CAST(NULL AS VARCHAR) AS env_id, "
        new = f"""SELECT {keys}, {env}count(*) + coalesce(any_value(_g0), 0) AS games, arg_max(_b, _n) AS b
  FROM ({self._ema(src, state, keep_n=True)}) GROUP BY {keys}"""
        if state is None:
            return new
        on = " AND ".join(f"o.{k} = n.{k}" for k in keys.split(", "))
        old = f"SELECT {', '.join(f'o.{k}' for k in keys.split(', '))}, {env}o.games, o.b FROM {state} o"
        return f"{new}\n  UNION ALL BY NAME\n  {old} WHERE NOT EXISTS (SELECT 1 FROM {src} n WHERE {on})"

    def _ema(self, src: str, state: Optional[str], keep_n: bool = False) -> str:
        """`src` plus _b, the key's baseline updated by the row's game, and _g0, the games before `src`."""
        q, tau, keys = 1.0 - self.tau, self.tau, self.keys
        block = max(1, math.ceil(18 * math.log(10) / -math.log(q)))
        b_end = f"{sql_num(tau)} * pow({sql_num(q)}, _i) * _cs"
        if state is None:
            start = f"SELECT *, CAST(0 AS DOUBLE) AS _b0, CAST(0 AS BIGINT) AS _g0 FROM {src}"
        else:
            on = " AND ".join(f"s.{k} = o.{k}" for k in keys.split(", "))
            start = (f"SELECT s.*, coalesce(o.b, 0) AS _b0, coalesce(o.games, 0) AS _g0 "
                     f"FROM {src} s LEFT JOIN {state} o ON {on}")
        drop = "_i, _j, _cs, _prev, _b0" if keep_n else "_n, _i, _j, _cs, _prev, _b0"
        return f"""SELECT * EXCLUDE ({drop}), {b_end} + pow({sql_num(q)}, _i + 1) * coalesce(_prev, _b0) AS _b
  FROM (SELECT *, last_value(CASE WHEN _i = {block - 1} THEN {b_end} END IGNORE NULLS)
                    OVER (PARTITION BY {keys} ORDER BY _n ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS _prev
        FROM (SELECT *, sum(reward * pow({sql_num(q)}, -_i))
                          OVER (PARTITION BY {keys}, _j ORDER BY _n ROWS UNBOUNDED PRECEDING) AS _cs
              FROM (SELECT *, _n % {block} AS _i, _n // {block} AS _j
                    FROM (SELECT *, row_number() OVER (PARTITION BY {keys} ORDER BY round, game_id) - 1 AS _n
                          FROM ({start})))))"""


@dataclass(frozen=True)
class RoleAdvantageByEnvFormatter(RoleAdvantageFormatter):
    """RoleAdvantageFormatter with one baseline per (env_id, pid)."""
    keys: ClassVar[str] = "is_learner, env_id, pid"


def stateful(final: Sequence) -> list[tuple[int, RoleAdvantageFormatter, str]]:
    """(position, transform, signature) of each transform of the final chain that keeps a state in the lake."""
    return [(i, t, signature(final, i)) for i, t in enumerate(final) if isinstance(t, RoleAdvantageFormatter)]


def signature(final: Sequence, i: int) -> str:
    """What a state of final[i] is a function of, besides the games: the canonical text of the
    chain up to and including it (dataclass reprs: exact floats, user SQL verbatim)."""
    return json.dumps([repr(t) for t in final[: i + 1]])


def state_cte(run_name: str, state_round: int, t: RoleAdvantageFormatter, sig: str) -> str:
    """The stored state of `t` (keys, b, games) after round `state_round`. Read inside the batch
    query, so `--show-sql` shows where every b0 comes from (the design's invariant that a learner
    batch is a pure function of lake, SQL and seed, and `--show-sql` prints the exact query). Two iterations that
    wrote the same round's state wrote the same function of the lake: the newer's rows are taken."""
    return f"""SELECT {t.keys}, b, games FROM baselines
  WHERE run = {sql_str(run_name)} AND round = {int(state_round)} AND transform = {sql_str(sig)}
  QUALIFY row_number() OVER (PARTITION BY {t.keys} ORDER BY iteration DESC) = 1"""


def find_state(con: duckdb.DuckDBPyConnection, run_name: str, rounds: Sequence[int], final: Sequence) -> Optional[int]:
    """The newest round s < min(rounds) with a stored state of every stateful transform of the
    final chain, or None (a full scan: no stateful transform, an old lake, the first iteration,
    window "all", another tau or chain). Chosen here, from the same snapshot as the batch, and
    written into the query as a literal: the history's round bound must be a constant for DuckDB
    to prune the files of older rounds (a bound from a subquery reads them all)."""
    sigs = [sig for _, _, sig in stateful(final)]
    if not sigs or not rounds:
        return None
    row = con.execute(f"""SELECT max(round) FROM (
        SELECT round FROM baselines WHERE run = ? AND round < ? AND transform IN ({', '.join('?' * len(sigs))})
        GROUP BY round HAVING count(DISTINCT transform) = ?)""", [run_name, min(rounds), *sigs, len(sigs)]).fetchall()
    return None if row[0][0] is None else int(row[0][0])
