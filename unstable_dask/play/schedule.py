"""What a round plays: games (env, seed, who sits where) split into tasks. Deterministic: a
function of the job, the round number and the lake's snapshot (the run's checkpoints; for the
match-quality and win-rate strategies, its ratings and committed games, through OpponentPool).

Train games come in groups of `round.group_size`: one draw of env, seed, seating and opponents,
played that many times as distinct games (the G exchangeable attempts GRPO compares). Game ids,
group ids and seeds come from (run seed, round, split, index), so a re-run of a round schedules
the same games and every task writes the same file names.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import textarena as ta

from unstable_dask.config import LEGAL_RANDOM_UID, EnvSpec, Job, LeagueGame
from unstable_dask.errors import JobError
from unstable_dask.lake import Lake
from unstable_dask.play.opponents import Checkpoint, ExpertAgent, OpponentPool, RandomAgent, Seat


@dataclass(frozen=True)
class GameSpec:
    game_id: str
    split: str  # train | eval | baseline (round.eval_baseline: one replay of each eval game per agent)
    env_id: str
    seed: int  # the env seed: one per group, so a group's games start from the same state
    group_id: str  # <run>-r<round>-<split>-g<index>: games of one start state (eval: one game each)
    template: str
    seats: tuple[Seat, ...]
    draws: str = ""  # the game whose agents' random draws this one repeats ("": its own id; a baseline twin: its eval game)

    @property
    def draws_id(self) -> str:
        """The id the agents' random draws derive from (with the seed and the seat)."""
        return self.draws or self.game_id


@dataclass(frozen=True)
class TaskSpec:
    key: str  # task-0003: fixed by the schedule
    run_name: str
    round: int
    games: tuple[GameSpec, ...]
    attempt: str = "0"  # the driver attempt playing it; the commit marker names the winning one

    @property
    def file_key(self) -> str:
        """Name of this task's games/turns files: a retry within an attempt replaces them."""
        return f"{self.key}.{self.attempt}"


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts. The shift is on a Python int: numpy < 2 promotes
    uint64 >> int to float64 and refuses it."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1, np.uint64)[0]) >> 1


def check_envs(job: Job) -> None:
    """Fail before anything is written if an env id is not registered with TextArena."""
    from unstable_dask.play.envs import register_envs
    register_envs()
    envs: list[tuple[str, Sequence[Union[EnvSpec, LeagueGame]]]] = [
        ("round.train_envs", job.round.train_envs), ("round.eval_envs", job.round.eval_envs),
        ("league.games", job.league.games)]
    for key, specs in envs:
        for i, spec in enumerate(specs):
            if spec.env_id not in ta.envs.registration.ENV_REGISTRY:
                raise JobError(f"{job.source}: key '{key}[{i}].env_id' has value {spec.env_id!r}: not a registered "
                               f"TextArena env (e.g. 'SimpleTak-v0-train', 'KuhnPoker-v0-train')")
    if job.round.train_games and not job.round.train_envs:
        raise JobError(f"{job.source}: key 'round.train_envs' is empty but round.train_games = {job.round.train_games}")
    if job.round.eval_games and not job.round.eval_envs:
        raise JobError(f"{job.source}: key 'round.eval_envs' is empty but round.eval_games = {job.round.eval_games}")


def _pick_env(specs: list[EnvSpec], weighted: bool, rng: np.random.Generator) -> EnvSpec:
    if weighted:
        w = np.array([s.weight for s in specs], dtype=float)
        return specs[rng.choice(len(specs), p=w / w.sum())]
    return specs[rng.integers(len(specs))]


def schedule_games(job: Job, lake: Lake, round_: int, current: Checkpoint,
                   checkpoints: list[Checkpoint]) -> list[GameSpec]:
    """Train games in groups of round.group_size (one start state each), then eval games (one each)."""
    pool = OpponentPool(job, lake, current, checkpoints)
    games = []
    for split, count, size, specs in (("train", job.round.train_games, job.round.group_size, job.round.train_envs),
                                      ("eval", job.round.eval_games, 1, job.round.eval_envs)):
        # A group is one draw of env, seed, seating and opponents; its games differ only in sampling.
        for i in range(count // size):
            seed = derive_seed(job.run.seed, round_, 0 if split == "train" else 1, i)
            rng = np.random.default_rng(seed)
            spec = _pick_env(specs, job.round.env_sampling == "weighted", rng)
            # The learner's seats rotate with the group index so it plays every position.
            actors = {(i + k) % spec.num_players for k in range(spec.num_actors or spec.num_players)}
            seats = []
            for pid in range(spec.num_players):
                if pid in actors:
                    seats.append(current.seat(pid, is_learner=True))
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
    for name in job.round.eval_baseline:
        games += [baseline_twin(g, name) for g in games if g.split == "eval"]
    return games


def baseline_twin(game: GameSpec, agent: str = LEGAL_RANDOM_UID) -> GameSpec:
    """The eval game replayed with `agent` (round.eval_baseline) in the learner's seats: same env,
    seed and opponents, and the opponents draw the eval game's random numbers (`draws`), so while
    the agent moves as the learner did the opponents move as they did: the learner's eval score and
    the agent's differ only by who moved (common random numbers, a paired comparison). The
    agent's seats keep is_learner false; the report finds them as the eval twin's learner pids (same
    run, round and seed). legal-random's ids keep their first form (`-baseline-`), so a round
    scheduled again names the same games; another agent's carry its name (`-baseline-minimax-`)."""
    player = RandomAgent(LEGAL_RANDOM_UID) if agent == LEGAL_RANDOM_UID else ExpertAgent(agent)
    seats = tuple(player.seat(s.pid) if s.is_learner else s for s in game.seats)
    tag = "-baseline-" if agent == LEGAL_RANDOM_UID else f"-baseline-{agent}-"
    return dataclasses.replace(game, game_id=game.game_id.replace("-eval-", tag), split="baseline",
                               group_id=game.group_id.replace("-eval-", tag), seats=seats, draws=game.draws_id)


def schedule_round(job: Job, lake: Lake, round_: int, current: Checkpoint,
                   checkpoints: list[Checkpoint]) -> list[TaskSpec]:
    games = schedule_games(job, lake, round_, current, checkpoints)
    per = job.round.games_per_task
    n_tasks = math.ceil(len(games) / per)
    return [TaskSpec(f"task-{t:04d}", job.run.name, round_, tuple(games[t * per:(t + 1) * per]))
            for t in range(n_tasks)]
