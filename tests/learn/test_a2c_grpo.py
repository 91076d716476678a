"""A2C's GAE (and the sampling transforms on it) and GRPO's clipped-ratio / k3-KL loss equal plain
hand computations on tiny inputs."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from unstable_dask.learn import passes
from unstable_dask.learn.algorithms import a2c
from unstable_dask.learn.algorithms.a2c import gae, turn_rewards
from unstable_dask.learn.algorithms.grpo import Config as GRPOConfig
from unstable_dask.learn.algorithms.grpo import update
from unstable_dask.learn.passes import Mismatch
from unstable_dask.learn.rewards import transform_values
from unstable_dask.learn.tokens import behaviour_logprobs
from unstable_dask.learn.transforms import NormalizeRewards, NormalizeRewardsByEnv

from helpers.learner_batch import (
    CPU,
    RATIOS,
    TOL,
    Bigram,
    BigramWithBase,
    as_batch,
    batch,
    completion_steps,
    grpo_hand,
    hand,
    models,
    old_logprobs,
    token_logp,
)

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


class Critic(torch.nn.Module):
    """The trainer's critic shape: body (here a token embedding as hidden state) + a zero Linear head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 2)
        self.head = torch.nn.Linear(2, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def body(self, input_ids, attention_mask):
        return SimpleNamespace(last_hidden_state=self.emb(input_ids))


@pytest.mark.parametrize("transform", [NormalizeRewards(z_score=True), NormalizeRewardsByEnv(z_score=False)], ids=repr)
def test_a2c_sampling_transforms_act_on_its_gae_advantages(transform):
    """The actor's gradient is REINFORCE's with the transformed GAE advantages (V = 0 at start, so
    GAE = the reward-to-go of each seat's turn rewards), and advantage_mean / _std describe them."""
    seats = [("g", 0), ("g", 0), ("h", 1)]  # samples 0 and 1: turns 0 and 2 of one seat
    turns, final, step = [0, 2, 1], [1.0, 1.0, -1.0], [2.5, 1.0, -2.0]
    envs = ["EnvA", "EnvA", "EnvB"]
    table = pa.table({"env_id": envs, "advantage": [0.0] * 3})
    model, critic = Bigram(), Critic()
    w0 = model.W.detach().clone()
    m = models(model)
    m.critic, m.critic_optimizer = critic, torch.optim.SGD(critic.parameters(), lr=0.0)
    b = as_batch(batch(), seats=seats, turns=turns, final_reward=final, step_reward=step,
                 transform=lambda v: transform_values([transform], table, v))
    out = a2c.update(m, b, a2c.Config(mini_batch_size=2, grad_clip=1e9, max_generation_len=4), CPU)
    # turn rewards r = (step - final) + final at the seat's last turn: [1.5, 1.0], [-2.0]; summed to go
    gae_adv = [1.5 + 1.0, 1.0, -2.0]
    by = {"EnvA": [0, 1], "EnvB": [2]} if isinstance(transform, NormalizeRewardsByEnv) else {"*": [0, 1, 2]}
    want = [0.0] * 3
    for rows in by.values():
        vals = np.array([gae_adv[i] for i in rows])
        for i in rows:
            want[i] = (gae_adv[i] - vals.mean()) / ((vals.std() + 1e-8) if transform.z_score else 1.0)
    torch.testing.assert_close(model.W.grad, hand(w0, "constant", adv=torch.tensor(want))[1], **TOL)
    assert out["advantage_mean"] == pytest.approx(np.mean(want), abs=1e-9)
    assert out["advantage_std"] == pytest.approx(np.std(want), abs=1e-9)
    # The critic's target stays the untransformed return (GAE + V, V = 0).
    assert out["value_loss"] == pytest.approx(0.5 * np.mean(np.square(gae_adv)), abs=1e-6)


# ---------------------------------------------------------------- GRPO

@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("mini", [1, 3])
def test_grpo_loss_and_grads_equal_hand_computation(kl_coef, mini):
    """One optimizer step: pi_old is the learner's own log-prob (ratio 1, nothing clipped) and the
    engine's log-probs enter as truncated importance weights min(pi_old / pi_b, 2)."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    b = as_batch(batch(), logprobs=old_logprobs(w0))
    assert b.known.tolist() == [True, True, False]
    args = GRPOConfig(mini_batch_size=mini, grad_clip=1e9, normalization="constant", max_generation_len=4,
                      clip_ratio=0.2, kl_coef=kl_coef)
    m = update(models(model), b, args, CPU)
    pi_old = [token_logp(w0, prev, tok) for _, prev, tok in completion_steps()]
    loss, grad, acting = grpo_hand(w0, model.base, pi_old, 0.2, kl_coef, weights=[min(r or 1.0, 2.0) for r in RATIOS])
    assert m["loss"] == pytest.approx(loss, abs=1e-6)  # behaviour logprobs are stored as float32
    torch.testing.assert_close(model.W.grad, grad, **TOL)
    assert m["clip_frac"] == 0 == acting and m["clip_frac_first"] == 0
    assert (m["kl"] > 0) == (kl_coef > 0) and m["optimizer_steps"] == 1
    w = b.mismatch.metrics()
    assert w["is_weight_max"] == pytest.approx(1.5, abs=1e-5) and w["is_bounded_frac"] == 0
    assert w["logp_gap_max"] == pytest.approx(math.log(1 / 0.5), abs=1e-5)


def test_masked_importance_sampling_drops_the_tokens_outside_its_band():
    """is_mode = "mask", is_cap = 1.4: tokens with pi_old / pi_b = 1.5 or 0.5 leave the loss and its
    normaliser; the others count unweighted (IcePop-style)."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    b = as_batch(batch(), logprobs=old_logprobs(w0))
    b.mismatch = Mismatch("mask", 1.4)
    args = GRPOConfig(mini_batch_size=3, grad_clip=1e9, normalization="constant", max_generation_len=4)
    update(models(model), b, args, CPU)
    keep = [0.0 if r is not None and not 1 / 1.4 <= r <= 1.4 else 1.0 for r in RATIOS]
    pi_old = [token_logp(w0, prev, tok) for _, prev, tok in completion_steps()]
    _, grad, _ = grpo_hand(w0, model.base, pi_old, 0.2, 0.0, weights=keep)
    torch.testing.assert_close(model.W.grad, grad, **TOL)
    assert keep.count(0.0) == 2 and b.mismatch.metrics()["is_bounded_frac"] == pytest.approx(2 / 5)


def test_dual_clip_bounds_a_bad_action_s_loss():
    """A < 0 and a ratio far above 1: PPO's clip leaves -A * ratio (the max); the dual clip caps it
    at -A * c and removes its gradient, as verl's clip_ratio_c does."""
    from unstable_dask.learn.algorithms.grpo import token_objective
    logp = torch.log(torch.tensor([[4.0, 1.1, 0.5]]))
    old = torch.zeros(1, 3)
    mask, w = torch.ones(1, 3), torch.ones(1, 3)
    for c, want in ((3.0, [3.0, 1.1, 0.8]), (0.0, [4.0, 1.1, 0.8])):
        args = SimpleNamespace(clip_ratio=0.2, clip_ratio_c=c)
        loss, clipped = token_objective(logp, old, w, mask, torch.tensor([-1.0]), args)
        torch.testing.assert_close(loss, torch.tensor([want]))
        assert clipped.tolist() == [[c > 0, False, True]]


def test_grpo_on_policy_without_kl_is_reinforce():
    """No behaviour logprobs: ratio 1 with the REINFORCE gradient, token for token."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    args = GRPOConfig(mini_batch_size=3, grad_clip=1e9, normalization="seq-mean-token-mean", max_generation_len=4)
    update(models(model), as_batch(batch()), args, CPU)
    torch.testing.assert_close(model.W.grad, hand(w0, "seq-mean-token-mean")[1], **TOL)


def test_behaviour_logprobs_are_used_only_where_they_line_up():
    tokens = batch()
    old, ok = behaviour_logprobs(tokens, [[-1.0, -2.0], [-0.5], [-3.0]])  # sample 1 has 3 tokens, not 1
    assert ok.tolist() == [True, False, True]
    assert old[0].tolist() == [0.0, -1.0, -2.0, 0.0] and old[2].tolist() == [0.0, -3.0, 0.0, 0.0]
    tokens.truncated[0] = True  # a cut sample's stored logprobs no longer describe what we train on
    assert behaviour_logprobs(tokens, [[-1.0, -2.0], None, [-3.0]])[1].tolist() == [False, False, True]


@pytest.mark.parametrize("seed", range(8))
def test_later_epochs_train_only_completion_tokens_of_multi_row_micro_batches(seed):
    """ppo_epochs = 2, two-row steps cut into two-row micro-batches of unequal lengths: a row meets
    other neighbours (another window start and end) in the second epoch than in the no-grad first
    pass. Its prompt and padding positions stay out of every step's loss, so under
    "seq-mean-token-mean" the weights after the four steps are the hand computation's, and the
    loss and clip_frac count completion tokens only."""
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    args = GRPOConfig(mini_batch_size=2, grad_clip=1e9, normalization="seq-mean-token-mean", max_generation_len=4,
                      clip_ratio=0.2, ppo_epochs=2, ppo_mini_batch_size=2)
    m = update(models(model, lr=1.0), as_batch(batch(), seed=seed), args, CPU)
    plan = passes.plan(batch().attention_mask.sum(-1).tolist(), 2, 2, 2, seed)
    assert any(len(micro) == 2 for epoch in plan for step in epoch for micro in step)
    pi_old = [token_logp(w0, prev, tok) for _, prev, tok in completion_steps()]
    W, losses, acting, scored = w0.clone(), [], 0, 0
    for rows in (tuple(i for micro in step for i in micro) for epoch in plan for step in epoch):
        loss, grad, hits = grpo_hand(W, model.base, pi_old, 0.2, 0.0, rows, L="seq")
        W, acting, scored = W - grad, acting + hits, scored + sum(1 for i, _, _ in completion_steps() if i in rows)
        losses.append(loss)
    torch.testing.assert_close(model.W.detach(), W, **TOL)
    assert m["loss"] == pytest.approx(np.mean(losses), abs=1e-6)
    assert m["clip_frac"] == pytest.approx(acting / scored)


@pytest.mark.parametrize("algorithm", ["grpo", "reinforce"])
def test_masked_tokens_leave_the_token_mean_normaliser(algorithm):
    """is_mode = "mask" with "token-mean": the two tokens outside the band leave the loss AND the
    count it is divided by (4 kept tokens, not 6), for one optimizer step as for GRPO's and
    REINFORCE's single pass."""
    from unstable_dask.learn.algorithms import reinforce
    model = BigramWithBase()
    w0 = model.W.detach().clone()
    b = as_batch(batch(), logprobs=old_logprobs(w0))
    b.mismatch = Mismatch("mask", 1.4)
    if algorithm == "grpo":
        update(models(model), b, GRPOConfig(mini_batch_size=2, grad_clip=1e9, normalization="token-mean"), CPU)
    else:
        reinforce.update(models(model), b, reinforce.Config(mini_batch_size=2, grad_clip=1e9, normalization="token-mean"),
                         CPU)
    keep = [0.0 if r is not None and not 1 / 1.4 <= r <= 1.4 else 1.0 for r in RATIOS]
    kept = int(sum(keep))
    assert kept == 4
    pi_old = [token_logp(w0, prev, tok) for _, prev, tok in completion_steps()]
    # grpo_hand divides a token's term by L x the step's rows; on-policy it is REINFORCE's term
    _, grad, _ = grpo_hand(w0, model.base, pi_old, 0.2, 0.0, weights=keep, L=kept / 3)
    torch.testing.assert_close(model.W.grad, grad, **TOL)
