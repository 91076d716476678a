"""Shared by the bench scripts: result files and the markdown row each prints."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"


def save(name: str, data: dict) -> Path:
    """Write bench/results/<name>.json (with the command line and machine) and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"bench": name, "machine": machine(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python", *sys.argv]), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def vllm_batch(engine, prompt_ids: list[list[int]], params) -> list:
    """`vllm.LLM.generate` on the project's resident vLLM engine: every prompt sent at once to the
    same async engine, no log-probs or decoding of ours; vLLM's RequestOutputs, in order.
    `params`: one SamplingParams for all, or a list of one per prompt."""
    import asyncio

    from unstable_dask.inference import aio

    async def one(i: int, ids: list[int]):
        last = None
        p = params[i] if isinstance(params, list) else params
        async for out in engine.vm.engine.generate({"prompt_token_ids": ids}, p, request_id=f"raw-{i}-{id(ids)}"):
            last = out
        return last

    async def every():
        return await asyncio.gather(*(one(i, x) for i, x in enumerate(prompt_ids)))
    return aio.run(every())


def matmul_peak(dtype: str = "float32", n: int = 2048, reps: int = 5, threads: int | None = None) -> float:
    """FLOP/s of an n^3 torch matmul on this machine (best of `reps`): the physical limit an engine
    or a learner is compared with. `threads`: torch threads for the measurement (default: as set)."""
    import torch
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a, b = (torch.randn(n, n, dtype=getattr(torch, dtype)) for _ in range(2))
        a @ b
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            t.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * n ** 3 / min(t)


def forward_flops(model_path: str) -> tuple[float, float]:
    """(FLOPs per token through the non-embedding weights, FLOPs per token of the LM head) of a
    decoder-only transformers model, counted from its config: 2 x weights per token for each."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model_path)
    h, layers = c.hidden_size, c.num_hidden_layers
    head = getattr(c, "head_dim", None) or h // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", c.num_attention_heads) * head
    attn = h * c.num_attention_heads * head * 2 + h * kv * 2  # q, o; k, v
    mlp = 3 * h * c.intermediate_size  # gate, up, down
    return 2.0 * layers * (attn + mlp), 2.0 * c.vocab_size * h
