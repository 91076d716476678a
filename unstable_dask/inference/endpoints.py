"""Endpoint opponents: OpenAI-compatible chat endpoints (OpenRouter, OpenAI, `vllm serve`) in seats.

A job declares `[endpoints.<name>]` and names it as an opponent. In a lock-step task, every step's
prompts for one endpoint go out together, the counterpart of the engine's one batched `generate`;
in per-game play each game awaits its own request (`ask`). Either way at most `max_concurrency`
are in flight per endpoint and worker process, on the process's event loop (aio.py), through
`openai.AsyncOpenAI`, whose own retries (429, 5xx, timeouts, dropped connections; exponential
backoff, Retry-After honoured) and timeout apply. A request that still fails is that turn's
failure: no completion, the reason in `turns.error`, and an empty action for the env, which
treats it by its rules (an invalid move).

The API key is read from the worker's environment when its client is made and lives only in that
client: it is in no config, row or message (error texts are scrubbed of it).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

from unstable_dask.config import EndpointConfig, Job, ModelConfig
from unstable_dask.errors import JobError
from unstable_dask.inference import aio

MAX_ERROR_CHARS = 500  # an error body can be a whole HTML page


@dataclass
class Reply:
    text: Optional[str]  # the completion; None when the request finally failed
    prompt_tokens: Optional[int]  # as the endpoint counts them (its usage); None when it does not say
    completion_tokens: Optional[int]
    truncated: bool  # stopped at max_tokens
    latency_s: float  # this request's wall time, the client's retries included
    error: Optional[str]  # why it failed, the API key scrubbed


def require_keys(job: Job, names: set[str]) -> None:
    """Fail before a round starts if an endpoint it seats has no API key in the environment."""
    for name in sorted(names):
        var = job.endpoints[name].api_key_env
        if var and not os.environ.get(var):
            raise JobError(f"{job.source}: key 'endpoints.{name}.api_key_env' has value {var!r}: that environment "
                           f"variable is not set; export the API key in it before the round (it is never stored)")


def _api_key(name: str, cfg: EndpointConfig) -> str:
    if cfg.api_key_env is None:
        # Local servers take any key, but the client insists on one. An explicit placeholder also
        # keeps the client from sending OPENAI_API_KEY to a base_url it was not meant for.
        return "EMPTY"
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise JobError(f"endpoint {name!r}: environment variable {cfg.api_key_env!r} (endpoints.{name}.api_key_env) "
                       f"is not set on worker {os.uname().nodename}:{os.getpid()}")
    return key


def sampling(cfg: EndpointConfig, model: ModelConfig) -> dict[str, Any]:
    """The request's sampling fields: the endpoint's own where set, else [model]'s."""
    return dict(temperature=model.temperature if cfg.temperature is None else cfg.temperature,
                top_p=model.top_p if cfg.top_p is None else cfg.top_p,
                max_tokens=model.max_new_tokens if cfg.max_tokens is None else cfg.max_tokens)


class _Client:
    """One endpoint's AsyncOpenAI client and concurrency bound; lives on the process's loop."""

    def __init__(self, name: str, cfg: EndpointConfig) -> None:
        from openai import AsyncOpenAI

        self.cfg, self.key = cfg, _api_key(name, cfg)
        self.client = AsyncOpenAI(base_url=cfg.base_url, api_key=self.key, timeout=cfg.timeout,
                                  max_retries=cfg.max_retries)
        self.slots = asyncio.Semaphore(cfg.max_concurrency)

    def scrub(self, err: BaseException) -> str:
        text = f"{type(err).__name__}: {err}"
        if self.key != "EMPTY":
            text = text.replace(self.key, "***")
        return text[:MAX_ERROR_CHARS]

    async def ask(self, prompt: str, fields: dict[str, Any]) -> Reply:
        import openai

        async with self.slots:
            t = time.perf_counter()
            try:
                r = await self.client.chat.completions.create(
                    model=self.cfg.model, messages=[{"role": "user", "content": prompt}],
                    extra_body=self.cfg.extra_body or None, **fields)
            except openai.OpenAIError as e:  # raised once the client's own retries are spent
                return Reply(None, None, None, False, time.perf_counter() - t, self.scrub(e))
            dt = time.perf_counter() - t
        choice = r.choices[0] if r.choices else None
        if choice is None or choice.message.content is None:
            why = "no choices" if choice is None else f"no message content (finish_reason {choice.finish_reason!r})"
            return Reply(None, None, None, False, dt, f"empty reply: {why}")
        usage = r.usage
        return Reply(choice.message.content, usage.prompt_tokens if usage else None,
                     usage.completion_tokens if usage else None, choice.finish_reason == "length", dt, None)


_CLIENTS: dict[tuple[str, str], _Client] = {}  # touched on the process's event loop (aio.py) only


def _client(name: str, cfg: EndpointConfig) -> _Client:
    # Clients (and their connection pools) live on the loop across steps and tasks; concurrent
    # tasks in one worker share each endpoint's bound. A changed config gets a client of its own.
    key = (name, cfg.model_dump_json())
    if key not in _CLIENTS:
        _CLIENTS[key] = _Client(name, cfg)
    return _CLIENTS[key]


async def ask(name: str, cfg: EndpointConfig, prompt: str, model: ModelConfig) -> Reply:
    """One prompt to endpoint `name` (per-game play); run on the process's event loop (aio.py)."""
    return await _client(name, cfg).ask(prompt, sampling(cfg, model))


async def _batch(name: str, cfg: EndpointConfig, prompts: list[str], model: ModelConfig) -> list[Reply]:
    return list(await asyncio.gather(*(ask(name, cfg, p, model) for p in prompts)))


def submit(name: str, cfg: EndpointConfig, prompts: list[str],
           model: ModelConfig) -> concurrent.futures.Future[list[Reply]]:
    """Send one step's prompts for endpoint `name`; the future gives one Reply per prompt, in order.
    They fly while the caller's thread runs the local engine.

    Its result raises JobError only where no request could be made (the key missing on this worker).
    """
    return aio.submit(_batch(name, cfg, prompts, model))
