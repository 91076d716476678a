"""Who sits in a seat: the kinds of players, the one place where a name becomes one, and how the
non-learner train seats are sampled (the job's opponent strategy).

The names a job may give an opponent (`round.opponents.fixed`, an env's `opponents`):

  "random"      RandomAgent   a legal move drawn from the observation (agents.py); no model
  "minimax", "kuhn-best", "<expert>@<eps>"
                ExpertAgent   an exact solver's move (experts.py), a random legal one with probability eps
  "base"        Checkpoint    the engine's base model, no adapter
  "ckpt-<k>"    Checkpoint    a committed checkpoint of the run: its LoRA adapter
  a folder      AdapterDir    a peft adapter folder (model_uid: the folder's name)
  an endpoint   Endpoint      a name of the job's [endpoints] (model_uid: its model id)

Each kind makes the `Seat` a task plays: `plays` says which machinery moves for it (an agent
function of agents.py, the worker's engine with `source` as the adapter, or an endpoint), so a
task never looks at names. Adding a kind is one class here and its line in `parse` (and, for a
new reserved name, one line in config/base.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import numpy as np
import trueskill

from unstable_dask.config import BASE_UID, EXPERT_UIDS, RANDOM_UID, Job
from unstable_dask.errors import JobError
from unstable_dask.lake import Lake
from unstable_dask.skill import inherited, make_env


@dataclass(frozen=True)
class Seat:
    pid: int
    model_uid: str  # the name the lake records for this seat
    is_learner: bool  # played by the checkpoint this round trains / evaluates
    plays: Literal["agent", "engine", "endpoint"]  # what makes its moves (play/task.py)
    source: Optional[str] = None  # agent: its name; engine: the adapter's location (None: base); endpoint: its name
    base: Optional[str] = None  # engine seats: their base model when it is not the job's [model].base


@dataclass(frozen=True)
class RandomAgent:
    model_uid: str = RANDOM_UID

    def seat(self, pid: int, is_learner: bool = False) -> Seat:
        return Seat(pid, self.model_uid, is_learner, "agent", "random")


@dataclass(frozen=True)
class ExpertAgent:
    name: str  # as the job names it, eps included: also its model_uid

    @property
    def model_uid(self) -> str:
        return self.name

    def seat(self, pid: int, is_learner: bool = False) -> Seat:
        return Seat(pid, self.name, is_learner, "agent", self.name)


@dataclass(frozen=True)
class Checkpoint:
    uid: str
    adapter: Optional[str]  # location (local path or URI); None for the base model
    iteration: int
    parent_uid: Optional[str] = None  # the checkpoint it was trained from (None for the base model)
    base: Optional[str] = None  # its base model when it is not the job's [model].base (another run's)

    @property
    def model_uid(self) -> str:
        return self.uid

    def seat(self, pid: int, is_learner: bool = False) -> Seat:
        return Seat(pid, self.uid, is_learner, "engine", self.adapter, self.base)


@dataclass(frozen=True)
class AdapterDir:
    path: str

    @property
    def model_uid(self) -> str:
        return Path(self.path).name

    def seat(self, pid: int, is_learner: bool = False) -> Seat:
        return Seat(pid, self.model_uid, is_learner, "engine", str(Path(self.path).resolve()))


@dataclass(frozen=True)
class Endpoint:
    name: str  # the job's [endpoints.<name>]
    model: str  # the served model id: its model_uid in the lake

    @property
    def model_uid(self) -> str:
        return self.model

    def seat(self, pid: int, is_learner: bool = False) -> Seat:
        return Seat(pid, self.model, is_learner, "endpoint", self.name)


Opponent = Union[RandomAgent, ExpertAgent, Checkpoint, AdapterDir, Endpoint]
BASE = Checkpoint(BASE_UID, None, 0)


def list_checkpoints(lake: Lake, run_name: str) -> list[Checkpoint]:
    """The base model followed by the run's committed checkpoints, oldest first."""
    rows = lake.table("checkpoints").rows(run_name, order_by="iteration")
    return [BASE] + [Checkpoint(r["uid"], lake.location(r["adapter_path"]) if r["adapter_path"] else None,
                                r["iteration"], r["parent_uid"]) for r in rows]


def parse(job: Job, name: str, checkpoints: dict[str, Checkpoint], key: str) -> Opponent:
    """The opponent a name stands for (checkpoints: the run's, by uid, the base model included)."""
    if name == RANDOM_UID:
        return RandomAgent()
    if name.partition("@")[0] in EXPERT_UIDS:  # its eps and games were checked when the job loaded
        return ExpertAgent(name)
    if name in job.endpoints:
        return Endpoint(name, job.endpoints[name].model)
    if name in checkpoints:
        return checkpoints[name]
    if (Path(name) / "adapter_config.json").is_file():
        return AdapterDir(name)
    raise JobError(job.opponent_error(key, name))


# ---------------------------------------------------------------- sampling the train opponents

