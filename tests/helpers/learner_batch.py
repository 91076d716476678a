"""The learner tests' shared batch: a Bigram model small enough that every loss and gradient has a
hand computation (REINFORCE's `hand`, GRPO's `grpo_hand`), the three-sample batch they score, and
the Batch the trainer would build for it."""
from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import torch

from unstable_dask.learn.algorithms import Batch
from unstable_dask.learn.tokens import Tokens, behaviour_logprobs

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
    # sample 0: prompt [1, 2], completion [3, 4]; sample 1: prompt [0], completion [2, 2, 1];
    # sample 2: prompt [4, 2], completion [0] (it shares W[2] with the others: one step moves all)
    ids = torch.tensor([[1, 2, 3, 4, pad], [0, 2, 2, 1, pad], [4, 2, 0, pad, pad]])
    att = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    lm = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 0], [0, 0, 1, 0, 0]])
    return Tokens(ids, att, lm, torch.tensor([1, 0, 1]), torch.zeros(3, dtype=torch.bool))


ADV = torch.tensor([1.5, -0.5, 2.0], dtype=torch.float64)
COMPLETIONS = [(1, [3, 4]), (0, [2, 2, 1]), (1, [0])]  # (last prompt index, completion tokens)
COMPLETION_TOKENS = [tokens for _, tokens in COMPLETIONS]
PROMPTS = [[1, 2], [0], [4, 2]]
CPU = torch.device("cpu")
TOL = dict(rtol=0, atol=1e-6)  # the learner's log-probs are float32 (sampling.py)


def models(model, lr=0.0):
    return SimpleNamespace(policy=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                           critic=None, critic_optimizer=None)


def as_batch(tokens, adv=ADV, temperature=1.0, top_p=1.0, logprobs=(None, None, None), **extra):
    """The Batch the trainer would build for these tokens (one round's sampling settings)."""
    n = tokens.input_ids.shape[0]
    behaviour, known = behaviour_logprobs(tokens, list(logprobs))
    seats = extra.pop("seats", [(0, f"g{i}", 0) for i in range(n)])
    return Batch(tokens=tokens, advantages=adv, temperature=[temperature] * n, top_p=[top_p] * n,
                 behaviour=behaviour, known=known, seats=seats, turns=extra.pop("turns", [0] * n),
                 final_reward=extra.pop("final_reward", [0.0] * n), step_reward=extra.pop("step_reward", [0.0] * n),
                 **extra)


def hand(W, normalization, L=4, adv=ADV):
    """loss = -mean_i A_i * s_i, s_i = sum_t log softmax(W[prev])[tok] / norm_i ("constant": L;
    "seq-mean-token-mean": the completion's length); "token-mean": -sum_{i,t} A_i log p / all
    completion tokens. dL/dW analytic."""
    W = W.detach().double()
    n = len(adv)
    total = sum(len(c) for _, c in COMPLETIONS)
    loss, grad = 0.0, torch.zeros_like(W)
    for i, (p, comp) in enumerate(zip(PROMPTS, [c for _, c in COMPLETIONS])):
        seq = p + comp
        norm = {"constant": L, "seq-mean-token-mean": len(comp), "token-mean": total / n}[normalization]
        s = 0.0
        for t in range(len(p), len(seq)):
            prev, tok = seq[t - 1], seq[t]
            probs = torch.softmax(W[prev], -1)
            s += math.log(probs[tok])
            onehot = torch.zeros(V, dtype=torch.float64)
            onehot[tok] = 1
            grad[prev] += -float(adv[i]) / n / norm * (onehot - probs)
        loss += -float(adv[i]) * s / norm / n
    return loss, grad



class BigramWithBase(Bigram):
    """A Bigram whose `disable_adapter()` swaps in frozen base weights, as peft's does."""

    def __init__(self):
        super().__init__(seed=0)
        self.base = torch.randn(self.W.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        self._base_on = False

    @contextlib.contextmanager
    def disable_adapter(self):
        self._base_on = True
        try:
            yield
        finally:
            self._base_on = False

    def forward(self, input_ids, attention_mask):
        out = super().forward(input_ids, attention_mask)
        if self._base_on:
            out.logits = self.base[input_ids]
        return out


def completion_steps():
    """(sample, prev token, token) for every completion token, in the loss mask's order."""
    for i, (p, comp) in enumerate(zip(PROMPTS, COMPLETION_TOKENS)):
        seq = p + comp
        for t in range(len(p), len(seq)):
            yield i, seq[t - 1], seq[t]


def token_logp(W, prev, tok):
    return torch.log_softmax(W[prev], -1)[tok].item()


def grpo_hand(W, base, old, eps, kl_coef, rows=(0, 1, 2), L=4, weights=None, c=3.0):
    """Loss, dL/dW and the tokens whose gradient the clip removed, token by token over the samples
    `rows` (one optimizer step's mini-batch), written from verl's compute_policy_loss_vanilla:
    `old` = log pi_old per completion token, `weights` the IS weights (default 1), c the dual clip.
    L: the divisor of a sample's token sum ("constant"'s max_generation_len), or "seq" for the
    sample's own completion length ("seq-mean-token-mean")."""
    weights = weights or [1.0] * len(old)
    loss, grad, acting = 0.0, torch.zeros_like(W), 0
    for (i, prev, tok), lp_old, w in zip(completion_steps(), old, weights):
        if i not in rows:
            continue
        A = ADV[i].item()
        lp, ref = token_logp(W, prev, tok), token_logp(base, prev, tok)
        r = math.exp(lp - lp_old)
        l1, l2 = -A * r, -A * min(max(r, 1 - eps), 1 + eps)
        pg = max(l1, l2)
        clipped = l2 > l1  # the clipped branch is the max and constant: no gradient
        if A < 0 and c > 0 and pg > -A * c:
            pg, clipped = -A * c, True
        d_pg = 0.0 if clipped else -A * r  # d pg / d log pi
        acting += clipped
        k3 = math.exp(ref - lp) - (ref - lp) - 1
        d_k3 = 1 - math.exp(ref - lp)
        norm = len(COMPLETION_TOKENS[i]) if L == "seq" else L
        loss += (w * pg + kl_coef * k3) / norm / len(rows)
        probs = torch.softmax(W[prev], -1)
        onehot = torch.zeros(W.shape[1], dtype=W.dtype)
        onehot[tok] = 1
        grad[prev] += (w * d_pg + kl_coef * d_k3) / norm / len(rows) * (onehot - probs)
    return loss, grad, acting


# pi_old / pi_b per completion token (the engine sampled from another distribution): sample 0 has
# weights 1.5 and 0.9, sample 1 0.5, 1.05 and 1.3, sample 2 has no stored log-probs (weight 1).
RATIOS = [1.5, 0.9, 0.5, 1.05, 1.3, None]


def old_logprobs(W):
    old = [[], [], None]
    for (i, prev, tok), r in zip(completion_steps(), RATIOS):
        if r is not None:
            old[i].append(token_logp(W, prev, tok) - math.log(r))
    return old


