"""GRPO / Dr. GRPO (cleanrl style: one update, explicit).

Advantages arrive group-normalised from the SQL pipeline (GroupRelativeAdvantage over (env_id,
seed) groups, sampled whole). Per completion token:

    ratio = exp(logp - logp_behaviour)   when the lake holds the engine's logprobs for the sample
          = exp(logp - logp.detach())    otherwise (on-policy: value 1, REINFORCE gradient)
    obj   = min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
    k3    = exp(ref - logp) - (ref - logp) - 1     (ref = the frozen base: the adapter disabled)
    loss  = -mean_i [ sum_t mask * (obj - kl_coef * k3) / norm_i ]

with norm_i = max_generation_len (Dr. GRPO's constant) or the sample's completion length.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .reinforce import ReinforceArgs, Tokens, micro_batches, token_logprobs


@dataclass
class GRPOArgs(ReinforceArgs):
    clip_ratio: float = 0.2
    kl_coef: float = 0.0


def behaviour_logprobs(tokens: Tokens, logprobs: Sequence[Optional[Sequence[float]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine logprobs laid out like token_logprobs' output ([B, T-1]) and a [B] mask of samples
    whose stored logprobs line up one-to-one with the completion tokens we train on."""
    mask = tokens.loss_mask[:, 1:].bool()
    old = torch.zeros(mask.shape, dtype=torch.float32)
    ok = torch.zeros(mask.shape[0], dtype=torch.bool)
    for i, lp in enumerate(logprobs):
        if lp is not None and len(lp) == int(mask[i].sum()) and not bool(tokens.truncated[i]):
            old[i, mask[i]] = torch.tensor(lp, dtype=torch.float32)
            ok[i] = True
    return old, ok


def update(model, optimizer: torch.optim.Optimizer, tokens: Tokens, advantages: torch.Tensor,
           old_logp: torch.Tensor, has_old: torch.Tensor, args: GRPOArgs, device: torch.device) -> dict:
    t0 = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    n = tokens.input_ids.shape[0]
    sums = dict(loss=0.0, pg_loss=0.0, kl=0.0, clipped=0.0, tokens=0.0, logp=0.0)
    for mb in micro_batches(n, args.mini_batch_size):
        ids, att = tokens.input_ids[mb].to(device), tokens.attention_mask[mb].to(device)
        logp = token_logprobs(model, ids, att)
        mask = tokens.loss_mask[mb, 1:].to(device, logp.dtype)
        adv = advantages[mb].to(device, logp.dtype).unsqueeze(-1)
        old = torch.where(has_old[mb].to(device).unsqueeze(-1), old_logp[mb].to(device, logp.dtype), logp.detach())
        ratio = torch.exp(logp - old)
        clipped = ratio.clamp(1 - args.clip_ratio, 1 + args.clip_ratio)
        obj = torch.minimum(ratio * adv, clipped * adv)
        norm = (torch.full((ids.shape[0],), float(args.max_generation_len), device=device, dtype=logp.dtype)
                if args.normalization == "constant" else mask.sum(-1).clamp(min=1))
        pg = -((obj * mask).sum(-1) / norm).sum() / n
        loss = pg
        kl = torch.zeros((), device=device)
        if args.kl_coef > 0:
            with torch.no_grad(), model.disable_adapter():
                ref = token_logprobs(model, ids, att)
            d = ref - logp
            kl = ((torch.exp(d) - d - 1) * mask).sum(-1).div(norm).sum() / n
            loss = loss + args.kl_coef * kl
        loss.backward()
        sums["loss"] += loss.item()
        sums["pg_loss"] += pg.item()
        sums["kl"] += kl.item()
        sums["clipped"] += (((ratio - clipped).abs() > 0).to(mask.dtype) * mask).sum().item()
        sums["tokens"] += mask.sum().item()
        sums["logp"] += ((logp.detach() * mask).sum(-1) / norm).sum().item()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    optimizer.step()
    return dict(loss=sums["loss"], pg_loss=sums["pg_loss"], kl=sums["kl"],
                clip_frac=sums["clipped"] / max(sums["tokens"], 1), logp_mean=sums["logp"] / n,
                grad_norm=float(grad_norm), step_time_s=time.perf_counter() - t0)
