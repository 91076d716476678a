"""learn.quantization on a machine without CUDA: the config and the error paths (the CUDA path, a
bitsandbytes base under a peft LoRA, needs a GPU and is not run here)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from unstable_dask.errors import JobError
from unstable_dask.jobfile import load_job
from unstable_dask.learn import learner as learn_mod


def test_quantization_values_are_checked_on_load() -> None:
    assert load_job(None).learn.quantization == "none"
    assert load_job(None, {"learn.quantization": "8bit"}).learn.quantization == "8bit"  # device auto: decided later
    with pytest.raises(JobError) as e:
        load_job(None, {"learn.quantization": "2bit"})
    assert str(e.value) == "<default>: key 'learn.quantization' has value '2bit': Input should be 'none', '4bit' or '8bit'"
    with pytest.raises(JobError) as e:
        load_job(None, {"learn.quantization": "4bit", "learn.device": "cpu"})
    assert str(e.value) == ("<default>: key 'learn.quantization' has value '4bit': 4/8-bit learners need a CUDA GPU "
                            "(bitsandbytes) and learn.device is 'cpu'; use 'none' on CPU")


def test_loop_refuses_a_cpu_quantized_learner_before_any_round(tmp_path: Path) -> None:
    from unstable_dask.loop import loop
    job = load_job(None, {"learn.quantization": "4bit", "run.lake": str(tmp_path / "lake")})
    if learn_mod.resolve_device(job) == "cuda":
        pytest.skip("this machine has a GPU")
    with pytest.raises(JobError) as e:
        loop(job, rounds=1)
    assert str(e.value) == ("<default>: key 'learn.quantization' has value '4bit': 4/8-bit learners need a CUDA GPU "
                            "(bitsandbytes) and this learner runs on cpu (learn.device = 'auto'); use 'none' on CPU")
    assert not (tmp_path / "lake").exists()  # no round was played


def test_missing_bitsandbytes_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    job = load_job(None, {"learn.quantization": "8bit", "learn.device": "cuda"})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(JobError) as e:
        learn_mod.check_quantization(job, learn_mod.resolve_device(job))
    assert str(e.value) == ("<default>: key 'learn.quantization' has value '8bit': the bitsandbytes package is not "
                            "installed: pip install 'unstable-dask[quantization]'")
    learn_mod.check_quantization(load_job(None), "cpu")  # 'none' runs anywhere


@pytest.mark.slow
@pytest.mark.skipif(not (__import__("torch").cuda.is_available() and importlib.util.find_spec("bitsandbytes")),
                    reason="needs a CUDA GPU and bitsandbytes (`make gpu-check` machines)")
@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_a_quantized_learner_writes_a_standard_adapter(bits: str, tmp_path: Path, local_client) -> None:
    """QLoRA on CUDA: the update trains (the adapter moved), and the adapter is plain peft LoRA that
    loads onto the unquantized base on CPU, as vLLM and the HF engine serve it."""
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from unstable_dask.inference.weights import resolve_model
    from unstable_dask.lake import Lake
    from unstable_dask.play.round import play_round
    job = load_job("jobs/demo.toml", {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"),
                                      "round.train_games": 16, "round.eval_games": 0, "model.max_new_tokens": 12,
                                      "learn.batch_size": 8, "learn.mini_batch_size": 4, "learn.lr": 1e-2,
                                      "learn.device": "cuda", "learn.quantization": bits})
    play_round(job, client=local_client)
    res = learn_mod.learn(job)
    step = Lake(job.run.lake).sql("SELECT * FROM learner_steps").to_pylist()[0]
    assert step["device"] == "cuda" and step["cuda_mem_peak"] > 0 and math.isfinite(step["loss"])
    adapter = tmp_path / "lake" / res.adapter_path
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and "quantization" not in json.dumps(cfg).lower()
    base = AutoModelForCausalLM.from_pretrained(resolve_model(job.model.base), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: nonzero means it trained
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(model(ids).logits).all()
