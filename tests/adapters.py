"""Shared by the engine tests (hf here, vllm in .venv-vllm): LoRA adapters that change outputs."""
from __future__ import annotations


def random_adapters(base_path: str, tmp_path_factory, n: int = 2) -> list:
    """`n` LoRA adapters on `base_path` with random, non-zero B matrices (a fresh B is zero: a no-op)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from unstable_dask.engines import Adapter
    out = []
    for i in range(n):
        base = AutoModelForCausalLM.from_pretrained(base_path)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        path = tmp_path_factory.mktemp(f"adapter{i}")
        model.save_pretrained(path)
        out.append(Adapter(f"ckpt-{i}", str(path)))
    return out


def sample_prompts(engine) -> list[str]:
    return [engine.chat_prompt("Play tic tac toe. Available Moves: '[0]', '[4]'"),
            engine.chat_prompt("x"),
            engine.chat_prompt("Kuhn Poker: your card is 'K'. " * 8)]


def texts(gens) -> list[str]:
    return [g.text for g in gens]
