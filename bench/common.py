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
