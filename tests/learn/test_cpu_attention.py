"""A bf16 learner on a CPU computes attention in float32 (trainer.fp32_attention): its log-probs are a
bf16 learner's, padding rows and prefix sharing included, and an fp32 learner keeps transformers' own
attention."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from unstable_dask.inference.weights import resolve_model
from unstable_dask.jobfile import validate_job
from unstable_dask.learn import passes
from unstable_dask.learn.tokens import tokenize
from unstable_dask.learn.trainer import CPU_ATTENTION, Trainer

PROMPTS = ["<|im_start|>user\nYou are Player 0. Available Moves: [0], [1], [2]<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nYou are Player 0. Player 1 placed X in cell 4. Available Moves: [0], [1]<|im_end|>\n"
           "<|im_start|>assistant\n",
           "<|im_start|>user\nYou are Player 1.<|im_end|>\n<|im_start|>assistant\n"]
COMPLETIONS = ["[1] because it is free", "[0]", "[2] and then [5] wins"]


def trainer(tmp_path, dtype: str) -> Trainer:
    job = validate_job({"run": {"name": "attn", "lake": str(tmp_path / "lake")}, "model": {"lora": {"rank": 4}},
                        "learn": {"batch_size": 4, "mini_batch_size": 4, "dtype": dtype, "device": "cpu",
                                  "gradient_checkpointing": False}})
    return Trainer(job, None, torch.device("cpu"))


def logps(t: Trainer, rows: list[int], share: bool) -> torch.Tensor:
    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny"))
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    completions = [tok(c, add_special_tokens=False)["input_ids"] for c in COMPLETIONS]
    tokens = tokenize([prompts[i] for i in rows], [completions[i] for i in rows], None, t.pad_id)
    ones = [1.0] * len(rows)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=t.dtype == torch.bfloat16):
        p = passes.forward(t.policy, tokens, list(range(len(rows))), ones, ones, torch.device("cpu"), share)
    return torch.stack([p.logp[i][p.mask[i].bool()].sum() for i in range(len(rows))])


def test_bf16_on_cpu_attends_in_fp32_with_the_padding_masked(tmp_path):
    bf16, fp32 = trainer(tmp_path, "bfloat16"), trainer(tmp_path, "float32")
    assert bf16.policy.get_base_model().config._attn_implementation == CPU_ATTENTION
    assert fp32.policy.get_base_model().config._attn_implementation == "sdpa"
    whole = logps(bf16, [0, 1, 2], share=False)  # rows of three lengths: two of them padded
    alone = torch.stack([logps(bf16, [i], share=False)[0] for i in range(3)])
    reference = logps(fp32, [0, 1, 2], share=False)
    torch.testing.assert_close(whole, alone, rtol=0, atol=0.05)  # bf16 matmuls of other shapes
    torch.testing.assert_close(whole, reference, rtol=0, atol=0.15)  # bf16 against fp32, over 2-9 tokens
    shared = logps(bf16, [0, 1], share=True)  # the two rows of Player 0 share their first tokens
    torch.testing.assert_close(shared, whole[:2], rtol=0, atol=0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_update_steps_with_either_attention(tmp_path, dtype):
    """The gradient reaches the LoRA weights through the fp32 attention (and the stock one)."""
    t = trainer(tmp_path, dtype)
    before = {n: p.detach().clone() for n, p in t.policy.named_parameters() if p.requires_grad}
    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny"))
    tokens = tokenize([tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS],
                      [tok(c, add_special_tokens=False)["input_ids"] for c in COMPLETIONS], None, t.pad_id)
    ones = [1.0] * 3
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=t.dtype == torch.bfloat16):
        p = passes.forward(t.policy, tokens, [0, 1, 2], ones, ones, torch.device("cpu"))
        (-(p.logp * p.mask).sum()).backward()
    t.optimizer.step()
    moved = [n for n, p in t.policy.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("q_proj.lora_B" in n for n in moved) and any("v_proj.lora_B" in n for n in moved)
