"""GSPO's sequence-level clipped ratio and PPO-style epochs (several optimizer steps over one batch)
equal plain hand computations on tiny inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from unstable_dask.inference.sampling import sampling_logprobs
from unstable_dask.learn import passes
from unstable_dask.learn.algorithms import grpo, gspo

from helpers.learner_batch import (
    ADV,
    CPU,
    TOL,
    BigramWithBase,
    as_batch,
    batch,
    completion_steps,
    grpo_hand,
    hand,
    models,
    token_logp,
)


def _per_sample(values):
    """Per-token values (in completion_steps() order) as the per-sample lists the lake stores."""
    out = [[], [], []]
    for (i, _, _), v in zip(completion_steps(), values):
        out[i].append(v)
    return out


def _f32(x: float) -> float:  # the lake stores behaviour log-probs as float32
    return float(np.float32(x))


# ---------------------------------------------------------------- GSPO

def gspo_hand(W, old, eps_low, eps_high, weights=(1.0, 1.0, 1.0)):
    """Loss, dL/dW and the clipped sequences: s_i = exp(mean_t(logp - old)), one clip per sequence,
    the mean over sequences of -min(s_i A_i, clip(s_i) A_i) w_i (the paper's, TRL's loss_type "grpo")."""
    n = len(ADV)
    loss, grad, acting = 0.0, torch.zeros_like(W), 0
    for i in range(n):
        toks = [(prev, tok, o) for (j, prev, tok), o in zip(completion_steps(), old) if j == i]
        A = ADV[i].item()
        s = math.exp(sum(token_logp(W, prev, tok) - o for prev, tok, o in toks) / len(toks))
        clip_s = min(max(s, 1 - eps_low), 1 + eps_high)
        clipped = clip_s * A < s * A
        acting += clipped
        # d s / d logp_t = s / |y|: one shared ratio, the length normalisation inside it
        d_obj = 0.0 if clipped else A * s / len(toks)
        loss += -min(s * A, clip_s * A) * weights[i] / n
        for prev, tok, _ in toks:
            probs = torch.softmax(W[prev], -1)
            onehot = torch.zeros(W.shape[1], dtype=W.dtype)
            onehot[tok] = 1
            grad[prev] += -d_obj * weights[i] / n * (onehot - probs)
    return loss, grad, acting


# Per-token log-ratios log pi - log pi_old; the sequence ratios are their means' exp:
#   sample 0 (A > 0): s = exp(0.00035) = 1.00035, inside (1 - 3e-4, 1 + 4e-4) only thanks to the wider upper side
#   sample 1 (A < 0): s = exp(-0.0004) = 0.9996 < 1 - 3e-4: clipped (A < 0, below the range)
#   sample 2 (A > 0): s = exp(0.001) > 1 + 4e-4: clipped (A > 0, above the range)
LOG_RATIOS = [0.0007, 0.0, -0.0012, 0.0, 0.0, 0.001]


def test_gspo_objective_equals_hand_computation():
    """The sequence ratio, its clip and the mean over sequences, against pi_old given per token."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    tokens, args = batch(), gspo.Config(mini_batch_size=3, grad_clip=1e9, max_generation_len=4)
    assert (args.gspo_clip_low, args.gspo_clip_high) == (3e-4, 4e-4)  # the paper's
    b = as_batch(tokens)
    p = passes.forward(model, tokens, [0, 1, 2], b.temperature, b.top_p, CPU)
    d = torch.zeros_like(p.logp)
    d[p.mask.bool()] = torch.tensor(LOG_RATIOS, dtype=d.dtype)
    old = p.logp.detach() - d
    per_token, clipped = gspo.sequence_objective(p.logp, old, torch.ones(3), p.mask, ADV.to(p.logp.dtype), args)
    loss = passes.aggregate(per_token, p.mask, args.normalization, 4, 3, int(p.mask.sum()))
    loss.backward()
    old_list = old[p.mask.bool()].tolist()
    hand_loss, grad, acting = gspo_hand(w0, old_list, 3e-4, 4e-4)
    assert acting == 2 and clipped.tolist() == [False, True, True]  # sequences, not tokens
    assert loss.item() == pytest.approx(hand_loss, abs=1e-6)
    torch.testing.assert_close(model.W.grad, grad, **TOL)
    # Only sample 0 carries policy gradient: the rows its tokens predict from are W[2] and W[3].
    assert torch.count_nonzero(model.W.grad[[0, 1, 4]]) == 0 and torch.count_nonzero(model.W.grad[3]) > 0


