"""GSPO's sequence-level clipped ratio and PPO-style epochs (several optimizer steps over one batch)
equal plain hand computations on tiny inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from unstable_dask.inference.sampling import sampling_logprobs
from unstable_dask.learn.algorithms import grpo, gspo

from test_a2c_grpo import BigramWithBase, _logp, _steps, grpo_hand
from test_reinforce import ADV, CPU, TOL, as_batch, batch, hand, models


def _per_sample(values):
    """Per-token values (in _steps() order) as the per-sample lists the lake stores."""
    out = [[], [], []]
    for (i, _, _), v in zip(_steps(), values):
        out[i].append(v)
    return out


def _f32(x: float) -> float:  # the lake stores behaviour log-probs as float32
    return float(np.float32(x))


# ---------------------------------------------------------------- GSPO

def gspo_hand(W, base, old, eps_low, eps_high, kl_coef, L=4):
    """Loss, dL/dW and the clipped sequences: s_i = exp(mean_t(logp - old)), one clip per sequence."""
    n = len(ADV)
    loss, grad, acting = 0.0, torch.zeros_like(W), 0
    for i in range(n):
        toks = [(prev, tok, o) for (j, prev, tok), o in zip(_steps(), old) if j == i]
        A = ADV[i].item()
        s = math.exp(sum(_logp(W, prev, tok) - o for prev, tok, o in toks) / len(toks))
        clip_s = min(max(s, 1 - eps_low), 1 + eps_high)
        clipped = clip_s * A < s * A
        acting += clipped
        # d s / d logp_t = s / |y|: one shared ratio, the length normalisation inside it
        d_obj = 0.0 if clipped else A * s / len(toks)
        loss += -min(s * A, clip_s * A) / n
        for prev, tok, _ in toks:
            lp, ref = _logp(W, prev, tok), _logp(base, prev, tok)
            loss += kl_coef * (math.exp(ref - lp) - (ref - lp) - 1) / L / n
            d_k3 = 1 - math.exp(ref - lp)
            probs = torch.softmax(W[prev], -1)
            onehot = torch.zeros(W.shape[1], dtype=W.dtype)
            onehot[tok] = 1
            grad[prev] += -(d_obj - kl_coef * d_k3 / L) / n * (onehot - probs)
    return loss, grad, acting


# Per-token log-ratios log pi - log pi_old; the sequence ratios are their means' exp:
#   sample 0 (A > 0): s = exp(0.00035) = 1.00035, inside (1 - 3e-4, 1 + 4e-4) only thanks to the wider upper side
#   sample 1 (A < 0): s = exp(-0.0004) = 0.9996 < 1 - 3e-4: clipped (A < 0, below the range)
#   sample 2 (A > 0): s = exp(0.001) > 1 + 4e-4: clipped (A > 0, above the range)
LOG_RATIOS = [0.0007, 0.0, -0.0012, 0.0, 0.0, 0.001]


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("mini", [1, 3])
def test_gspo_loss_and_grads_equal_hand_computation(kl_coef, mini):
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    old = [_f32(_logp(w0, prev, tok) - d) for (_, prev, tok), d in zip(_steps(), LOG_RATIOS)]
    args = gspo.Config(mini_batch_size=mini, grad_clip=1e9, normalization="constant", max_generation_len=4,
                         kl_coef=kl_coef)
    assert (args.gspo_clip_low, args.gspo_clip_high) == (3e-4, 4e-4)  # the paper's
    m = gspo.update(models(model), as_batch(batch(), logprobs=_per_sample(old)), args, CPU)
    loss, grad, acting = gspo_hand(w0, model.base, old, 3e-4, 4e-4, kl_coef)
    assert acting == 2 and m["clip_frac"] == pytest.approx(2 / 3)  # sequences, not tokens
    assert m["loss"] == pytest.approx(loss, abs=1e-6)
    torch.testing.assert_close(model.W.grad, grad, **TOL)
    # Only sample 0 carries policy gradient: the rows its tokens predict from are W[2] and W[3].
    if kl_coef == 0:
        assert torch.count_nonzero(model.W.grad[[0, 1, 4]]) == 0 and torch.count_nonzero(model.W.grad[3]) > 0


def test_gspo_on_policy_is_sequence_mean_reinforce():
    """s_i = 1 on-policy: the gradient is REINFORCE's with token-mean normalisation."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    gspo.update(models(model), as_batch(batch()), gspo.Config(mini_batch_size=2, grad_clip=1e9, max_generation_len=4), CPU)
    torch.testing.assert_close(model.W.grad, hand(w0, "token-mean")[1], **TOL)


