"""learn.mask_after_action: the completion tokens after the move give no gradient and count in no
normaliser, whatever the algorithm (the trainer cuts them where it builds a batch), and a
completion without a move keeps every token."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from transformers import AutoTokenizer

from unstable_dask.inference.engine import encode_prompts
from unstable_dask.inference.weights import resolve_model
from unstable_dask.jobfile import validate_job
from unstable_dask.learn.tokens import through_action
from unstable_dask.learn.trainer import Trainer

PROMPT = ("<|im_start|>user\nAvailable Moves: [0], [1], [2], [3], [4]\nAnswer with your move only.<|im_end|>\n"
          "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model("builtin:tiny"))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def job_for(tmp_path, algorithm="reinforce", **learn):
    cfg = dict(algorithm=algorithm, batch_size=8, mini_batch_size=8, lr=1e-3, grad_clip=1e9,
               gradient_checkpointing=False, normalization="token-mean") | learn
    return validate_job({"run": {"name": "after-action", "lake": str(tmp_path / "lake")}, "learn": cfg,
                         "round": {"group_size": 2}, "model": {"lora": {"rank": 4, "alpha": 8}, "max_new_tokens": 64}})


def table(tok, completions, advantages, prompt_text=PROMPT, env_id="TicTacToe-v0"):
    """Batch-query rows of one prompt: the engine's completion ids, made-up engine log-probs (one
    per token: the cut must keep them usable), groups of two rows (for GRPO / GSPO)."""
    n = len(completions)
    (prompt,) = encode_prompts(tok, [prompt_text], 10**6)
    return pa.table({
        "round": [0] * n, "game_id": [f"g{i}" for i in range(n)], "turn": [0] * n, "pid": [0] * n,
        "env_id": [env_id] * n, "group_id": [f"s{i // 2}" for i in range(n)], "prompt": [prompt_text] * n,
        "prompt_tokens": [len(prompt)] * n,
        "completion_token_ids": [list(c) for c in completions],
        "logprobs": [[-1.0 - 0.01 * t for t in range(len(c))] for c in completions],
        "advantage": advantages, "temperature": [1.0] * n, "top_p": [1.0] * n,
        "final_reward": [0.0] * n, "step_reward": advantages})


def lora_grads(job, rows):
    """The gradient of one update's loss w.r.t. the LoRA weights (a fresh adapter, seeded alike),
    and the update's metrics."""
    trainer = Trainer(job, None, torch.device("cpu"))
    m = trainer.update(rows)
    grads = {n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}
    assert grads and any(bool(g.any()) for g in grads.values())
    return grads, m


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7)


def differ(a, b):
    return any(not torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-7) for n in a)


def test_tokens_after_the_move_give_no_gradient(tmp_path, tok):
    """The update with the option on is the update on the completions cut right after the move's
    token by hand, and not the update on the whole completions."""
    eos = [tok.eos_token_id]
    moves = [ids(tok, "[4]"), ids(tok, "I pick [2]"), ids(tok, "[1]")]
    noise = [ids(tok, " and then some noise") + eos, ids(tok, " because it is the best of them all.") + eos, eos]
    full = table(tok, [m + x for m, x in zip(moves, noise)], [1.5, -0.5, 2.0])
    cut = table(tok, moves, [1.5, -0.5, 2.0])
    on, m_on = lora_grads(job_for(tmp_path, mask_after_action=True), full)
    by_hand, m_cut = lora_grads(job_for(tmp_path), cut)
    off, _ = lora_grads(job_for(tmp_path), full)
    assert_same(on, by_hand)
    assert differ(on, off)
    assert m_on["train_tokens"] == m_cut["train_tokens"] == sum(map(len, moves))
    assert m_on["loss"] == pytest.approx(m_cut["loss"], rel=1e-5)


def test_a_completion_without_a_move_keeps_every_token(tmp_path, tok):
    """An invalid move (no `[...]`, no box) is trained on whole: that is what its penalty acts on;
    so is a move with nothing after it."""
    eos = [tok.eos_token_id]
    completions = [ids(tok, "I do not know what to play here") + eos, ids(tok, "[3]"), ids(tok, "[] [ 1 2") + eos]
    trainer = Trainer(job_for(tmp_path, mask_after_action=True), None, torch.device("cpu"))
    batch = trainer.batch(table(tok, completions, [1.0, -1.0, 0.5]))
    assert batch.tokens.loss_mask.sum(-1).tolist() == [len(c) for c in completions]
    assert batch.known.tolist() == [True, True, True]  # the engine's log-probs still match the tokens


