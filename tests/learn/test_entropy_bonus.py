"""`learn.entropy_coef`: the entropy bonus of REINFORCE (A2C's actor) and GRPO/GSPO equals a hand
computation written from verl's (policy_loss = pg_loss - entropy_coeff * agg(entropy)), at the
sampling distribution's temperature and top-p, and it widens a policy that has no other signal."""
from __future__ import annotations

import math

import pytest
import torch

from unstable_dask.inference.sampling import sampling_logprobs
from unstable_dask.learn.algorithms import grpo, reinforce

from helpers.learner_batch import (
    COMPLETIONS,
    CPU,
    PROMPTS,
    RATIOS,
    TOL,
    Bigram,
    BigramWithBase,
    V,
    as_batch,
    batch,
    completion_steps,
    grpo_hand,
    hand,
    models,
    old_logprobs,
    token_logp,
)


def entropy_hand(W, normalization, T=1.0, top_p=1.0, L=4, rows=(0, 1, 2)):
    """(aggregated entropy, its dW, mean entropy per token) over the completion tokens of `rows`:
    H = -sum_x p log p with p the sampling distribution of softmax(W[prev] / T) (its nucleus
    renormalised); dH/dW[prev] = -(1/T) p (log p + H) on the nucleus, 0 off it (the nucleus is a
    discrete choice, as in sampling.py)."""
    comps = [c for _, c in COMPLETIONS]
    total = sum(len(comps[i]) for i in rows)
    agg, grad, hs = 0.0, torch.zeros_like(W), []
    for i in rows:
        seq = PROMPTS[i] + comps[i]
        norm = {"constant": L, "seq-mean-token-mean": len(comps[i]), "token-mean": total / len(rows)}[normalization]
        for t in range(len(PROMPTS[i]), len(seq)):
            prev = seq[t - 1]
            z = W[prev].double() / T
            order = torch.argsort(z, descending=True)
            full = torch.softmax(z, -1)
            inside = torch.zeros(V, dtype=torch.bool)
            mass = 0.0
            for k in order.tolist():  # the smallest top set whose mass reaches top_p
                inside[k] = True
                mass += float(full[k])
                if mass >= top_p:
                    break
            p = torch.where(inside, full, torch.zeros_like(full))
            p = p / p.sum()
            logp = torch.where(inside, p.clamp_min(1e-300).log(), torch.zeros_like(p))
            h = float(-(p * logp).sum())
            hs.append(h)
            agg += h / norm / len(rows)
            grad[prev] += -(1 / T) * p * (logp + h) * inside / norm / len(rows)
    return agg, grad, sum(hs) / len(hs)


