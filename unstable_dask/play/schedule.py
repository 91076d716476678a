"""What a round plays: games (env, seed, who sits where) split into tasks. Pure and deterministic.

Train games come in groups of `round.group_size`: one draw of env, seed, seating and opponents,
played that many times as distinct games (the G exchangeable attempts GRPO compares). Game ids,
group ids and seeds come from (run seed, round, split, index), so a re-run of a round schedules
the same games and every task writes the same file names.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import textarena as ta
import trueskill

from unstable_dask.lake import core as lk
from unstable_dask.lake import storage as st
from unstable_dask.config import BASE_UID, RANDOM_UID, EnvSpec, Job
from unstable_dask.errors import JobError
from unstable_dask.jobfile import opponent_error
from unstable_dask.rate.duels import inherited, make_env


@dataclass(frozen=True)
class Seat:
    pid: int
    model_uid: str
    adapter: Optional[str]  # LoRA adapter dir; None for the base model, the random agent and endpoints
    is_learner: bool
    endpoint: Optional[str] = None  # name of the job's [endpoints.<name>] that plays this seat

    @property
    def is_random(self) -> bool:
        return self.model_uid == RANDOM_UID


@dataclass(frozen=True)
class GameSpec:
    game_id: str
    split: str  # train | eval
    env_id: str
    seed: int  # the env seed: one per group, so a group's games start from the same state
    group_id: str  # <run>-r<round>-<split>-g<index>: games of one start state (eval: one game each)
    template: str
    seats: tuple[Seat, ...]


@dataclass(frozen=True)
class TaskSpec:
    key: str  # task-0003: fixed by the schedule
    run: str
    round: int
    games: tuple[GameSpec, ...]
    attempt: str = "0"  # the driver attempt playing it; the commit marker names the winning one

    @property
    def file_key(self) -> str:
        """Name of this task's games/turns files: a retry within an attempt replaces them."""
        return f"{self.key}.{self.attempt}"


@dataclass(frozen=True)
class Checkpoint:
    uid: str
    adapter: Optional[str]  # absolute path or URI, None for the base model
    iteration: int
    parent_uid: Optional[str] = None  # the checkpoint it was trained from (None for the base model)


def list_checkpoints(lake: str, run: str) -> list[Checkpoint]:
    """The base model followed by the run's committed checkpoints, oldest first."""
    out = [Checkpoint(BASE_UID, None, 0)]
    if lk.visible_files(lake, "checkpoints"):
        rows = lk.read_table(lake, "checkpoints", "run = ?", [run]).to_pylist()
        for r in sorted(rows, key=lambda r: r["iteration"]):
            path = r["adapter_path"]
            out.append(Checkpoint(r["uid"], st.join(st.root(lake), path) if path else None, r["iteration"], r["parent_uid"]))
    return out


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1, np.uint64)[0] >> 1)


def check_envs(job: Job) -> None:
    """Fail before anything is written if an env id is not registered with TextArena."""
    from unstable_dask.play.envs import register_envs
    register_envs()
    for key, specs in (("round.train_envs", job.round.train_envs), ("round.eval_envs", job.round.eval_envs)):
        for i, spec in enumerate(specs):
            if spec.env_id not in ta.envs.registration.ENV_REGISTRY:
                raise JobError(f"{job.source}: key '{key}[{i}].env_id' has value {spec.env_id!r}: not a registered "
                               f"TextArena env (e.g. 'SimpleTak-v0-train', 'KuhnPoker-v0-train')")
    if job.round.train_games and not job.round.train_envs:
        raise JobError(f"{job.source}: key 'round.train_envs' is empty but round.train_games = {job.round.train_games}")
    if job.round.eval_games and not job.round.eval_envs:
        raise JobError(f"{job.source}: key 'round.eval_envs' is empty but round.eval_games = {job.round.eval_games}")


def _ratings_overall(lake: str, run: str) -> dict[str, tuple[float, float]]:
    if not lk.visible_files(lake, "ratings"):
        return {}
    rows = lk.query(lake, "SELECT model_uid, mu, sigma FROM ratings WHERE run = ? AND env_id = '*'", [run]).to_pylist()
    return {r["model_uid"]: (r["mu"], r["sigma"]) for r in rows}


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


def win_rate_opponent(job: Job, current: str) -> str:
    """The opponent of UnstableBaselines' win-rate gate for the next round, replayed from the lake.

    The gate holds one opponent, a snapshot of the learner: the checkpoint that played the run's
    first round. Before each round, if the learner won more than `win_rate_threshold` of its last
    `win_rate_games` train games against the held opponent (all of them played since it was taken;
    a draw is not a win, mirror games do not count), the gate takes the checkpoint about to play
    instead, and counting starts again. A pure function of the committed rounds.
    """
    cfg, lake, run = job.round.opponents, job.run.lake, job.run.name
    rounds = lk.query(lake, "SELECT round, checkpoint_uid FROM rounds WHERE run = ? ORDER BY round", [run]).to_pylist()
    games = lk.query(lake, _OUTCOMES_SQL, [run]).to_pylist()
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


