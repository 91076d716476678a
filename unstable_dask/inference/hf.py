"""The transformers backend: batched `generate`, left-padded, behaviour log-probs recorded, peft
LoRA adapters hot-swapped on one resident copy of the weights. Portable (CPU, one GPU, macOS).

The active adapter is merged for generation (model.hf_merge_adapter): peft applies an unmerged
adapter as two extra matmuls per adapted layer on every forward, which cost a round after an update
15-25% of the base model's speed on CPU. Merging swaps each adapted layer's weight Parameter for
base + delta and swapping back restores the base exactly; peft's own merge/unmerge adds and
subtracts the delta in place, so every swap would leave the base a few ulps off.
"""
from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from contextlib import nullcontext
from typing import Any, Optional, cast

from unstable_dask.config import ModelConfig
from unstable_dask.inference import engine as engines
from unstable_dask.inference.engine import Adapter, Generation, chat_prompt, check_adapter, encode_prompts, prompt_budget
from unstable_dask.inference.weights import resolve_model

MAX_RESIDENT_ADAPTERS = 16  # least recently used adapters beyond this are unloaded
_HF_MODELS: dict[tuple[str, str], "HFModel"] = {}  # (model path, dtype) -> resident weights


def make_engine(cfg: ModelConfig) -> "HFEngine":
    """An engine view for `cfg` on this process's resident weights of (model, dtype)."""
    key = (resolve_model(cfg.base), cfg.dtype)
    if key not in _HF_MODELS:
        _HF_MODELS[key] = HFModel(*key)
    return HFEngine(cfg, _HF_MODELS[key])


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


def _stop_string_criteria(tokenizer: Any, stop: list[str], width: int, eos_ids: list[int]):
    """A stopping criterion for model.stop: a row ends once the text it has generated (decoded as
    Generation.text is) contains a stop string, the token that completed it kept; vLLM stops by the
    same rule. `ends[row]` records that row's completion length, so the tokens the lake keeps are
    exactly those generated up to the stop (generate pads the row after it)."""
    import torch
    from transformers import StoppingCriteria

    class StopAtStrings(StoppingCriteria):
        def __init__(self) -> None:
            self.ends: dict[int, int] = {}

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            new = input_ids[:, width:]
            ended = torch.isin(new, torch.tensor(eos_ids, device=new.device)).any(dim=1).tolist()
            for row, eos in enumerate(ended):
                if row in self.ends or eos:  # a row past its EOS is padding: the EOS ended it first
                    continue
                text = tokenizer.decode(new[row].tolist(), skip_special_tokens=True)
                if any(s in text for s in stop):
                    self.ends[row] = new.shape[1]
            done = torch.zeros(new.shape[0], dtype=torch.bool, device=new.device)
            done[list(self.ends)] = True
            return done

    return StopAtStrings()


