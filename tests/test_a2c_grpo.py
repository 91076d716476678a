"""A2C's GAE and GRPO's clipped-ratio / k3-KL loss equal plain hand computations on tiny inputs."""
from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch

import test_reinforce
from test_reinforce import ADV, PROMPTS, Bigram, batch, hand
from unstable_dask.a2c import gae, turn_rewards
from unstable_dask.grpo import GRPOArgs, behaviour_logprobs, update

CPU = torch.device("cpu")
COMPLETIONS = [tokens for _, tokens in test_reinforce.COMPLETIONS]


# ---------------------------------------------------------------- A2C: rewards per turn and GAE

def test_gae_equals_the_discounted_sum_of_td_errors():
    """A_t = sum_l (gamma lambda)^l delta_{t+l} per seat, rows given shuffled and interleaved."""
    rng = random.Random(3)
    rows = []  # (seat, turn, reward, value); turns are the game's, so a seat's are not consecutive
    for seat in [("g1", 0), ("g1", 1), ("g2", 0), ("g3", 1)]:
        for k in range(rng.randint(1, 6)):
            rows.append((seat, 2 * k + seat[1], rng.uniform(-1, 1), rng.uniform(-1, 1)))
    rng.shuffle(rows)
    gamma, lam = 0.9, 0.7
    adv, ret = gae([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows], gamma, lam)
    for i, (seat, turn, _, value) in enumerate(rows):
        later = sorted((r for r in rows if r[0] == seat and r[1] >= turn), key=lambda r: r[1])
        vals = [r[3] for r in later] + [0.0]  # V after the seat's last turn is 0
        deltas = [r[2] + gamma * vals[j + 1] - vals[j] for j, r in enumerate(later)]
        want = sum((gamma * lam) ** j * d for j, d in enumerate(deltas))
        assert adv[i] == pytest.approx(want, abs=1e-12)
        assert ret[i] == pytest.approx(want + value, abs=1e-12)


def test_turn_rewards_pay_the_game_reward_once_at_the_seat_s_last_turn():
    seats = [("g", 0)] * 3 + [("g", 1)] * 2
    turns = [4, 0, 2, 1, 3]
    final = [1.0, 1.0, 1.0, -1.0, -1.0]
    step = [1.0, 2.5, 1.0, -1.0, -2.0]  # format bonus +1.5 on turn 0, invalid-move penalty -1 on turn 3
    assert turn_rewards(seats, turns, final, step) == [1.0, 1.5, 0.0, 0.0, -2.0]


def test_a2c_without_critic_or_shaping_is_reinforce_on_the_game_reward():
    """gamma = lambda = 1, V = 0 and no step transforms: every turn's advantage is the final reward."""
    seats, turns = [("g", 0)] * 3 + [("g", 1)] * 2, [0, 2, 4, 1, 3]
    final = [0.5, 0.5, 0.5, -0.5, -0.5]
    adv, _ = gae(seats, turns, turn_rewards(seats, turns, final, final), [0.0] * 5, 1.0, 1.0)
    assert adv == final


# ---------------------------------------------------------------- GRPO

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


def _steps():
    """(sample, prev token, token) for every completion token, in the loss mask's order."""
    for i, (p, comp) in enumerate(zip(PROMPTS, COMPLETIONS)):
        seq = p + comp
        for t in range(len(p), len(seq)):
            yield i, seq[t - 1], seq[t]


def _logp(W, prev, tok):
    return torch.log_softmax(W[prev], -1)[tok].item()


def grpo_hand(W, base, ratios, eps, kl_coef, L=4):
    """Loss and dL/dW token by token: ratio r given per token (None = on-policy, r = 1)."""
    n = len(ADV)
    loss, grad = 0.0, torch.zeros_like(W)
    for (i, prev, tok), r in zip(_steps(), ratios):
        A = ADV[i].item()
        r = 1.0 if r is None else r
        obj = min(r * A, min(max(r, 1 - eps), 1 + eps) * A)
        # The clipped branch is the minimum (and constant) only outside the range on the side
        # where clipping lowers the objective; elsewhere d obj / d logp = r * A.
        d_obj = 0.0 if (A > 0 and r > 1 + eps) or (A < 0 and r < 1 - eps) else r * A
        lp, ref = _logp(W, prev, tok), _logp(base, prev, tok)
        k3 = math.exp(ref - lp) - (ref - lp) - 1
        d_k3 = 1 - math.exp(ref - lp)
        loss += -(obj - kl_coef * k3) / L / n
        probs = torch.softmax(W[prev], -1)
        onehot = torch.zeros(W.shape[1], dtype=W.dtype)
        onehot[tok] = 1
        grad[prev] += -(d_obj - kl_coef * d_k3) / L / n * (onehot - probs)
    return loss, grad


# Behaviour ratios per completion token: sample 0 (A > 0) has one token clipped above, sample 1
# (A < 0) one clipped below and one above the range (unclipped: the minimum), sample 2 on-policy.
RATIOS = [1.5, 0.9, 0.5, 1.05, 1.3, None]


def _old_logprobs(W):
    old = [[], [], None]
    for (i, prev, tok), r in zip(_steps(), RATIOS):
        if r is not None:
            old[i].append(_logp(W, prev, tok) - math.log(r))
    return old


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("mini", [1, 3])
def test_grpo_loss_and_grads_equal_hand_computation(kl_coef, mini):
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    tokens = batch()
    old, has_old = behaviour_logprobs(tokens, _old_logprobs(w0))
    assert has_old.tolist() == [True, True, False]
    args = GRPOArgs(mini_batch_size=mini, grad_clip=1e9, normalization="constant", max_generation_len=4,
                    clip_ratio=0.2, kl_coef=kl_coef)
    m = update(model, torch.optim.SGD(model.parameters(), lr=0.0), tokens, ADV, old, has_old, args, CPU)
    loss, grad = grpo_hand(w0, model.base, RATIOS, 0.2, kl_coef)
    assert m["loss"] == pytest.approx(loss, abs=1e-6)  # behaviour logprobs are stored as float32
    torch.testing.assert_close(model.W.grad, grad, rtol=0, atol=1e-6)
    assert m["clip_frac"] == pytest.approx(3 / 6)
    assert (m["kl"] > 0) == (kl_coef > 0)


def test_grpo_on_policy_without_kl_is_reinforce():
    """No behaviour logprobs: ratio 1 with the REINFORCE gradient, token for token."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    tokens = batch()
    old, has_old = behaviour_logprobs(tokens, [None, None, None])
    args = GRPOArgs(mini_batch_size=3, grad_clip=1e9, normalization="token-mean", max_generation_len=4)
    update(model, torch.optim.SGD(model.parameters(), lr=0.0), tokens, ADV, old, has_old, args, CPU)
    torch.testing.assert_close(model.W.grad, hand(w0, "token-mean")[1], rtol=0, atol=1e-12)


def test_behaviour_logprobs_are_used_only_where_they_line_up():
    tokens = batch()
    old, ok = behaviour_logprobs(tokens, [[-1.0, -2.0], [-0.5], [-3.0]])  # sample 1 has 3 tokens, not 1
    assert ok.tolist() == [True, False, True]
    assert old[0].tolist() == [0.0, -1.0, -2.0, 0.0] and old[2].tolist() == [0.0, -3.0, 0.0, 0.0]
    tokens.truncated[0] = True  # a cut sample's stored logprobs no longer describe what we train on
    assert behaviour_logprobs(tokens, [[-1.0, -2.0], None, [-3.0]])[1].tolist() == [False, False, True]
