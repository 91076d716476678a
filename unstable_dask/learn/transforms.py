"""Reward transforms: small objects that each render one SQL step (rewards.py composes them).

The three UnstableBaselines pipelines, each a list of small objects that render SQL:

  final     once per game and learner seat, in canonical game order (round, game_id):
            RoleAdvantageFormatter(tau), RoleAdvantageByEnvFormatter(tau), NoForfeitWins()
  step      once per turn, starting from the seat's transformed final reward:
            RewardForFormat(reward, penalty), PenaltyForInvalidMove(reward, penalty),
            StateRelativeAdvantage(weight) (over the window's turns: GiGPO's step-level term),
            ExpertMove(expert, reward, penalty) (a solver scores each move: taught, not RL alone)
  sampling  over the sampled batch only:
            NormalizeRewards(z_score), NormalizeRewardsByEnv(z_score), GroupRelativeAdvantage(by, scale)
            (A2C applies these to its GAE advantages instead: rewards.transform_values)

Every transform reads a relation and returns the same columns with `reward` rewritten. A job may
also give raw SQL: one SELECT over the relation named after its stage (`final`, `steps` or
`batch`), returning the same columns.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence, Union

import duckdb

from unstable_dask.errors import JobError
from unstable_dask.lake.read import check_select_only
from unstable_dask.learn.ema import RoleAdvantageByEnvFormatter, RoleAdvantageFormatter, sql_num
from unstable_dask.play.agents import expert_agrees, expert_move
from unstable_dask.play.experts import EXPERTS

STAGES = ("final", "step", "sampling")
_STAGE_REL = {"final": "final", "step": "steps", "sampling": "batch"}
_KEY = {"final": "learn.final_transforms", "step": "learn.step_transforms", "sampling": "learn.sampling_transforms"}


# ---------------------------------------------------------------- final: role advantage (EMA): ema.py


@dataclass(frozen=True)
class NoForfeitWins:
    """A win handed over by the opponent's forfeit scores 0, like a draw: the seat's env reward was
    positive but the game ended on another seat's invalid move. In mirror self-play most early
    "wins" are the other seat's forfeit, which says nothing about the winner's play. The forfeiting
    seat keeps its loss. List it first: it replaces the reward it is given. Not a default."""
    stage: ClassVar[str] = "final"

    def sql(self, src: str) -> str:
        return f"""SELECT f.* REPLACE (CASE WHEN f.env_reward > 0 AND coalesce(x.forfeit, false) THEN 0.0
                                      ELSE f.reward END AS reward)
  FROM {src} f LEFT JOIN (
    SELECT run, round, game_id, pid,
           NOT invalid_move AND bool_or(invalid_move) OVER (PARTITION BY run, round, game_id) AS forfeit
    FROM seats) x USING (run, round, game_id, pid)"""


# ---------------------------------------------------------------- step: format / invalid move

@dataclass(frozen=True)
class RewardForFormat:
    """r += reward when the turn's answer had the \\boxed{} format, else r += penalty."""
    reward: float
    penalty: float = 0.0
    stage: ClassVar[str] = "step"

    def sql(self, src: str) -> str:
        return (f"SELECT * REPLACE (reward + CASE WHEN coalesce(format_ok, false) THEN {sql_num(self.reward)} "
                f"ELSE {sql_num(self.penalty)} END AS reward) FROM {src}")


@dataclass(frozen=True)
class PenaltyForInvalidMove:
    """r += penalty when the turn was an invalid move, else r += reward."""
    reward: float
    penalty: float
    stage: ClassVar[str] = "step"

    def sql(self, src: str) -> str:
        return (f"SELECT * REPLACE (reward + CASE WHEN coalesce(invalid_move, false) THEN {sql_num(self.penalty)} "
                f"ELSE {sql_num(self.reward)} END AS reward) FROM {src}")


@dataclass(frozen=True)
class StateRelativeAdvantage:
    """GiGPO's step-level advantage (Feng et al. 2025, arXiv 2505.10978, mean-only form):
    r += weight * (r - mu_s), mu_s the mean r over the window's learner turns with the same prompt
    (the same state, as the model saw it), for states seen in two or more turns; a state seen once
    has no baseline and keeps r. With the game's reward at its end and no discount, a turn's r is
    its game's return (plus the step shaping before it), so each move is credited against the
    other moves made from its state: credit per decision without a learned critic (A2C's V).
    Computed over every learner turn of the window, not the sampled batch, where a state would
    rarely appear twice. List it last among the step transforms: it reads the shaped r."""
    weight: float = 1.0
    stage: ClassVar[str] = "step"

    def sql(self, src: str) -> str:
        # A state seen once is its own mean: its r stays as it was.
        return f"""SELECT * EXCLUDE (_state) REPLACE (reward + {sql_num(self.weight)} * (reward - avg(reward)
                                   OVER (PARTITION BY _state)) AS reward)
  FROM (SELECT s.*, hash(t.prompt) AS _state FROM {src} s JOIN turns t
        ON t.run = s.run AND t.round = s.round AND t.game_id = s.game_id AND t.turn = s.turn AND t.pid = s.pid
        WHERE t.split = 'train' AND t.is_learner AND t.round IN (SELECT DISTINCT round FROM {src}))"""


