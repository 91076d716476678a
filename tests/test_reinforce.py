"""REINFORCE loss and gradients on tiny tensors equal a hand computation; prompt and padding add nothing."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from unstable_dask.reinforce import ReinforceArgs, Tokens, tokenize, update

V = 5


class Bigram(torch.nn.Module):
    """logits[t] = W[x_t]: the prediction at t depends on token t only, so the hand math is short."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W = torch.nn.Parameter(torch.randn(V, V, generator=g, dtype=torch.float64))

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.W[input_ids])


def batch(pad=0):
    # sample 0: prompt [1, 2], completion [3, 4]; sample 1: prompt [0], completion [2, 2, 1]
    ids = torch.tensor([[1, 2, 3, 4, pad], [0, 2, 2, 1, pad], [4, 1, 0, pad, pad]])
    att = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    lm = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 0], [0, 0, 1, 0, 0]])
    return Tokens(ids, att, lm, torch.tensor([1, 0, 1]), torch.zeros(3, dtype=torch.bool))


ADV = torch.tensor([1.5, -0.5, 2.0])
COMPLETIONS = [(1, [3, 4]), (0, [2, 2, 1]), (1, [0])]  # (last prompt index, completion tokens)
PROMPTS = [[1, 2], [0], [4, 1]]


def hand(W, normalization, L=4):
    """loss = -mean_i A_i * s_i, s_i = sum_t log softmax(W[prev])[tok] / norm; dL/dW analytic."""
    W = W.detach().double()
    n = len(ADV)
    loss, grad = 0.0, torch.zeros_like(W)
    for i, (p, comp) in enumerate(zip(PROMPTS, [c for _, c in COMPLETIONS])):
        seq = p + comp
        norm = L if normalization == "constant" else len(comp)
        s = 0.0
        for t in range(len(p), len(seq)):
            prev, tok = seq[t - 1], seq[t]
            probs = torch.softmax(W[prev], -1)
            s += math.log(probs[tok])
            onehot = torch.zeros(V, dtype=torch.float64)
            onehot[tok] = 1
            grad[prev] += -ADV[i].item() / n / norm * (onehot - probs)
        loss += -ADV[i].item() * s / norm / n
    return loss, grad


@pytest.mark.parametrize("normalization", ["constant", "token-mean"])
@pytest.mark.parametrize("mini", [1, 2, 3])
def test_loss_and_grads_equal_hand_computation(normalization, mini):
    model = Bigram()
    w0 = model.W.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    args = ReinforceArgs(mini_batch_size=mini, grad_clip=1e9, normalization=normalization, max_generation_len=4)
    m = update(model, opt, batch(), ADV, args, torch.device("cpu"))
    loss, grad = hand(w0, normalization)
    assert m["loss"] == pytest.approx(loss, abs=1e-12)
    torch.testing.assert_close(model.W.grad, grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(model.W.detach(), w0 - grad, rtol=0, atol=1e-12)  # one SGD step, lr 1


def test_prompt_and_padding_contribute_nothing():
    """Changing pad ids, or what the prompt says about its own tokens, leaves loss and grads unchanged."""
    def run(tokens):
        model = Bigram()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        m = update(model, opt, tokens, ADV, ReinforceArgs(mini_batch_size=3, grad_clip=1e9, max_generation_len=4),
                   torch.device("cpu"))
        return m["loss"], model.W.grad.clone()

    l0, g0 = run(batch(pad=0))
    l1, g1 = run(batch(pad=3))  # other pad ids
    assert l0 == l1 and torch.equal(g0, g1)
    # Rows of W used only to predict prompt tokens or padding get exactly zero gradient:
    # W[x_t] is used at t = every position; only positions predicting a completion token count.
    used = {seq_prev for (p, comp), pr in zip(COMPLETIONS, PROMPTS)
            for seq_prev in (pr + comp)[len(pr) - 1:-1]}
    for row in range(V):
        if row not in used:
            assert torch.count_nonzero(g0[row]) == 0


def test_grad_clip_bounds_the_update():
    model = Bigram()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    m = update(model, opt, batch(), ADV * 100, ReinforceArgs(mini_batch_size=3, grad_clip=0.2, max_generation_len=4),
               torch.device("cpu"))
    assert m["grad_norm"] > 0.2
    assert model.W.grad.norm().item() == pytest.approx(0.2, rel=1e-6)


def test_tokenize_masks_prompt_and_padding_and_appends_eos():
    from unstable_dask.models import resolve_model
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny"))
    prompts = ["<|im_start|>user\nPick a number<|im_end|>\n<|im_start|>assistant\n", "hi"]
    completions = ["I pick [0]", "a much longer completion text here"]
    t = tokenize(tok, prompts, completions, [True, False], None, tok.pad_token_id)
    n_p = len(tok(prompts[0], add_special_tokens=False)["input_ids"])
    n_c = len(tok(completions[0], add_special_tokens=False)["input_ids"]) + 1
    assert t.loss_mask[0, :n_p].sum() == 0 and t.loss_mask[0].sum() == n_c
    assert t.input_ids[0, n_p + n_c - 1] == tok.eos_token_id
    assert t.attention_mask[0].sum() == n_p + n_c and t.loss_mask[0, n_p + n_c:].sum() == 0
    assert int(t.last_prompt[0]) == n_p - 1
    cut = tokenize(tok, prompts, completions, [True, False], 8, tok.pad_token_id)
    assert cut.attention_mask.sum(-1).max() <= 8 and bool(cut.truncated[0])
    assert cut.loss_mask[1].sum() == min(8 - 1, len(tok(completions[1], add_special_tokens=False)["input_ids"]))
