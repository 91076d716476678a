"""Base models a learner process keeps between iterations (`learn.resident`).

Loading the frozen base is a fixed cost of every learner iteration: 0.7-1.0 s for SmolLM2-135M on
this 2-core CPU, more on a GPU where the weights also cross the bus. A process that trains again
(`loop` on CPU, a GPU worker beside its resident engine) takes the base it handed back last time
instead: the Trainer wraps it in the iteration's LoRA adapter and, after a committed update,
unloads the adapter (peft's `unload`: the LoRA layers out, the base weights never trained) and
hands it back. A base is held by one Trainer at a time (taken out of the set, not shared), and an
iteration that fails never hands its base back, so a base a failure may have left half-wrapped is
never reused.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

_KEPT: dict[tuple, Any] = {}


def take(key: tuple, load: Callable[[], Any], keep: bool) -> Any:
    """The base under `key` this process kept, else a freshly loaded one (`load`)."""
    model = _KEPT.pop(key, None) if keep else None
    return model if model is not None else load()


def give_back(key: tuple, model: Any) -> None:
    _KEPT[key] = model


def clear() -> None:
    """Drop every kept base (their memory goes back at the next garbage collection)."""
    _KEPT.clear()


def kept() -> list[Any]:
    """The bases this process holds now."""
    return list(_KEPT.values())


def fits(setting: str, device: torch.device, model: Any, engine_memory_share: Optional[float]) -> bool:
    """Whether the base may stay: `always`/`never` as the job says; `auto` keeps it on a CPU and on a
    GPU without a resident engine, and beside one only when its weights take at most half of what
    the engine leaves free (1 - gpu_memory_utilization of the card): the engine allocates its share
    again when it wakes, and must find it free."""
    if setting != "auto":
        return setting == "always"
    if device.type != "cuda" or engine_memory_share is None:
        return True
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total = torch.cuda.get_device_properties(device).total_memory
    return weights <= (1.0 - engine_memory_share) * total / 2
