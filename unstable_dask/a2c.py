"""A2C (cleanrl style): REINFORCE actor + a LoRA critic with a linear value head.

The critic is the base backbone (no LM head) with its own LoRA adapter and a linear head reading
the hidden state at the LAST PROMPT token: in a causal model that is the first position that has
seen the whole prompt (UB reads token 0, which has seen one token).

Rewards for GAE, per turn t of a seat in a game (the batch samples whole seats, in turn order):
    r_t = (step_reward_t - final_reward) + [t is the seat's last turn] * final_reward
i.e. the per-turn shaping of the step transforms plus the (final-transformed) game reward once,
at the end. delta_t = r_t + gamma V_{t+1} - V_t (V after the last turn = 0),
A_t = delta_t + gamma lambda A_{t+1}, return R_t = A_t + V_t; value loss 0.5 * MSE(V, R).
The actor takes the REINFORCE step with A_t; the critic its own AdamW step with critic_lr.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch

from . import reinforce
from .reinforce import ReinforceArgs, Tokens, micro_batches


@dataclass
class A2CArgs(ReinforceArgs):
    gamma: float = 1.0
    gae_lambda: float = 1.0
    critic_grad_clip: float = 0.2


class Critic(torch.nn.Module):
    def __init__(self, body: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.body = body  # a peft-wrapped AutoModel (backbone without LM head)
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)  # V = 0 at start: the first advantages are the returns
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, last_prompt: torch.Tensor) -> torch.Tensor:
        h = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        h = h[torch.arange(h.shape[0], device=h.device), last_prompt.to(h.device)]
        return self.head(h.to(self.head.weight.dtype)).squeeze(-1)


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


def update(policy, critic: Critic, optimizer: torch.optim.Optimizer, critic_optimizer: torch.optim.Optimizer,
           tokens: Tokens, seats: Sequence[tuple], turns: Sequence[int], final_reward: Sequence[float],
           step_reward: Sequence[float], args: A2CArgs, device: torch.device) -> dict:
    t0 = time.perf_counter()
    n = tokens.input_ids.shape[0]
    batches = micro_batches(n, args.mini_batch_size)
    critic.eval()
    with torch.no_grad():
        values = torch.cat([critic(tokens.input_ids[mb].to(device), tokens.attention_mask[mb].to(device),
                                   tokens.last_prompt[mb]).float().cpu() for mb in batches]).tolist()
    rewards = turn_rewards(seats, turns, final_reward, step_reward)
    adv, ret = gae(seats, turns, rewards, values, args.gamma, args.gae_lambda)
    actor = reinforce.update(policy, optimizer, tokens, torch.tensor(adv, dtype=torch.float64), args, device)

    critic.train()
    critic_optimizer.zero_grad(set_to_none=True)
    target = torch.tensor(ret, dtype=torch.float32)
    vloss_sum, mae_sum = 0.0, 0.0
    for mb in batches:
        v = critic(tokens.input_ids[mb].to(device), tokens.attention_mask[mb].to(device), tokens.last_prompt[mb]).float()
        err = v - target[mb].to(device)
        loss = 0.5 * (err ** 2).sum() / n  # 0.5 * MSE over the batch, accumulated over micro-batches
        loss.backward()
        vloss_sum += loss.item()
        mae_sum += err.detach().abs().sum().item()
    params = [p for g in critic_optimizer.param_groups for p in g["params"]]
    critic_norm = torch.nn.utils.clip_grad_norm_(params, args.critic_grad_clip)
    critic_optimizer.step()
    actor.update(value_loss=vloss_sum, value_mae=mae_sum / n, critic_grad_norm=float(critic_norm),
                 loss=actor["loss"] + vloss_sum, advantage_mean=sum(adv) / n,
                 step_time_s=time.perf_counter() - t0)
    return actor