# The SQL names of play.agents' expert functions, registered on each connection a batch or
# selection query runs on: expert_agrees(expert, env_id, observation, action) -> BOOLEAN for the
# transforms, expert_action(expert, env_id, observation) -> VARCHAR for learn.select (relabelling).
EXPERT_AGREES = "expert_agrees"
EXPERT_ACTION = "expert_action"


def register_functions(con: duckdb.DuckDBPyConnection) -> None:
    """The Python functions the transforms' and learn.select's SQL calls, on `con` (once per connection)."""
    known = {r[0] for r in con.execute("SELECT function_name FROM duckdb_functions() WHERE function_name IN (?, ?)",
                                       [EXPERT_AGREES, EXPERT_ACTION]).fetchall()}
    if EXPERT_AGREES not in known:
        con.create_function(EXPERT_AGREES, expert_agrees, ["VARCHAR"] * 4, "BOOLEAN")
    if EXPERT_ACTION not in known:
        con.create_function(EXPERT_ACTION, expert_move, ["VARCHAR"] * 3, "VARCHAR")


@dataclass(frozen=True)
class ExpertMove:
    """On-policy distillation from a solver: r += reward when the turn's move is one of the expert's
    best moves in its state (play/experts.py: 'minimax' for TicTacToe, 'kuhn-best' for Kuhn Poker),
    else r += penalty (an invalid move is not the expert's). The model plays its own games; the
    expert only scores each move, so every decision is credited by its own state, which the game's
    end reward does only through many games. A run using it is taught (like SFT, though the learner
    never sees the expert's moves), not RL from the game's reward alone: say so with its results.
    The job is checked at load: the expert has a solver for every train game."""
    expert: str = "minimax"
    reward: float = 1.0
    penalty: float = 0.0
    stage: ClassVar[str] = "step"

    def __post_init__(self) -> None:
        if self.expert not in EXPERTS:  # also keeps the name safe to quote into the SQL below
            raise ValueError(f"expert must be one of {', '.join(EXPERTS)}, got {self.expert!r}")

    def sql(self, src: str) -> str:
        return f"""SELECT s.* REPLACE (s.reward + CASE WHEN {EXPERT_AGREES}('{self.expert}', t.env_id, t.observation, t.action)
                                      THEN {sql_num(self.reward)} ELSE {sql_num(self.penalty)} END AS reward)
  FROM {src} s JOIN turns t
    ON t.run = s.run AND t.round = s.round AND t.game_id = s.game_id AND t.turn = s.turn AND t.pid = s.pid"""


# ---------------------------------------------------------------- sampling: over the batch

# The z-scores' epsilon: A = (r - mu) / (sd + Z_EPS) (UnstableBaselines', verl's and TRL's 1e-8).
Z_EPS = 1e-8


def _normalize(src: str, partition: str, z_score: bool) -> str:
    over = f"OVER (PARTITION BY {partition})" if partition else "OVER ()"
    expr = f"reward - avg(reward) {over}"
    if z_score:  # population std, like np.std; + 1e-8 outside the std (UB's precedence bug fixed)
        expr = f"({expr}) / (stddev_pop(reward) {over} + {Z_EPS})"
    return f"SELECT * REPLACE ({expr} AS reward) FROM {src}"


@dataclass(frozen=True)
class NormalizeRewards:
    """r - mean(batch), or (r - mean) / (std + 1e-8) with z_score."""
    z_score: bool = False
    stage: ClassVar[str] = "sampling"

    def sql(self, src: str) -> str:
        return _normalize(src, "", self.z_score)


@dataclass(frozen=True)
class NormalizeRewardsByEnv:
    """NormalizeRewards inside each env_id of the batch."""
    z_score: bool = False
    stage: ClassVar[str] = "sampling"

    def sql(self, src: str) -> str:
        return _normalize(src, "env_id", self.z_score)