@pytest.mark.parametrize("normalization", ["constant", "seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("mini", [1, 3])
@pytest.mark.parametrize("T,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.95)])
def test_reinforce_loss_is_the_policy_loss_minus_the_entropy_bonus(normalization, mini, T, top_p):
    model = Bigram()
    w0 = model.W.detach().clone()
    c = 0.05
    b = as_batch(batch(), temperature=T, top_p=top_p)
    m = reinforce.update(models(model), b, reinforce.Config(mini_batch_size=mini, grad_clip=1e9, entropy_coef=c,
                                                            normalization=normalization, max_generation_len=4), CPU)
    h, dh, h_mean = entropy_hand(w0, normalization, T, top_p)
    if top_p == 1.0:  # the policy-gradient part at temperature T: the chain rule through W / T
        pg, dpg = hand(w0 / T, normalization)
        assert m["pg_loss"] == pytest.approx(pg, abs=1e-6)
        torch.testing.assert_close(model.W.grad, dpg / T - c * dh, **TOL)
    # float32 sums (eps 1.2e-7); tokens outside the nucleus sit at the log-prob floor, so the
    # loss reaches ~57 there: a relative bound
    assert m["loss"] == pytest.approx(m["pg_loss"] - c * h, rel=1e-6, abs=1e-6)
    assert b.mismatch.metrics()["entropy"] == pytest.approx(h_mean, abs=1e-6)
    assert math.isfinite(m["grad_norm"]) and not torch.isnan(model.W.grad).any()
    # the bonus's gradient on its own, nucleus included: the same update without it differs by -c dH
    plain = Bigram()
    reinforce.update(models(plain), as_batch(batch(), temperature=T, top_p=top_p),
                     reinforce.Config(mini_batch_size=mini, grad_clip=1e9, normalization=normalization,
                                      max_generation_len=4), CPU)
    torch.testing.assert_close(model.W.grad - plain.W.grad, -c * dh, **TOL)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("mini", [1, 3])
def test_grpo_loss_adds_the_entropy_bonus_to_the_clipped_surrogate_and_kl(kl_coef, mini):
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    c = 0.05
    args = grpo.Config(mini_batch_size=mini, grad_clip=1e9, normalization="constant", max_generation_len=4,
                       kl_coef=kl_coef, entropy_coef=c)
    m = grpo.update(models(model), as_batch(batch(), logprobs=old_logprobs(w0)), args, CPU)
    pi_old = [token_logp(w0, prev, tok) for _, prev, tok in completion_steps()]
    loss, grad, _ = grpo_hand(w0, model.base, pi_old, 0.2, kl_coef, weights=[min(r or 1.0, 2.0) for r in RATIOS])
    h, dh, _ = entropy_hand(w0, "constant")
    assert m["loss"] == pytest.approx(loss - c * h, abs=1e-6)
    torch.testing.assert_close(model.W.grad, grad - c * dh, **TOL)


def test_two_ppo_steps_take_the_bonus_in_each_step_and_the_metric_from_the_first_pass():
    """Two epochs of the whole batch: two optimizer steps, each with the bonus at its own weights;
    the recorded entropy is pi_old's (the no-grad first pass)."""
    model = Bigram()
    w0 = model.W.detach().clone()
    args = grpo.Config(mini_batch_size=3, grad_clip=1e9, normalization="constant", max_generation_len=4,
                       entropy_coef=0.05, ppo_epochs=2)
    b = as_batch(batch())
    m = grpo.update(models(model, lr=0.5), b, args, CPU)
    assert m["optimizer_steps"] == 2
    assert b.mismatch.metrics()["entropy"] == pytest.approx(entropy_hand(w0, "constant")[2], abs=1e-6)
    w1 = model.W.detach() + 0.5 * model.W.grad  # the weights the second step's gradient was taken at
    _, dpg, _ = grpo_hand(w1, w1, [token_logp(w0, p, t) for _, p, t in completion_steps()], 0.2, 0.0)
    torch.testing.assert_close(model.W.grad, dpg - 0.05 * entropy_hand(w1, "constant")[1], **TOL)


def test_with_no_other_signal_the_bonus_widens_the_policy():
    """All advantages 0: the policy gradient is 0 and the step raises the sampling entropy at every
    completion position; the trainer keeps such rows in a step (they have a gradient)."""
    model = Bigram()
    zero = torch.zeros(3, dtype=torch.float64)
    before = entropy_hand(model.W.detach(), "constant", 0.7)[0]
    reinforce.update(models(model, lr=0.5), as_batch(batch(), adv=zero, temperature=0.7),
                     reinforce.Config(mini_batch_size=3, grad_clip=1e9, max_generation_len=4, entropy_coef=1.0), CPU)
    assert entropy_hand(model.W.detach(), "constant", 0.7)[0] > before
    assert reinforce.Config(entropy_coef=0.01).silent_rows_have_gradient()
    assert grpo.Config(entropy_coef=0.01).silent_rows_have_gradient()
    assert not grpo.Config().silent_rows_have_gradient() and not reinforce.Config().silent_rows_have_gradient()


def test_the_entropy_of_a_nucleus_has_no_nan_where_tokens_fall_outside_it():
    from unstable_dask.inference.sampling import sampling_entropy
    z = torch.tensor([[8.0, 0.0, -1.0, -30.0]], requires_grad=True)
    h = sampling_entropy(z, 1.0, 0.9)
    h.sum().backward()
    p = sampling_logprobs(z.detach(), 1.0, 0.9).exp()
    assert p[0, 1:].eq(0).all() and h.item() == 0.0
    assert torch.isfinite(z.grad).all() and z.grad.abs().sum() == 0
