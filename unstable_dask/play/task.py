"""Play one task: many TextArena games at once on the worker's resident engine.

Each step gathers the pending prompts of every game in flight, makes one batched `generate` call
per adapter (and sends the prompts of endpoint seats to their endpoints meanwhile, endpoints.py),
and steps each env. A finished game frees its slot for the next one until the task's
games are played; then the task writes its `games` and `turns` files to the lake (atomically, under
names fixed by the schedule, so a retried task replaces its files).
"""
from __future__ import annotations

import json
import os
import random
import socket
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import textarena as ta

from unstable_dask.config import EndpointConfig, ModelConfig, RoundConfig
from unstable_dask.inference import endpoints as endpoints_mod
from unstable_dask.inference.engine import Adapter, adapter_digest
from unstable_dask.lake import Lake
from unstable_dask.lake import storage as st
from unstable_dask.lake.commit import now
from unstable_dask.play.agents import AGENTS
from unstable_dask.play.prompts import extract_action, render_prompt
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
    agent_rng: random.Random
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
    # The random agent draws per game (not per seed): in a group it is an opponent that samples
    # independently, like a model opponent, while the env's start state is the group's.
    return _Game(spec, env, rng_state, random.Random(spec.game_id), now())


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


def play_task(task: TaskSpec, model_cfg: ModelConfig, round_cfg: RoundConfig, lake: Lake,
              progress: Optional[Any] = None, endpoints: Optional[dict[str, EndpointConfig]] = None) -> dict:
    """Play every game of `task`, write its games/turns files, return counters for the driver.

    `progress(games_finished_this_step, completion_tokens_so_far)` is called after every step.
    `endpoints`: the job's [endpoints], for seats an endpoint plays.
    """
    from unstable_dask.play.envs import register_envs
    register_envs()
    worker = f"{socket.gethostname()}:{os.getpid()}"
    engines: dict[Optional[str], Any] = {}  # seat base model (None: [model].base) -> the worker's resident engine

    def engine_for(base: Optional[str]) -> Any:
        if base not in engines:
            from unstable_dask.inference.engine import get_engine  # here: a task of agents needs no model
            engines[base] = get_engine(model_cfg if base is None else model_cfg.model_copy(update={"base": base}))
        return engines[base]

    pending = list(task.games)
    active: list[_Game] = []
    games_out: list[dict] = []
    turns_out: list[dict] = []
    tokens, gen_time, t0 = 0, 0.0, time.perf_counter()

    n_steps = 0
    while pending or active:
        n_steps += 1
        while pending and len(active) < round_cfg.concurrency:
            active.append(_start(pending.pop(0), round_cfg))
        requests: dict[tuple[Optional[str], Optional[str]], list[tuple[_Game, int, str, str, Any]]] = defaultdict(list)
        remote: dict[str, list[tuple[_Game, int, str, str, Any]]] = defaultdict(list)
        finished: list[tuple[_Game, bool]] = []

        def advance(g: _Game, pid: int, action: str, row: dict, finished: list = finished) -> None:
            if _move(g, pid, action, row) or len(g.turns) >= round_cfg.max_turns:
                finished.append((g, len(g.turns) >= round_cfg.max_turns and not _state(g.env).done))

        for g in active:
            pid, obs = g.call(g.env.get_observation)
            seat = g.spec.seats[pid]
            base_row = dict(game_id=g.spec.game_id, pid=pid, model_uid=seat.model_uid, is_learner=seat.is_learner,
                            split=g.spec.split, env_id=g.spec.env_id, seed=g.spec.seed, group_id=g.spec.group_id,
                            observation=obs)
            if seat.plays == "agent":
                move = AGENTS[seat.source or ""](g.spec.env_id, obs, g.agent_rng) or "[pass]"
                base_row.update(prompt=None, completion=None, format_ok=None, prompt_tokens=0,
                                completion_tokens=0, completion_token_ids=None, truncated=False, logprobs=None,
                                latency_s=0.0)
                advance(g, pid, move, base_row)
                continue
            if seat.plays == "endpoint":
                # The endpoint applies its own chat template: the prompt is the user message of the
                # `chat` template, sent and stored as is.
                prompt = render_prompt("chat", obs, lambda text: text)
                remote[seat.source or ""].append((g, pid, prompt, seat.model_uid, base_row))
                continue
            prompt = render_prompt(g.spec.template, obs, engine_for(seat.base).chat_prompt)
            requests[(seat.base, seat.source)].append((g, pid, prompt, seat.model_uid, base_row))
        # Sent before the local generate calls, so the endpoints work while the engine does.
        calls = [(reqs, endpoints_mod.submit(name, (endpoints or {})[name], [r[2] for r in reqs], model_cfg))
                 for name, reqs in remote.items()]
        for (base, adapter_path), reqs in requests.items():
            adapter = None
            if adapter_path is not None:
                adapter = Adapter(reqs[0][3], st.local_dir(adapter_path))  # an object store's: downloaded once
            t = time.perf_counter()
            # Seeded per (task, step, adapter): a round replays the same samples on the hf engine. The
            # first game's id tells tasks apart (one group's seed can lead two tasks); its seed, runs.
            first = task.games[0]
            key = f"{first.game_id}/{first.seed}/{n_steps}/{adapter_path or ''}" + (f"/{base}" if base else "")
            step_seed = zlib.crc32(key.encode())
            outs = engine_for(base).generate([r[2] for r in reqs], adapter=adapter, seed=step_seed)
            dt = time.perf_counter() - t
            gen_time += dt
            for (g, pid, prompt, _, row), out in zip(reqs, outs):
                text = _utf8(out.text)
                action, ok = extract_action(text)
                tokens += out.completion_tokens
                row.update(adapter_sha256=None if out.adapter_path is None else adapter_digest(out.adapter_path),
                           prompt=prompt, completion=text, format_ok=ok, prompt_tokens=out.prompt_tokens,
                           completion_tokens=out.completion_tokens, completion_token_ids=out.token_ids,
                           truncated=out.truncated,
                           logprobs=out.logprobs, latency_s=dt)
                advance(g, pid, action, row)
        # Endpoint tokens are not counted in `tokens`: that is the local engine's throughput.
        for reqs, call in calls:
            for (g, pid, prompt, _, row), reply in zip(reqs, call.result()):
                said = None if reply.text is None else _utf8(reply.text)
                # A failed request sends the env an empty action, an invalid move by its rules.
                action, ok = extract_action(said or "")
                row.update(prompt=prompt, completion=said, format_ok=None if said is None else ok,
                           prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens,
                           completion_token_ids=None, truncated=reply.truncated, logprobs=None,
                           latency_s=reply.latency_s, error=reply.error)
                advance(g, pid, action, row)
        for g, capped in finished:
            active.remove(g)
            games_out.append(_finish(g, worker, task.key, capped))
            turns_out.extend(g.turns)
        if progress is not None:
            progress(len(finished), tokens)

    lake.write("turns", task.run_name, task.round, task.file_key, turns_out)
    lake.write("games", task.run_name, task.round, task.file_key, games_out)
    return dict(task=task.key, games=len(games_out), turns=len(turns_out), completion_tokens=tokens,
                generate_s=gen_time, wall_s=time.perf_counter() - t0, worker=worker,
                engines=sorted({e.name for e in engines.values()}))