# ---------------------------------------------------------------- PPO-style epochs

def test_two_epochs_of_two_mini_batches_equal_four_hand_steps():
    """ppo_epochs = 2, ppo_mini_batch_size = 2 over 3 samples: steps on rows (0, 1), (2), (0, 1), (2),
    each an SGD step on the clipped objective with pi_old = the behaviour policy throughout."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    old = [_f32(_logp(w0, prev, tok)) for _, prev, tok in _steps()]  # on-policy, as the engine stored them
    args = grpo.Config(mini_batch_size=1, grad_clip=1e9, max_generation_len=4, clip_ratio=0.2,
                         ppo_epochs=2, ppo_mini_batch_size=2)
    m = grpo.update(models(model, lr=1.0), as_batch(batch(), logprobs=_per_sample(old)), args, CPU)

    def hand_steps(eps):
        W, losses, acting, ratios = w0.clone(), [], 0, []
        for _ in range(2):
            for rows in ((0, 1), (2,)):
                ratios.append([math.exp(_logp(W, p, t) - o) for (i, p, t), o in zip(_steps(), old) if i in rows])
                loss, grad, hits = grpo_hand(W, model.base, old, eps, 0.0, rows)
                W, acting = W - grad, acting + hits
                losses.append(loss)
        return W, losses, acting, ratios

    W, losses, acting, ratios = hand_steps(0.2)
    assert ratios[0] == pytest.approx([1.0] * 5, abs=1e-6)  # the first step is on-policy
    assert abs(ratios[1][0] - 1) > 0.04  # the second is not: step 1 moved W[2], which sample 2 reads
    assert acting == 3  # epoch 2: two tokens clipped in rows (0, 1), sample 2 clipped above
    torch.testing.assert_close(model.W.detach(), W, rtol=0, atol=1e-5)
    assert m["optimizer_steps"] == 4
    assert m["clip_frac"] == pytest.approx(acting / 12)  # 5 + 1 + 5 + 1 tokens scored
    assert m["loss"] == pytest.approx(np.mean(losses), abs=1e-6)
    # The clip changed the update: without it the same four steps end elsewhere.
    assert (hand_steps(1e9)[0] - W).abs().max() > 0.05


def test_on_policy_ratio_is_one_at_temperature_and_top_p():
    """Behaviour log-probs of the sampling distribution (T = 0.7, top_p = 0.99, as an engine stores
    them): the first step's ratio is 1 (nothing clipped) and its gradient is REINFORCE's at T."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    old = [_f32(sampling_logprobs(w0[prev], 0.7, 0.99)[tok].item()) for _, prev, tok in _steps()]
    b = as_batch(batch(), temperature=0.7, top_p=0.99, logprobs=_per_sample(old))
    m = grpo.update(models(model), b, grpo.Config(mini_batch_size=3, grad_clip=1e9, max_generation_len=4,
                                                    clip_ratio=1e-4), CPU)
    assert m["clip_frac"] == 0.0
    ref = BigramWithBase()
    from unstable_dask.learn.algorithms import reinforce
    reinforce.update(models(ref), b, reinforce.Config(mini_batch_size=3, grad_clip=1e9, max_generation_len=4), CPU)
    torch.testing.assert_close(model.W.grad, ref.W.grad, **TOL)
