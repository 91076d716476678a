"""learn.share_prefix: a micro-batch's common leading tokens are forwarded once and every row attends
to their keys and values. The update is the one without sharing (log-probs, loss, every LoRA
gradient) for each algorithm, over several rows, several completion tokens and rows of different
lengths; a step's rows are ordered by content only where that computes fewer positions; under
gradient checkpointing (where transformers drops the cache) nothing is shared."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from transformers import AutoTokenizer

from unstable_dask.inference.engine import encode_prompts
from unstable_dask.inference.weights import resolve_model
from unstable_dask.jobfile import validate_job
from unstable_dask.learn import passes
from unstable_dask.learn.tokens import tokenize
from unstable_dask.learn.trainer import Trainer

RULES = ("<|im_start|>system\nYou play a two-player game.<|im_end|>\n<|im_start|>user\nYou are Player {seat} in "
         "Tic Tac Toe. Your goal is to win three in a row on the board. As Player {seat}, you mark '{mark}'.\n")
HISTORY = ["Player 0 placed O in cell 4.\n", "Player 1 placed X in cell 0.\n", "Player 0 placed O in cell 8.\n"]


def prompt(seat: int, moves: int, free: str) -> str:
    return (RULES.format(seat=seat, mark="OX"[seat]) + "".join(HISTORY[:moves])
            + f"Available Moves: {free}\nAnswer with your move only.<|im_end|>\n<|im_start|>assistant\n")


# Two seats, histories of 0-3 moves: rows share the system text, a seat's rows share its rules, and
# the lengths differ, so ordering by length and by content cut different micro-batches.
PROMPTS = [prompt(s, m, free) for s in (0, 1) for m, free in ((0, "[0], [1], [2]"), (1, "[1], [2]"),
                                                               (2, "[2], [3], [5], [6]"), (3, "[3]"))]
COMPLETIONS = ["[1]", "[2] is best", "[5]", "[3]", "[0]", "[1] then [2]", "[6]", "[3]."]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model("builtin:tiny"))


def table(tok) -> pa.Table:
    n = len(PROMPTS)
    completions = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in COMPLETIONS]
    fed = [len(ids) for ids in encode_prompts(tok, PROMPTS, 10**6)]
    return pa.table({
        "round": [0] * n, "game_id": [f"g{i}" for i in range(n)], "turn": [0] * n, "pid": [i // 4 for i in range(n)],
        "env_id": ["TicTacToe-v0"] * n, "group_id": [f"s{i % 4}" for i in range(n)], "prompt": PROMPTS,
        "prompt_tokens": fed, "completion_token_ids": completions,
        "logprobs": [[-1.0 - 0.01 * t for t in range(len(c))] for c in completions],
        "advantage": [1.0, -0.5, 0.25, -1.0, 0.75, -0.25, 0.5, -0.75], "temperature": [1.0] * n,
        "top_p": [1.0] * n, "final_reward": [0.0] * n, "step_reward": [0.0] * n})


def job_for(tmp_path, **learn):
    cfg = dict(batch_size=8, mini_batch_size=4, lr=1e-3, grad_clip=1e9, gradient_checkpointing=False,
               dtype="float32", device="cpu") | learn
    return validate_job({"run": {"name": "share", "lake": str(tmp_path / "lake")}, "learn": cfg,
                         "round": {"group_size": 2}, "model": {"lora": {"rank": 4, "alpha": 8}, "max_new_tokens": 64}})


def update(job, rows):
    """One update from a fresh adapter (seeded alike): its metrics and its last step's LoRA gradients."""
    torch.manual_seed(0)
    trainer = Trainer(job, None, torch.device("cpu"))
    m = trainer.update(rows)
    named = list(trainer.policy.named_parameters())
    grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
    return m, grads


@pytest.mark.parametrize("algorithm, extra", [
    ("reinforce", dict(normalization="token-mean")),
    ("grpo", dict(ppo_epochs=2)),  # several optimizer steps: pi_old from a first pass
    ("gspo", dict(kl_coef=0.1)),  # the KL's reference pass shares too
])
def test_sharing_the_prefix_leaves_the_update_unchanged(tok, tmp_path, monkeypatch, algorithm, extra):
    rows = table(tok)
    seen = []
    count = passes.shared_prefix
    monkeypatch.setattr(passes, "shared_prefix", lambda *a: seen.append(count(*a)) or seen[-1])
    on, g_on = update(job_for(tmp_path, algorithm=algorithm, share_prefix=True, **extra), rows)
    off, g_off = update(job_for(tmp_path, algorithm=algorithm, share_prefix=False, **extra), rows)
    assert max(seen) > 40  # a seat's rules were forwarded once
    assert g_on.keys() == g_off.keys() and any(bool(g.any()) for g in g_on.values())
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-4, atol=1e-6, msg=name)
    for key in ("loss", "pg_loss", "logp_mean"):
        if key in on:
            assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key


def test_the_plan_orders_rows_by_content_only_where_it_computes_fewer_positions(tok):
    prompts = encode_prompts(tok, PROMPTS, 10**6)
    completions = [tok(c, add_special_tokens=False)["input_ids"] for c in COMPLETIONS]
    tokens = tokenize(prompts, completions, None, tok.pad_token_id or 0)
    lengths = tokens.attention_mask.sum(-1).tolist()
    (by_length,), = passes.plan(lengths, None, 4, 1, seed=3)
    (shared,), = passes.plan(lengths, None, 4, 1, seed=3, share=tokens)
    assert sorted(i for mb in shared for i in mb) == list(range(len(PROMPTS)))
    # by length, each micro-batch mixes the seats (common prefix: the system text and "Player ");
    # by content, each holds one seat's rows, which share their rules too
    assert sorted(sorted(mb) for mb in shared) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert passes.positions(tokens, shared) < passes.positions(tokens, by_length)
    # rows that share nothing beyond what length-sorting already gives keep the length order
    alone = tokenize([[7, 1, 2], [8, 1, 2, 3], [9, 1]], [[5], [6], [4]], None, 0)
    (kept,), = passes.plan([4, 5, 3], None, 2, 1, seed=0, share=alone)
    assert kept == passes.plan([4, 5, 3], None, 2, 1, seed=0)[0][0]


def test_under_gradient_checkpointing_nothing_is_shared(tok, tmp_path):
    """transformers drops the key/value cache in checkpointed layers: sharing there would cut each
    row's prefix off. The forward pass falls back to whole rows."""
    job = job_for(tmp_path, algorithm="reinforce", gradient_checkpointing=True)
    assert not job.learn.shares_prefix()
    trainer = Trainer(job, None, torch.device("cpu"))
    prompts = encode_prompts(tok, PROMPTS[:4], 10**6)
    completions = [tok(c, add_special_tokens=False)["input_ids"] for c in COMPLETIONS[:4]]
    tokens = tokenize(prompts, completions, None, tok.pad_token_id or 0)
    trainer.policy.train()
    ones = [1.0] * 4
    with torch.no_grad():
        shared = passes.forward(trainer.policy, tokens, [0, 1, 2, 3], ones, ones, torch.device("cpu"), share=True)
        whole = passes.forward(trainer.policy, tokens, [0, 1, 2, 3], ones, ones, torch.device("cpu"), share=False)
    torch.testing.assert_close(shared.logp, whole.logp, rtol=0, atol=0)
