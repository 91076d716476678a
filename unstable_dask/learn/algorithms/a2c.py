"""A2C (cleanrl style): REINFORCE actor + a LoRA critic with a linear value head.

The critic (built by the trainer) is the base backbone (no LM head) with its own LoRA adapter and
a linear head, zero-initialised (V = 0 at start: the first advantages are the returns), reading
the hidden state at the LAST PROMPT token: in a causal model that is the first position that has
seen the whole prompt (UB reads token 0, which has seen one token).

Rewards for GAE, per turn t of a seat in a game (the batch samples whole seats, in turn order):
    r_t = (step_reward_t - final_reward) + [t is the seat's last turn] * final_reward
i.e. the per-turn shaping of the step transforms plus the (final-transformed) game reward once,
at the end. delta_t = r_t + gamma V_{t+1} - V_t (V after the last turn = 0),
A_t = delta_t + gamma lambda A_{t+1}, return R_t = A_t + V_t; value loss 0.5 * MSE(V, R).

Sampling transforms act on A_t, not on the rewards (Spec.sampling_on = "advantages"): the batch
query leaves rewards untransformed and the job's `sampling_transforms` see `reward` = A_t. UB's
`normalize_adv=True` is `sampling_transforms = ["NormalizeRewardsByEnv(z_score=True)"]`; the
default, as UB's, is none. The actor takes the REINFORCE step (reinforce.py) with the transformed
A_t; the critic its own AdamW step with critic_lr toward R_t.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Literal, Sequence

from pydantic import Field

from unstable_dask.learn import distributed
from unstable_dask.learn.algorithms import Batch, Models, Spec, reinforce
from unstable_dask.learn.tokens import clip_and_step, micro_batches

SPEC = Spec(unit="seat", sampling_on="advantages", critic=True)


class Config(reinforce.Config):
    """[learn] with algorithm = "a2c": REINFORCE's settings (the actor's step) plus the critic's."""
    algorithm: Literal["a2c"] = "a2c"  # type: ignore[assignment]
    """The algorithm: advantage actor-critic over whole seats, GAE on a learned value."""
    critic_lr: float = Field(5e-5, gt=0.0, le=1.0)
    """AdamW learning rate of the critic (its own LoRA adapter and value head)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """GAE discount (UnstableBaselines: 1)."""
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda (UnstableBaselines: 1)."""
    final_transforms: list[str] = ["RoleAdvantageByEnvFormatter()"]
    """Reward transforms once per game and learner seat; default as REINFORCE's (UnstableBaselines')."""
    sampling_transforms: list[str] = []
    """Applied to the GAE advantages, not the rewards (UB's normalize_adv=True is
    ["NormalizeRewardsByEnv(z_score=True)"]); default none, as UB's."""


def critic_values(critic, input_ids, attention_mask, last_prompt):
    """V at each sample's last prompt token, [B]."""
    import torch
    h = critic.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    h = h[torch.arange(h.shape[0], device=h.device), last_prompt.to(h.device)]
    return critic.head(h.to(critic.head.weight.dtype)).squeeze(-1)


def gae(seats: Sequence[tuple], turns: Sequence[int], rewards: Sequence[float], values: Sequence[float],
        gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Advantages and returns per row; rows are grouped by `seats` key and ordered by `turns`."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, key in enumerate(seats):
        groups[key].append(i)
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    for idx in groups.values():
        idx.sort(key=lambda i: turns[i])
        next_v, next_a = 0.0, 0.0
        for i in reversed(idx):
            delta = rewards[i] + gamma * next_v - values[i]
            next_a = delta + gamma * lam * next_a
            adv[i], ret[i] = next_a, next_a + values[i]
            next_v = values[i]
    return adv, ret


def turn_rewards(seats: Sequence[tuple], turns: Sequence[int], final: Sequence[float], step: Sequence[float]) -> list[float]:
    last: dict[tuple, int] = {}
    for key, t in zip(seats, turns):
        last[key] = max(last.get(key, t), t)
    return [(s - f) + (f if t == last[k] else 0.0) for k, t, f, s in zip(seats, turns, final, step)]


def update(models: Models, batch: Batch, args: Config, device) -> dict:
    import torch
    t0 = time.perf_counter()
    critic, critic_optimizer, tokens, n = models.critic, models.critic_optimizer, batch.tokens, batch.size
    assert critic is not None and critic_optimizer is not None, "A2C's Spec asks the trainer for a critic"
    batches = micro_batches(n, args.mini_batch_size)
    critic.eval()
    with torch.no_grad():
        v = torch.cat([critic_values(critic, tokens.input_ids[mb].to(device), tokens.attention_mask[mb].to(device),
                              tokens.last_prompt[mb]).float().cpu() for mb in batches]).tolist()
    rewards = turn_rewards(batch.seats, batch.turns, batch.final_reward, batch.step_reward)
    gae_adv, ret = gae(batch.seats, batch.turns, rewards, v, args.gamma, args.gae_lambda)
    adv = torch.tensor(batch.transform(gae_adv), dtype=torch.float64)  # the job's sampling transforms
    actor = reinforce.update(models, replace(batch, advantages=adv), args, device)

    critic.train()
    critic_optimizer.zero_grad(set_to_none=True)
    target = torch.tensor(ret, dtype=torch.float32)
    vloss_sum, mae_sum = 0.0, 0.0
    for mb in distributed.shard(batches):  # this rank's micro-batches (all of them in one process)
        err = critic_values(critic, tokens.input_ids[mb].to(device), tokens.attention_mask[mb].to(device),
                     tokens.last_prompt[mb]).float() - target[mb].to(device)
        loss = 0.5 * (err ** 2).sum() / n  # 0.5 * MSE over the batch, accumulated over micro-batches
        loss.backward()
        vloss_sum += loss.item()
        mae_sum += err.detach().abs().sum().item()
    vloss_sum, mae_sum = distributed.reduce_step(critic_optimizer, dict(v=vloss_sum, mae=mae_sum)).values()
    critic_norm = clip_and_step(critic_optimizer, args.grad_clip)
    actor.update(value_loss=vloss_sum, value_mae=mae_sum / n, critic_grad_norm=critic_norm, critic_lr=args.critic_lr,
                 loss=actor["loss"] + vloss_sum, advantage_mean=adv.mean().item(),
                 advantage_std=adv.std(unbiased=False).item(), step_time_s=time.perf_counter() - t0)
    return actor
