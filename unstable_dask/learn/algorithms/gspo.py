"""GSPO, Group Sequence Policy Optimization (Qwen, 2025): GRPO with a sequence-level ratio.

Groups, advantages, default transforms, pi_old and PPO-style epochs are GRPO's (grpo.py: the batch
holds whole (group_id, pid) groups, A_i is the group-relative advantage of the sample, pi_old is the
learner's own log-prob before the update). What changes is the importance ratio and where it is
clipped: per sample i with completion y_i of |y_i| tokens,

    s_i   = exp( (1/|y_i|) * sum_t (log pi(y_it) - log pi_old(y_it)) )      (a geometric mean)
    l_i   = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i) * w_i
    loss  = aggregate over tokens of l_i (the same value on each token of sequence i) + kl_coef * k3

as TRL computes it (importance_sampling_level="sequence"): with the default normalization
"seq-mean-token-mean" that is the paper's mean over sequences of l_i. Every token of a sequence
shares one ratio and one clipping decision. w_i is the sequence's importance weight against the
engine that sampled it: the geometric mean of its tokens' pi_old / pi_b, bounded by learn.is_mode /
learn.is_cap (passes.py). eps_low / eps_high are `learn.gspo_clip_low` / `learn.gspo_clip_high`
(default 3e-4 / 4e-4, the paper's: a sequence ratio is a mean of per-token log-ratios, far tighter
than a token ratio, so the range is ~1000x smaller than PPO's 0.2). clip_frac is the share of
sequences whose gradient the clip removed; the first step's is 0, since pi_old is the learner's.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from unstable_dask.learn.algorithms import Batch, Models, Spec, grpo

SPEC = Spec(unit="group", behaviour_logprobs=True, needs_groups=True)


class Config(grpo.PPOConfig):
    """[learn] with algorithm = "gspo": GRPO's settings but its token clip, plus the sequence clip."""
    algorithm: Literal["gspo"] = "gspo"
    """The algorithm: GSPO, GRPO with the ratio and its clip taken per sequence."""
    normalization: Literal["constant", "seq-mean-token-mean", "token-mean"] = "seq-mean-token-mean"
    """How the per-sequence terms become the loss (see grpo.py); the default is the paper's mean
    over sequences."""
    gspo_clip_low: float = Field(3e-4, gt=0.0, lt=1.0)
    """The sequence ratio is kept above 1 - gspo_clip_low (the paper's 3e-4)."""
    gspo_clip_high: float = Field(4e-4, gt=0.0)
    """The sequence ratio is kept below 1 + gspo_clip_high (the paper's 4e-4)."""


def sequence_objective(logp, old, weights, mask, adv, args: Config):
    """GSPO's clipped surrogate of each sequence, on each of its tokens [b, W], and the [b] mask of
    sequences whose gradient the clip removed."""
    import torch
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1))
    clipped = s.clamp(1 - args.gspo_clip_low, 1 + args.gspo_clip_high)
    loss = -torch.minimum(s * adv, clipped * adv) * weights
    return loss.unsqueeze(-1).expand_as(logp), clipped * adv < s * adv


def update(models: Models, batch: Batch, args: Config, device) -> dict:
    return grpo.update(models, batch, args, device, objective=sequence_objective)