class OpponentPool:
    """Resolves opponent names and samples them with the job's strategy."""

    def __init__(self, job: Job, current: Checkpoint, checkpoints: list[Checkpoint]):
        self.job, self.current = job, current
        self.by_uid = {c.uid: c for c in checkpoints}
        self.parent = {c.uid: c.parent_uid for c in checkpoints}
        self.lagged = [c for c in checkpoints if c.iteration < current.iteration][-job.round.opponents.lag:]
        strategy = job.round.opponents.strategy
        self.ratings = _ratings_overall(job.run.lake, job.run.name) if strategy == "match-quality" else {}
        self.gated = win_rate_opponent(job, current.uid) if strategy == "win-rate" else None

    def seat(self, name: str, pid: int, key: str) -> Seat:
        if name == RANDOM_UID:
            return Seat(pid, RANDOM_UID, None, False)
        if name in self.job.endpoints:
            return Seat(pid, self.job.endpoints[name].model, None, False, endpoint=name)
        if name in self.by_uid:
            c = self.by_uid[name]
            return Seat(pid, c.uid, c.adapter, False)
        p = Path(name)
        if (p / "adapter_config.json").is_file():
            return Seat(pid, p.name, str(p.resolve()), False)
        raise JobError(opponent_error(self.job, key, name))

    def candidates(self) -> list[str]:
        strategy = self.job.round.opponents.strategy
        if strategy == "mirror":
            return [self.current.uid]
        if strategy == "fixed":
            return list(self.job.round.opponents.fixed)
        if strategy == "lagged":
            return [c.uid for c in self.lagged] or [self.current.uid]
        if strategy == "win-rate":
            return [self.gated]
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


def _pick_env(specs: list[EnvSpec], weighted: bool, rng: np.random.Generator) -> EnvSpec:
    if weighted:
        w = np.array([s.weight for s in specs], dtype=float)
        return specs[rng.choice(len(specs), p=w / w.sum())]
    return specs[rng.integers(len(specs))]


def schedule_games(job: Job, round_: int, current: Checkpoint, checkpoints: list[Checkpoint]) -> list[GameSpec]:
    """Train games in groups of round.group_size (one start state each), then eval games (one each)."""
    pool = OpponentPool(job, current, checkpoints)
    learner = Seat(0, current.uid, current.adapter, True)
    games = []
    for split, count, size, specs in (("train", job.round.train_games, job.round.group_size, job.round.train_envs),
                                      ("eval", job.round.eval_games, 1, job.round.eval_envs)):
        # A group is one draw of env, seed, seating and opponents; its games differ only in sampling.
        for i in range(count // size):
            seed = _seed(job.run.seed, round_, 0 if split == "train" else 1, i)
            rng = np.random.default_rng(seed)
            spec = _pick_env(specs, job.round.env_sampling == "weighted", rng)
            # The learner's seats rotate with the group index so it plays every position.
            actors = {(i + k) % spec.num_players for k in range(spec.num_actors)}
            seats = []
            for pid in range(spec.num_players):
                if pid in actors:
                    seats.append(Seat(pid, learner.model_uid, learner.adapter, True))
                    continue
                if split == "eval" or spec.opponents:
                    names, key = spec.opponents or list(job.round.opponents.fixed), f"round.{split}_envs.opponents"
                    w = np.full(len(names), 1.0 / len(names))
                else:
                    names, key = pool.candidates(), "round.opponents"
                    w = pool.weights(names)
                seats.append(pool.seat(names[rng.choice(len(names), p=w)], pid, key))
            prefix = f"{job.run.name}-r{round_:04d}-{split}"
            for k in range(i * size, (i + 1) * size):
                games.append(GameSpec(
                    game_id=f"{prefix}-{k:05d}", split=split, env_id=spec.env_id, seed=seed,
                    group_id=f"{prefix}-g{i:05d}", template=spec.template or job.model.template, seats=tuple(seats)))
    return games


def schedule_round(job: Job, round_: int, current: Checkpoint, checkpoints: list[Checkpoint]) -> list[TaskSpec]:
    games = schedule_games(job, round_, current, checkpoints)
    per = job.round.games_per_task
    n_tasks = math.ceil(len(games) / per)
    return [TaskSpec(f"task-{t:04d}", job.run.name, round_, tuple(games[t * per:(t + 1) * per]))
            for t in range(n_tasks)]
