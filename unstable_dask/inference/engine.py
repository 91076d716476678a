"""Inference engines: one small interface, one engine resident per worker process.

`get_engine(cfg)` returns the process's engine for a `ModelConfig`; the weights are loaded once per
(model, dtype) and every task/round of a Dask worker reuses them. LoRA adapters are hot-swapped by
name on top of the resident base model (design invariant 6).

Backends: `hf` (transformers `generate`, CPU or one GPU) lives here; `vllm` lives in
`vllm_engine.py` and is imported only when asked for.
"""
from __future__ import annotations

import gc
import json
import threading
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

from unstable_dask.config import ModelConfig

from unstable_dask.errors import JobError
from unstable_dask.inference.weights import resolve_model

MAX_RESIDENT_ADAPTERS = 16  # least recently used adapters beyond this are unloaded


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter in peft format."""
    name: str  # stable id, e.g. the checkpoint uid "ckpt-3"
    path: str  # directory with adapter_config.json + adapter_model.safetensors


@dataclass
class Generation:
    text: str  # completion only, special tokens stripped
    prompt_tokens: int  # tokens actually fed (after left truncation)
    completion_tokens: int  # generated tokens, the EOS token included when one was generated
    truncated: bool  # stopped at max_new_tokens without EOS
    # Behaviour log-prob of each generated token: sampling.sampling_logprobs(logits, T, top_p).
    logprobs: Optional[list[float]]
    token_ids: list[int]  # the generated ids (len == completion_tokens); text is their decode


class Engine(Protocol):
    tokenizer: Any

    def generate(self, prompts: list[str], adapter: Optional[Adapter] = None,
                 seed: Optional[int] = None) -> list[Generation]: ...

    def chat_prompt(self, user_text: str) -> str: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- helpers shared by backends

def prompt_budget(cfg: ModelConfig) -> int:
    """Most prompt tokens that still leave room for max_new_tokens inside max_model_len."""
    return max(1, cfg.max_model_len - cfg.max_new_tokens)


def encode_prompts(tokenizer: Any, prompts: list[str], budget: int) -> list[list[int]]:
    """Token ids of fully templated prompts, keeping the last `budget` tokens of each.

    Truncating from the left keeps the end of the prompt (the assistant header and the latest
    observation). An empty prompt becomes one neutral token, as engines reject empty inputs.
    """
    filler = next(t for t in (tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
                  if t is not None)
    if not prompts:
        return []
    # Lone surrogates cannot be UTF-8 encoded and would make the tokenizer raise.
    texts = [p.encode("utf-8", errors="replace").decode("utf-8") for p in prompts]
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return [ids[-budget:] or [filler] for ids in encoded]


def chat_prompt(tokenizer: Any, user_text: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise JobError(f"model.base {tokenizer.name_or_path!r} has no chat template; "
                       "pick a model.template other than 'chat'")
    return tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                         tokenize=False, add_generation_prompt=True)


def check_adapter(adapter: Adapter) -> None:
    if not (Path(adapter.path) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"adapter {adapter.name!r}: no adapter_config.json in {adapter.path}")


# ---------------------------------------------------------------- transformers backend

def _behaviour_logprob_processor(temperature: float, top_p: float):
    """A logits processor that replaces the scores by the behaviour log-probs and records the sampled ones.

    It returns `sampling_logprobs(scores, temperature, top_p)` (normalised log-probs, -inf outside
    the nucleus) with generate's own warpers switched off, so generate draws each token from
    exactly the distribution whose log-prob is recorded: one computation, not two.
    """
    import torch
    from transformers import LogitsProcessor

    from unstable_dask.inference.sampling import sampling_logprobs

    class BehaviourLogprobs(LogitsProcessor):
        def __init__(self) -> None:
            self.prev: Optional[torch.Tensor] = None  # log-probs of the step whose token is not known yet
            self.steps: list[torch.Tensor] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.prev is not None:  # input_ids now end with the token sampled from `prev`
                self.steps.append(self.prev.gather(1, input_ids[:, -1:])[:, 0])
            self.prev = sampling_logprobs(scores, temperature, top_p)
            return self.prev

        def finish(self, sequences: torch.Tensor) -> torch.Tensor:
            """(batch, new_tokens) log-probs, once generate has returned."""
            if self.prev is not None:
                self.steps.append(self.prev.gather(1, sequences[:, -1:])[:, 0])
            return torch.stack(self.steps, dim=1)

    return BehaviourLogprobs()


class _HFModel:
    """Weights, tokenizer and loaded adapters of one model in this process (shared by engines)."""

    def __init__(self, path: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(self.device).eval()
        # Stop at the tokenizer's EOS and at any EOS the checkpoint declares (e.g. <|endoftext|>).
        declared = self.base.generation_config.eos_token_id
        declared = declared if isinstance(declared, list) else [declared]
        self.eos_ids = sorted({self.tokenizer.eos_token_id, *declared} - {None})
        # Sampling comes from ModelConfig only: drop the checkpoint's defaults (top_k, penalties...).
        self.base.generation_config = GenerationConfig(eos_token_id=self.eos_ids,
                                                       pad_token_id=self.tokenizer.pad_token_id)
        self.model: Any = self.base  # becomes a PeftModel once an adapter is loaded
        self.adapters: OrderedDict[str, tuple[str, str]] = OrderedDict()  # name -> (peft slot, path)
        self.n_slots = 0
        self.sleeping = False
        self.lock = threading.Lock()  # one generate at a time: the active adapter is model state

    def use(self, adapter: Optional[Adapter]):
        """Make `adapter` (or the bare base model) active; returns a context to run generate in."""
        from peft import PeftModel

        if adapter is None:
            return self.model.disable_adapter() if isinstance(self.model, PeftModel) else nullcontext()
        known = self.adapters.get(adapter.name)
        if known is None or known[1] != adapter.path:
            check_adapter(adapter)
            # peft slot names are module keys: use our own safe, never-reused names.
            slot = f"adapter{self.n_slots}"
            self.n_slots += 1
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(adapter.path, adapter_name=slot)
            else:
                self.model = PeftModel.from_pretrained(self.base, adapter.path, adapter_name=slot)
            self.model.set_adapter(slot)  # before any delete: peft complains when the active one goes
            if known is not None:  # same name, new path: the new weights replace the old ones
                self.model.delete_adapter(known[0])
            self.adapters[adapter.name] = (slot, adapter.path)
            while len(self.adapters) > MAX_RESIDENT_ADAPTERS:
                _, (old_slot, _) = self.adapters.popitem(last=False)
                self.model.delete_adapter(old_slot)
            self.model.eval()
        self.adapters.move_to_end(adapter.name)
        self.model.set_adapter(self.adapters[adapter.name][0])
        return nullcontext()

    def to(self, device: Any) -> None:
        import torch

        self.model.to(device)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class HFEngine:
    """transformers `generate`: batched, left-padded, behaviour log-probs, peft LoRA hot-swap."""

    def __init__(self, cfg: ModelConfig, hf: Optional[_HFModel] = None) -> None:
        self.cfg = cfg
        self.hf = hf or _HFModel(resolve_model(cfg.base), cfg.dtype)
        self.tokenizer = self.hf.tokenizer

    def chat_prompt(self, user_text: str) -> str:
        return chat_prompt(self.tokenizer, user_text)

    def generate(self, prompts: list[str], adapter: Optional[Adapter] = None,
                 seed: Optional[int] = None) -> list[Generation]:
        import torch

        ids = encode_prompts(self.tokenizer, prompts, prompt_budget(self.cfg))
        # Longest first, so each chunk holds similar lengths and little padding.
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        results: list[Optional[Generation]] = [None] * len(ids)
        with self.hf.lock:
            if self.hf.sleeping:
                self.wake_up()
            with self.hf.use(adapter), torch.inference_mode():
                for start in range(0, len(order), self.cfg.hf_max_batch):
                    chunk = order[start:start + self.cfg.hf_max_batch]
                    # A fresh seed per chunk keeps a chunk's samples independent of the chunks before it.
                    cuda = [torch.cuda.current_device()] if self.hf.device.type == "cuda" else []
                    rng = torch.random.fork_rng(devices=cuda) if seed is not None else nullcontext()
                    with rng:
                        if seed is not None:
                            torch.manual_seed(seed + start)
                        gens = self._generate_chunk([ids[i] for i in chunk])
                    for i, g in zip(chunk, gens):
                        results[i] = g
        return results  # type: ignore[return-value]

    def _generate_chunk(self, batch: list[list[int]]) -> list[Generation]:
        import torch

        cfg, hf = self.cfg, self.hf
        width = max(len(x) for x in batch)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=hf.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=hf.device)
        recorder = _behaviour_logprob_processor(cfg.temperature, cfg.top_p)
        # The recorder already returns the behaviour distribution: generate must not warp it again.
        sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if cfg.temperature > 0 else {}
        seqs = hf.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                 logits_processor=[recorder], eos_token_id=hf.eos_ids, pad_token_id=pad,
                                 **sampling)
        new = seqs[:, width:]
        logprobs = recorder.finish(new).tolist()
        eos = torch.isin(new, torch.tensor(hf.eos_ids, device=new.device))
        out = []
        for row, x in enumerate(batch):
            hits = eos[row].nonzero()
            n = int(hits[0]) + 1 if len(hits) else new.shape[1]
            tokens = new[row, :n].tolist()
            out.append(Generation(text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                                  prompt_tokens=len(x), completion_tokens=n,
                                  truncated=not len(hits), logprobs=logprobs[row][:n], token_ids=tokens))
        return out

    def sleep(self) -> None:
        if self.hf.device.type == "cuda" and not self.hf.sleeping:
            self.hf.to("cpu")
            self.hf.sleeping = True

    def wake_up(self) -> None:
        if self.hf.sleeping:
            self.hf.to(self.hf.device)
            self.hf.sleeping = False

    def close(self) -> None:
        # Every engine view on these weights goes with them.
        for key in [k for k, v in _ENGINES.items() if getattr(v, "hf", None) is self.hf]:
            del _ENGINES[key]
        for key in [k for k, v in _HF_MODELS.items() if v is self.hf]:
            del _HF_MODELS[key]
        self.hf.model = self.hf.base = None
        gc.collect()
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


# ---------------------------------------------------------------- the per-process cache

_ENGINES: dict[str, Engine] = {}  # full sampling + model config -> engine (a cheap view)
_HF_MODELS: dict[tuple[str, str], _HFModel] = {}  # (model path, dtype) -> resident weights
_CACHE_LOCK = threading.Lock()


def resident_engines() -> list[Engine]:
    """Engines this process keeps resident (e.g. to sleep them while a learner uses the GPU)."""
    with _CACHE_LOCK:
        return list(_ENGINES.values())


def close_resident() -> None:
    """Close every resident engine of this process (a worker shutting down): vLLM's engine-core
    process would otherwise outlive its worker, orphaned and holding memory."""
    for engine in resident_engines():
        engine.close()  # closing one view closes its siblings; a second close is a no-op


def get_engine(cfg: ModelConfig) -> Engine:
    """The engine for `cfg`, built on first use and reused by every later task in this process.

    Configs that differ only in sampling settings (temperature, max_new_tokens...) get their own
    engine object but share one resident copy of the weights.
    """
    key = json.dumps(cfg.model_dump(mode="json", exclude={"template"}), sort_keys=True)
    with _CACHE_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            if cfg.backend == "vllm":
                from unstable_dask.inference.vllm_engine import VLLMEngine
                engine = VLLMEngine(cfg)
            else:
                weights_key = (resolve_model(cfg.base), cfg.dtype)
                if weights_key not in _HF_MODELS:
                    _HF_MODELS[weights_key] = _HFModel(*weights_key)
                engine = HFEngine(cfg, _HF_MODELS[weights_key])
            _ENGINES[key] = engine
        return engine