@pytest.mark.parametrize("algorithm", ["reinforce", "grpo", "gspo"])
def test_many_rows_over_several_micro_batches(tmp_path, tok, algorithm):
    """Six rows whose moves end at different tokens, two rows a micro-batch, token-mean over the
    whole step: masking per micro-batch, or a normaliser that still counted the cut tokens, would
    give another gradient than the rows cut by hand."""
    eos = [tok.eos_token_id]
    moves = [ids(tok, "[0]"), ids(tok, "ok [1]"), ids(tok, "I will play [2]"), ids(tok, "[3]"),
             ids(tok, "The best move is [4]"), ids(tok, "no move at all")]
    noise = [ids(tok, " then a long tail of words that follow it") + eos, eos, ids(tok, " now.") + eos,
             ids(tok, " [4] and a second bracket") + eos, [], []]
    advantages = [1.0, -1.0, 0.5, -0.25, 2.0, -2.0]
    full = table(tok, [m + x for m, x in zip(moves, noise)], advantages)
    cut = table(tok, moves, advantages)
    keys = dict(batch_size=6, mini_batch_size=2)
    on, m_on = lora_grads(job_for(tmp_path, algorithm, mask_after_action=True, **keys), full)
    by_hand, m_cut = lora_grads(job_for(tmp_path, algorithm, **keys), cut)
    off, _ = lora_grads(job_for(tmp_path, algorithm, **keys), full)
    assert_same(on, by_hand)
    assert differ(on, off)
    assert m_on["train_tokens"] == m_cut["train_tokens"] == sum(map(len, moves))


def test_a_move_split_over_tokens_keeps_the_token_that_closes_it(tok):
    """The engine's ids need not be the tokenizer's own split: "[" "4" "]." (the closing token
    carries more text), "[" "3" "][" (it opens the next bracket too), " \\" "boxed" "{" "4" "}." after
    a bracket in the reasoning (the box is the move the round read, not the first bracket)."""
    eos = tok.eos_token_id
    t = tok.convert_tokens_to_ids
    assert tok.decode([t("].")]) == "]." and tok.decode([t("][")]) == "]["
    split = [t("["), t("4"), t("].")]
    double = [t("["), t("3"), t("]["), t("4"), t("]")]
    boxed = ids(tok, "a [3] b \\boxed{4}.")
    tails = [ids(tok, " and more"), [eos], ids(tok, " x") + [eos]]
    completions = [split + tails[0], double + tails[1], boxed + tails[2]]
    logprobs = [[-0.1 * k for k in range(len(c))] for c in completions]
    got, cut = through_action(tok, completions, logprobs[:2] + [None])
    assert got == [split, double[:3], boxed]
    assert cut == [logprobs[0][:3], logprobs[1][:3], None]
    assert through_action(tok, completions[:1], [[-1.0] * 3])[1] == [None]  # log-probs that did not match its tokens


def test_after_a_prefilled_bracket_the_move_ends_at_the_completions_own_bracket(tok):
    """chat-move-prefill writes "[" into the prompt: the completion "4]. and more" holds the rest of
    the move, cut after its "]"; with no prefix the same text holds no move and keeps every token."""
    t = tok.convert_tokens_to_ids
    move = [t("4"), t("].")]
    completion = move + ids(tok, " and more")
    got, _ = through_action(tok, [completion, completion], None, ["[", ""])
    assert got == [move, completion]


@pytest.mark.parametrize("env_id, prefill, kept", [
    ("TicTacToe-v0", False, "[Player 0] [4]"),  # TicTacToe's step reads the first [digit]
    ("SomeOtherEnv-v0", False, "[Player 0]"),  # another env: the first bracket
    ("TicTacToe-v0", True, "4]"),  # chat-move-prefill: the prompt holds the "[" that opens the move
])
def test_the_batch_cuts_where_the_env_read_the_move(tmp_path, tok, env_id, prefill, kept):
    """Trainer.batch cuts each row by its own env's move rule and its prompt's answer prefix, as
    the round read the move."""
    text = ("4] then [Player 1] [5] more" if prefill else "[Player 0] [4] then [5] more")
    completion = ids(tok, text) + [tok.eos_token_id]
    trainer = Trainer(job_for(tmp_path, mask_after_action=True), None, torch.device("cpu"))
    rows = table(tok, [completion, completion], [1.0, -1.0], PROMPT + "[" if prefill else PROMPT, env_id)
    batch = trainer.batch(rows)
    n = batch.tokens.loss_mask.sum(-1).tolist()
    assert n[0] == n[1]
    assert tok.decode(completion[:n[0]]) == kept
