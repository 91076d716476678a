"""The models a learner process keeps between iterations (`learn.resident`).

Building the learner's model is a fixed cost of every iteration: on this 2-core CPU, for
SmolLM2-135M, ~0.2-0.4 s for the tokenizer, 0.1-0.3 s for the base weights and ~0.3 s for peft to
build the LoRA layers and load the parent adapter (more on a GPU, where the weights also cross the
bus). A process that trains again (`loop` on CPU, a GPU worker beside its resident engine) keeps
the LoRA-wrapped model it trained and the tokenizer; the next iteration's Trainer loads its
parent's adapter weights into that model in place. The base weights are frozen, so the kept model
differs from a fresh one only in those LoRA weights, which the load replaces. A model is held by
one Trainer at a time (taken out of the set, not shared), and an iteration that fails never hands
its model back.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

_KEPT: dict[tuple, Any] = {}
_TOKENIZERS: dict[str, Any] = {}


def take(key: tuple, keep: bool) -> Optional[Any]:
    """The model under `key` this process kept (now the caller's alone), or None."""
    return _KEPT.pop(key, None) if keep else None


def give_back(key: tuple, model: Any) -> None:
    _KEPT[key] = model


def tokenizer(path: str, load: Callable[[], Any], keep: bool) -> Any:
    """The tokenizer of `path`: shared, as nothing of it changes while it encodes."""
    if not keep:
        return load()
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = load()
    return _TOKENIZERS[path]


def clear() -> None:
    """Drop every kept model and tokenizer (their memory goes back at the next garbage collection)."""
    _KEPT.clear()
    _TOKENIZERS.clear()


def kept() -> list[Any]:
    """The models this process holds now."""
    return list(_KEPT.values())


def fits(setting: str, device: torch.device, model: Any, engine_memory_share: Optional[float]) -> bool:
    """Whether a model may stay: `always`/`never` as the job says; `auto` keeps it on a CPU and on a
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