class HFModel:
    """Weights, tokenizer and loaded adapters of one model in this process (shared by engines)."""

    def __init__(self, path: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = engines.auto_dtype(dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        self.base = model.to(self.device).eval()
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
        self.active: Optional[str] = None  # path of the adapter whose weights are active (None: base)
        # (peft slot, [(parent, attribute, LoRA layer, its base weight Parameter)]) while a slot's deltas
        # are in the weights and the LoRA layers are out of the model
        self.merged: Optional[tuple[str, list[tuple[Any, str, Any, Any]]]] = None
        self.sleeping = False
        self.lock = threading.Lock()  # one generate at a time: the active adapter is model state

    def use(self, adapter: Optional[Adapter], merge: bool = False):
        """Make `adapter` (or the bare base model) active, its deltas merged into the weights when
        `merge`; returns a context to run generate in."""
        from peft import PeftModel

        if adapter is None:
            self.active = None
            self._merge(None)
            return self.model.disable_adapter() if isinstance(self.model, PeftModel) else nullcontext()
        known = self.adapters.get(adapter.name)
        if known is None or known[1] != adapter.path:
            check_adapter(adapter)
            self._merge(None)  # the base weights back in place before peft adds or deletes a slot
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
        slot, self.active = self.adapters[adapter.name]
        if self.merged is not None and (not merge or self.merged[0] != slot):
            self._merge(None)  # every LoRA layer back in the model before peft switches their slot
        self.model.set_adapter(slot)
        if not merge:
            return nullcontext()
        self._merge(slot)
        return nullcontext()  # generate runs `generator`: the base model, the slot's LoRA layers out of it

    def _merge(self, slot: Optional[str]) -> None:
        """Put base + the deltas of peft slot `slot` into the adapted layers (None: the base weights).

        While merged, each adapted layer's plain base layer stands in the model in place of peft's
        LoRA wrapper: generation then runs exactly the base model's modules (the wrappers' Python
        calls, 7 per block, cost a round ~6% of the base model's speed, BENCHMARKS.md)."""
        import torch
        from peft.tuners.lora import LoraLayer

        if self.merged is not None and self.merged[0] == slot:
            return
        if self.merged is not None:
            for parent, name, layer, weight in self.merged[1]:
                layer.get_base_layer().weight = weight
                setattr(parent, name, layer)
            self.merged = None
        if slot is None:
            return
        swapped = []
        with torch.no_grad():
            for path, layer in list(self.model.named_modules()):
                if isinstance(layer, LoraLayer) and (slot in layer.lora_A or slot in layer.lora_embedding_A):
                    base = layer.get_base_layer()
                    # A new Parameter, not an in-place edit: a tied weight (lm_head = embed_tokens)
                    # keeps its base values in the layers the adapter does not touch.
                    weight = base.weight
                    delta = cast(Any, layer).get_delta_weight(slot)  # on each LoRA layer kind, not the mixin
                    base.weight = torch.nn.Parameter(weight + delta.to(weight.dtype),
                                                     requires_grad=False)
                    parent_path, _, name = path.rpartition(".")
                    parent = self.model.get_submodule(parent_path)
                    setattr(parent, name, base)
                    swapped.append((parent, name, layer, weight))
        self.merged = (slot, swapped)

    @property
    def generator(self) -> Any:
        """The model to generate with: while an adapter is merged, the transformers model itself (no
        PeftModel around it; layers other adapters wrap skip their LoRA, the merged slot is active)."""
        return self.base if self.merged is not None else self.model

    def to(self, device: Any) -> None:
        import torch

        self._merge(None)  # the base weights kept aside would not move with the model
        self.model.to(device)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class HFEngine:
    """transformers `generate`: batched, left-padded, behaviour log-probs, peft LoRA hot-swap."""
    name = "hf"

    def __init__(self, cfg: ModelConfig, hf: HFModel) -> None:
        self.cfg = cfg
        self.hf = hf
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
            with self.hf.use(adapter, self.cfg.hf_merge_adapter), torch.inference_mode():
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
                        g.adapter_path = self.hf.active
                        results[i] = g
        return results  # type: ignore[return-value]

    def _generate_chunk(self, batch: list[list[int]]) -> list[Generation]:
        import torch
        from transformers import StoppingCriteriaList

        cfg, hf = self.cfg, self.hf
        width = max(len(x) for x in batch)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=hf.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=hf.device)
        recorder = _behaviour_logprob_processor(cfg.temperature, cfg.top_p)
        # The recorder already returns the behaviour distribution: generate must not warp it again.
        sampling: dict[str, Any] = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if cfg.temperature > 0 else {}
        stopper = _stop_string_criteria(self.tokenizer, cfg.stop, width, hf.eos_ids) if cfg.stop else None
        if stopper is not None:
            sampling["stopping_criteria"] = StoppingCriteriaList([stopper])
        seqs = hf.generator.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                 logits_processor=[recorder], eos_token_id=hf.eos_ids, pad_token_id=pad,
                                 **sampling)
        new = seqs[:, width:]
        logprobs = recorder.finish(new).tolist()
        eos = torch.isin(new, torch.tensor(hf.eos_ids, device=new.device))
        out = []
        for row, x in enumerate(batch):
            hits = eos[row].nonzero()
            n = int(hits[0]) + 1 if len(hits) else new.shape[1]
            stop_end = None if stopper is None else stopper.ends.get(row)
            stopped = stop_end is not None
            if stop_end is not None:
                n = min(n, stop_end)
            tokens = new[row, :n].tolist()
            out.append(Generation(text=str(self.tokenizer.decode(tokens, skip_special_tokens=True)),
                                  prompt_tokens=len(x), completion_tokens=n,
                                  truncated=not len(hits) and not stopped, logprobs=logprobs[row][:n],
                                  token_ids=tokens))
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
        engines.forget(lambda e: getattr(e, "hf", None) is self.hf)
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