@dataclass(frozen=True)
class GroupRelativeAdvantage:
    """GRPO: the reward relative to its group of the batch.

    by="group" (default): a group is (group_id, pid), the G attempts of one seat of one start
    state (round.group_size); every attempt (game) weighs the same however many turns it took:
    w = 1/n_turns of the attempt, n = the attempts (distinct games), mu = sum w r / sum w and

      scale="group"  A = (r - mu) / (sd + 1e-8),  sd = sqrt(sum w (r - mu)^2 / (n - 1))   (GRPO)
      scale="batch"  the same with sd of the whole batch's rewards (TRL's scale_rewards="batch")
      scale="none"   A = r - mu                                       (Dr. GRPO, verl's
                                                                        norm_adv_by_std_in_grpo=False)

    sd is the unbiased std over attempts, as verl and TRL take it (torch.std); with outcome rewards
    only these are textbook GRPO over the G outcomes. A group of one attempt has no baseline: A = 0.
    by="prompt": turns with the same prompt text, each turn weighing the same (population z-score).
    """
    by: str = "group"
    scale: str = "group"
    stage: ClassVar[str] = "sampling"

    def __post_init__(self) -> None:
        if self.by not in ("group", "prompt"):
            raise ValueError(f"by must be 'group' or 'prompt', got {self.by!r}")
        if self.scale not in ("group", "batch", "none"):
            raise ValueError(f"scale must be 'group', 'batch' or 'none', got {self.scale!r}")

    def sql(self, src: str) -> str:
        if self.by == "prompt":
            return _normalize(src, "prompt", True)
        g = "OVER (PARTITION BY group_id, pid)"
        var = {"group": f"sum(_w * (reward - _mu) * (reward - _mu)) {g} / (_n - 1)",
               "batch": "sum(_w * (reward - _bmu) * (reward - _bmu)) OVER () / (_bn - 1)"}
        scaled = "reward - _mu" if self.scale == "none" else f"(reward - _mu) / (sqrt(greatest({var[self.scale]}, 0)) + {Z_EPS})"
        # The attempts are counted as distinct games, not as sum(_w): 9 x (1/9) sums to 1.0000000000000002,
        # and a one-attempt group would be taken for several.
        return f"""SELECT * EXCLUDE (_w, _mu, _bmu, _n, _bn) REPLACE (CASE WHEN _n > 1 THEN {scaled} ELSE 0.0 END AS reward)
  FROM (SELECT *, sum(_w * reward) {g} / sum(_w) {g} AS _mu, sum(_w * reward) OVER () / sum(_w) OVER () AS _bmu,
               count(DISTINCT (round, game_id)) {g} AS _n,
               count(DISTINCT (group_id, pid, round, game_id)) OVER () AS _bn
        FROM (SELECT *, 1.0 / count(*) OVER (PARTITION BY group_id, pid, round, game_id) AS _w FROM {src}))"""


BUILTINS = {c.__name__: c for c in (RoleAdvantageFormatter, RoleAdvantageByEnvFormatter, NoForfeitWins,
                                    RewardForFormat, PenaltyForInvalidMove, StateRelativeAdvantage, ExpertMove,
                                    NormalizeRewards, NormalizeRewardsByEnv, GroupRelativeAdvantage)}


@dataclass(frozen=True)
class RawSQL:
    """A user's SELECT over the stage's relation (`final`, `steps` or `batch`)."""
    query: str
    stage: str

    def sql(self, src: str) -> str:
        # The user's query sees its stage name bound to the previous step of the pipeline.
        return f"WITH {_STAGE_REL[self.stage]} AS (SELECT * FROM {src}) SELECT * FROM ({self.query})"


Transform = Union[RoleAdvantageFormatter, NoForfeitWins, RewardForFormat, PenaltyForInvalidMove, StateRelativeAdvantage,
                  ExpertMove, NormalizeRewards, NormalizeRewardsByEnv, GroupRelativeAdvantage, RawSQL]

_SQL_START = re.compile(r"^\s*(\(\s*)*(select|with|from|values)\b", re.IGNORECASE)


def parse_transform(text: str, stage: str, con: Optional[duckdb.DuckDBPyConnection] = None) -> Transform:
    """`"RewardForFormat(1.5)"` -> RewardForFormat(reward=1.5); SQL text -> RawSQL. Never evals."""
    key = _KEY[stage]
    if _SQL_START.match(text):
        own = con is None
        con = con or duckdb.connect(":memory:")
        try:
            check_select_only(con, text, what=f"{key} SQL")
            if len(con.extract_statements(text)) != 1:
                raise JobError(f"{key}: SQL transform must be exactly one SELECT statement")
        finally:
            if own:
                con.close()
        return RawSQL(text.strip().rstrip(";"), stage)
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise JobError(f"{key}: {text!r} is neither a transform like 'RewardForFormat(1.5)' nor a SELECT") from None
    if isinstance(node, ast.Name):  # a bare name means default arguments
        node = ast.Call(func=node, args=[], keywords=[])
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BUILTINS):
        raise JobError(f"{key}: {text!r} is not a known transform; expected one of {', '.join(BUILTINS)} or a SELECT")
    cls = BUILTINS[node.func.id]
    if cls.stage != stage:
        raise JobError(f"{key}: {node.func.id} is a {cls.stage} transform and belongs in {_KEY[cls.stage]}")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
        return cls(*args, **kwargs)
    except (ValueError, TypeError) as e:
        raise JobError(f"{key}: bad arguments in {text!r} ({e})") from None


def parse_transforms(texts: Sequence[str], stage: str,
                     con: Optional[duckdb.DuckDBPyConnection] = None) -> list[Transform]:
    return [parse_transform(t, stage, con) for t in texts]