def test_gspo_update_takes_pi_old_from_the_learner_and_sequence_weights_from_the_engine():
    """One step: every sequence ratio is exactly 1 (nothing clipped, whatever the engine stored), and
    the engine's log-probs weigh each sequence by the geometric mean of its tokens' pi_old / pi_b,
    truncated at is_cap."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    log_w = [0.2, -0.1, 0.9, 0.9, 0.9, 0.05]  # log pi_old - log pi_b per token
    behaviour = [_f32(token_logp(w0, prev, tok) - d) for (_, prev, tok), d in zip(completion_steps(), log_w)]
    b = as_batch(batch(), logprobs=_per_sample(behaviour))
    m = gspo.update(models(model), b, gspo.Config(mini_batch_size=2, grad_clip=1e9, max_generation_len=4), CPU)
    per_seq = [[d for (i, _, _), d in zip(completion_steps(), log_w) if i == k] for k in range(3)]
    weights = [min(math.exp(sum(x) / len(x)), 2.0) for x in per_seq]  # 1.05, 2 (capped from 2.46), 1.05
    hand_loss, grad, acting = gspo_hand(w0, [token_logp(w0, prev, tok) for _, prev, tok in completion_steps()], 3e-4, 4e-4, weights)
    assert m["clip_frac"] == 0 == acting and m["clip_frac_first"] == 0
    assert m["loss"] == pytest.approx(hand_loss, abs=1e-5)
    torch.testing.assert_close(model.W.grad, grad, rtol=0, atol=1e-5)  # the weights come from float32 log-probs


def test_gspo_on_policy_is_sequence_mean_reinforce():
    """s_i = 1 on-policy: the gradient is REINFORCE's with per-sequence mean normalisation."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    gspo.update(models(model), as_batch(batch()), gspo.Config(mini_batch_size=2, grad_clip=1e9, max_generation_len=4), CPU)
    torch.testing.assert_close(model.W.grad, hand(w0, "seq-mean-token-mean")[1], **TOL)


# ---------------------------------------------------------------- PPO-style epochs

def test_two_epochs_of_two_mini_batches_equal_four_hand_steps():
    """ppo_epochs = 2, ppo_mini_batch_size = 2 over 3 samples: four SGD steps on the clipped objective,
    on the row sets the batch seed shuffles into (passes.plan), with pi_old = the learner's log-probs
    before the first step throughout (a no-grad first pass)."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    behaviour = [_f32(token_logp(w0, prev, tok)) for _, prev, tok in completion_steps()]  # on-policy, as the engine stored them
    args = grpo.Config(mini_batch_size=1, grad_clip=1e9, max_generation_len=4, clip_ratio=0.2,
                       ppo_epochs=2, ppo_mini_batch_size=2)
    b = as_batch(batch(), logprobs=_per_sample(behaviour), seed=7)
    m = grpo.update(models(model, lr=1.0), b, args, CPU)
    schedule = [tuple(sorted(i for micro in step for i in micro))
                for epoch in passes.plan(batch().attention_mask.sum(-1).tolist(), 2, 1, 2, 7) for step in epoch]
    assert len(schedule) == 4 and sorted(len(s) for s in schedule) == [1, 1, 2, 2]
    pi_old = [token_logp(w0, prev, tok) for _, prev, tok in completion_steps()]

    def hand_steps(eps):
        W, losses, acting, ratios, scored, idle = w0.clone(), [], 0, [], 0, 0
        for rows in schedule:
            ratios.append([math.exp(token_logp(W, p, t) - o) for (i, p, t), o in zip(completion_steps(), pi_old) if i in rows])
            loss, grad, hits = grpo_hand(W, model.base, pi_old, eps, 0.0, rows)
            W, acting, idle = W - grad, acting + hits, idle + int(not grad.any())
            losses.append(loss)
            scored += len(ratios[-1])
        return W, losses, acting, ratios, scored, idle

    W, losses, acting, ratios, scored, idle = hand_steps(0.2)
    assert ratios[0] == pytest.approx([1.0] * len(ratios[0]), abs=1e-6)  # the first step is on-policy
    assert max(abs(r - 1) for rs in ratios[1:] for r in rs) > 0.04  # later ones are not
    assert acting > 0 and m["clip_frac_first"] == 0
    torch.testing.assert_close(model.W.detach(), W, rtol=0, atol=1e-5)
    # a step whose every token is clipped has an exactly zero gradient: skipped, not stepped on momentum
    assert idle == 1 and m["skipped_steps"] == idle and m["optimizer_steps"] == 4 - idle
    assert m["clip_frac"] == pytest.approx(acting / scored)
    assert m["loss"] == pytest.approx(np.mean(losses), abs=1e-6)
    # The clip changed the update: without it the same four steps end elsewhere.
    assert (hand_steps(1e9)[0] - W).abs().max() > 0.05


def test_on_policy_ratio_is_one_at_temperature_and_top_p():
    """Behaviour log-probs of the sampling distribution (T = 0.7, top_p = 0.99, as an engine stores
    them): the first step's ratio is 1 (nothing clipped) and its gradient is REINFORCE's at T."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    old = [_f32(sampling_logprobs(w0[prev], 0.7, 0.99)[tok].item()) for _, prev, tok in completion_steps()]
    b = as_batch(batch(), temperature=0.7, top_p=0.99, logprobs=_per_sample(old))
    m = grpo.update(models(model), b, grpo.Config(mini_batch_size=3, grad_clip=1e9, max_generation_len=4,
                                                    clip_ratio=1e-4), CPU)
    assert m["clip_frac"] == 0.0
    ref = BigramWithBase()
    from unstable_dask.learn.algorithms import reinforce
    reinforce.update(models(ref), b, reinforce.Config(mini_batch_size=3, grad_clip=1e9, max_generation_len=4), CPU)
    torch.testing.assert_close(model.W.grad, ref.W.grad, **TOL)
