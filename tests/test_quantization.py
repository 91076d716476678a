"""learn.quantization on a machine without CUDA: the config and the error paths (the CUDA path, a
bitsandbytes base under a peft LoRA, needs a GPU and is not run here)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from unstable_dask import learn as learn_mod
from unstable_dask.config import JobError, load_job


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
