"""GSPO, Group Sequence Policy Optimization (Qwen, 2025): GRPO with a sequence-level ratio.

Groups, advantages, default transforms, behaviour log-probs and PPO-style epochs are GRPO's
(grpo.py: the batch holds whole (group_id, pid) groups, A_i is the group-relative advantage of
the sample). What changes is the importance ratio and where it is clipped: per sample i with
completion y_i of |y_i| tokens,

    s_i   = exp( (1/|y_i|) * sum_t (log pi(y_it) - log pi_old(y_it)) )      (a geometric mean)
    obj_i = min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)
    loss  = -mean_i [ obj_i - kl_coef * sum_t mask * k3_t / norm_i ]

so every token of a sequence shares one ratio and one clipping decision, and the length
normalisation is inside s_i (d s_i = s_i * mean_t d log pi(y_it)): `learn.normalization` only
scales the optional k3 KL to the base, which is GRPO's. eps_low / eps_high are
`learn.gspo_clip_low` / `learn.gspo_clip_high` (default 3e-4 / 4e-4, the paper's: a sequence
ratio is a mean of per-token log-ratios, far tighter than a token ratio, so the range is ~1000x
smaller than PPO's 0.2; `learn.clip_ratio` is not used). clip_frac is the share of sequences
whose gradient the clip removed.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from unstable_dask.learn.algorithms import Batch, Models, Spec, grpo

SPEC = Spec(unit="group", behaviour_logprobs=True, needs_groups=True)


class Config(grpo.PPOConfig):
    """[learn] with algorithm = "gspo": GRPO's settings but its token clip, plus the sequence clip."""
    algorithm: Literal["gspo"] = "gspo"
    gspo_clip_low: float = Field(3e-4, gt=0.0, lt=1.0)
    """The sequence ratio is kept above 1 - gspo_clip_low (the paper's 3e-4)."""
    gspo_clip_high: float = Field(4e-4, gt=0.0)
    """The sequence ratio is kept below 1 + gspo_clip_high (the paper's 4e-4)."""


def sequence_objective(logp, old, mask, adv, args: Config):
    """GSPO's clipped surrogate per sample, and (clipped, counted) sequences."""
    import torch
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1))
    clipped = s.clamp(1 - args.gspo_clip_low, 1 + args.gspo_clip_high)
    obj = torch.minimum(s * adv, clipped * adv)
    return obj, (clipped * adv < s * adv).sum().item(), float(len(s))


def update(models: Models, batch: Batch, args: Config, device) -> dict:
    return grpo.update(models, batch, args, device, objective=sequence_objective)