# Per train game and opponent model: did the learner's best seat score above that opponent's best
# seat? Mirror seats (the learner's own uid) and games with a missing reward say nothing.
_OUTCOMES_SQL = """
WITH s AS (SELECT round, game_id, model_uid, is_learner, reward FROM seats WHERE run = ? AND split = 'train'),
     l AS (SELECT round, game_id, any_value(model_uid) AS uid, max(reward) AS r FROM s WHERE is_learner GROUP BY ALL),
     o AS (SELECT round, game_id, model_uid AS uid, max(reward) AS r FROM s WHERE NOT is_learner GROUP BY ALL)
SELECT o.round, o.uid AS opponent, l.r > o.r AS win
FROM o JOIN l USING (round, game_id)
WHERE o.uid <> l.uid AND l.r IS NOT NULL AND o.r IS NOT NULL
ORDER BY o.round, o.game_id, o.uid"""


def win_rate_opponent(job: Job, lake: Lake, current: str) -> str:
    """The opponent of UnstableBaselines' win-rate gate for the next round, replayed from the lake.

    The gate holds one opponent, a snapshot of the learner: the checkpoint that played the run's
    first round. Before each round, if the learner won more than `win_rate_threshold` of its last
    `win_rate_games` train games against the held opponent (all of them played since it was taken;
    a draw is not a win, mirror games do not count), the gate takes the checkpoint about to play
    instead, and counting starts again. A pure function of the committed rounds.
    """
    cfg, run_name = job.round.opponents, job.run.name
    rounds = lake.sql("SELECT round, checkpoint_uid FROM rounds WHERE run = ? ORDER BY round", [run_name]).to_pylist()
    games = lake.sql(_OUTCOMES_SQL, [run_name]).to_pylist()
    n = cfg.win_rate_games

    def passed(wins: deque) -> bool:
        return len(wins) == n and sum(wins) / n > cfg.win_rate_threshold

    held: Optional[str] = None
    wins: deque = deque(maxlen=n)  # outcomes against `held` since it was taken, newest last
    i = 0
    for r in rounds:
        if held is None or passed(wins):
            held, wins = r["checkpoint_uid"], deque(maxlen=n)
        while i < len(games) and games[i]["round"] <= r["round"]:
            if games[i]["opponent"] == held:
                wins.append(bool(games[i]["win"]))
            i += 1
    return current if held is None or passed(wins) else held


def _ratings_overall(lake: Lake, run_name: str) -> dict[str, tuple[float, float]]:
    rows = lake.sql("SELECT model_uid, mu, sigma FROM ratings WHERE run = ? AND env_id = '*'", [run_name]).to_pylist()
    return {r["model_uid"]: (r["mu"], r["sigma"]) for r in rows}


class OpponentPool:
    """The opponents of one round: names resolved, and sampled with the job's strategy."""

    def __init__(self, job: Job, lake: Lake, current: Checkpoint, checkpoints: list[Checkpoint]):
        self.job, self.current = job, current
        self.by_uid = {c.uid: c for c in checkpoints}
        self.parent = {c.uid: c.parent_uid for c in checkpoints}
        self.lagged = [c for c in checkpoints if c.iteration < current.iteration][-job.round.opponents.lag:]
        strategy = job.round.opponents.strategy
        self.ratings = _ratings_overall(lake, job.run.name) if strategy == "match-quality" else {}
        self.gated = win_rate_opponent(job, lake, current.uid) if strategy == "win-rate" else None
        for key, name in job.named_opponents():  # a checkpoint the run lacks fails here, not when first drawn
            parse(job, name, self.by_uid, key)

    def seat(self, name: str, pid: int, key: str) -> Seat:
        return parse(self.job, name, self.by_uid, key).seat(pid)

    def candidates(self) -> list[str]:
        strategy = self.job.round.opponents.strategy
        if strategy == "mirror":
            return [self.current.uid]
        if strategy == "fixed":
            return list(self.job.round.opponents.fixed)
        if strategy == "lagged":
            return [c.uid for c in self.lagged] or [self.current.uid]
        if strategy == "win-rate":
            return [self.gated or self.current.uid]
        # match-quality: anyone but the checkpoint itself (mirror games move no rating)
        names = list(dict.fromkeys([*self.by_uid, *self.job.round.opponents.fixed]))
        return [n for n in names if n != self.current.uid] or [self.current.uid]

    def rating(self, uid: str) -> tuple[float, float]:
        """(mu, sigma) of a model in the overall track: the rate job's, or, for a model that has not
        played yet (the newest checkpoint), the prior the rate job will give it."""
        if uid in self.ratings:
            return self.ratings[uid]
        r = self.job.ratings
        return inherited(uid, self.parent.get, self.ratings.get, r.mu, r.sigma, r.inherit_sigma_factor)

    def weights(self, names: list[str]) -> np.ndarray:
        """TrueSkill match quality with the current checkpoint for match-quality; else uniform."""
        if self.job.round.opponents.strategy != "match-quality":
            return np.full(len(names), 1.0 / len(names))
        env = make_env(self.job.ratings)
        me = env.create_rating(*self.rating(self.current.uid))
        # An endpoint is rated under its model id, not under the name the job gives it.
        uids = [self.job.endpoints[n].model if n in self.job.endpoints else n for n in names]
        w = np.array([trueskill.quality_1vs1(me, env.create_rating(*self.rating(u)), env=env) for u in uids])
        return w / w.sum() if w.sum() > 0 else np.full(len(names), 1.0 / len(names))
