"""GRPO / Dr. GRPO with PPO-style epochs (cleanrl style: explicit loops).

Groups. `round.group_size = G` plays every train start state G times (same env, seed, seating
and opponents) and gives the G games one `group_id`. A group here is (group_id, pid): the same seat
of the same start state, G exchangeable attempts by one agent (pooling both seats of a zero-sum
game would cancel the outcome). The batch query samples whole groups and GroupRelativeAdvantage
z-scores each turn's reward (final reward + the turn's step shaping) inside its group, every
attempt weighing the same however many turns it took:

    w_gt   = 1 / n_g                      (n_g = turns of attempt g in the group)
    mu     = sum w r / sum w,   sd = sqrt(sum w (r - mu)^2 / sum w)
    A_gt   = (r_gt - mu) / (sd + 1e-8)

With outcome rewards only this is textbook GRPO over the G attempts (mu, sd of the G outcomes);
a group whose attempts all ended alike has A = 0 except for step shaping. An attempt in which the
seat never moved (the game ended before its turn) has no turns: it holds nothing to train on and
does not enter the statistic.

Default transforms for GRPO: no final transform (RoleAdvantageByEnvFormatter's EMA baseline is
shared by a group up to tau-sized drift, which the z-score would blow up into noise) and
GroupRelativeAdvantage() as the only sampling transform (NormalizeRewardsByEnv on top would only
rescale the z-scores). A job that lists transforms gets exactly those, in the order listed.

Per completion token t of sample i, with log pi under the row's sampling distribution (policy.py)
and pi_old the behaviour policy (the engine's log-probs of the same distribution, stored in the
lake):

    ratio = exp(log pi - log pi_old)
    obj   = min(ratio * A_i, clip(ratio, 1 - clip_ratio, 1 + clip_ratio) * A_i)
    k3    = exp(ref - log pi_T) - (ref - log pi_T) - 1
    loss  = -mean_i [ sum_t mask * (obj - kl_coef * k3) / norm_i ]

norm_i = max_generation_len (Dr. GRPO's constant) or the sample's completion length. The k3 KL is
to the frozen base (the adapter disabled), with both at the row's temperature and without top-p
(pi_T, ref): truncated distributions have different supports, where KL is infinite.

PPO-style updates: `ppo_epochs` passes over the batch, each cut into consecutive mini-batches of
`ppo_mini_batch_size` rows (default: the whole batch); one optimizer step per mini-batch, its
gradient accumulated over micro-batches of `mini_batch_size` rows. pi_old stays the behaviour
policy for every step, so the first step's ratio is 1 (on-policy) and later steps' are not:
clipping acts, and clip_frac is the share of tokens whose gradient the clip removed (the clipped
term is the minimum: ratio above 1 + eps with A > 0, below 1 - eps with A < 0). Rows without
usable stored log-probs (cut by max_train_len) take the policy's own log-probs before the first
step as pi_old. The metrics are averages over the optimizer steps (clip_frac over all their
tokens).

`update` takes the per-sample objective as an argument: gspo.py reuses the loop.
"""
from __future__ import annotations

import time
from typing import Callable, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator

from unstable_dask.config import LearnConfig
from unstable_dask.learn.algorithms import Batch, Models, Spec
from unstable_dask.learn.tokens import clip_and_step, completion_logprobs, logits_of, micro_batches, normalizer

SPEC = Spec(unit="group", behaviour_logprobs=True, needs_groups=True)


class PPOConfig(LearnConfig):
    """What GRPO and GSPO share: PPO-style epochs over one batch, a KL penalty to the base."""
    normalization: Literal["constant", "token-mean"] = "constant"
    """Per-sequence divisor of summed token terms: max_generation_len ("constant", Dr. GRPO) or
    the completion's length ("token-mean")."""
    max_generation_len: Optional[int] = Field(None, gt=0)
    """The "constant" divisor; None: [model].max_new_tokens (filled in when the job is loaded)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the k3 KL to the frozen base model (0: no reference forward pass)."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over one sampled batch (verl's ppo_epochs)."""
    ppo_mini_batch_size: Optional[int] = Field(None, gt=0)
    """Rows per optimizer step inside an epoch (verl's ppo_mini_batch_size); None: the whole batch.
    Between mini_batch_size and batch_size."""
    final_transforms: list[str] = []
    sampling_transforms: list[str] = ["GroupRelativeAdvantage()"]

    @field_validator("ppo_mini_batch_size")
    @classmethod
    def _ppo_mini(cls, m: Optional[int], info: ValidationInfo) -> Optional[int]:
        lo, hi = info.data.get("mini_batch_size"), info.data.get("batch_size")
        if m is not None and lo is not None and hi is not None and not lo <= m <= hi:
            raise ValueError(f"it must lie between learn.mini_batch_size ({lo}) and learn.batch_size ({hi})")
        return m


class Config(PPOConfig):
    """[learn] with algorithm = "grpo"."""
    algorithm: Literal["grpo"] = "grpo"
    clip_ratio: float = Field(0.2, gt=0.0)
    """PPO's token-ratio clip: ratio kept within [1 - clip_ratio, 1 + clip_ratio]."""


def token_objective(logp, old, mask, adv, args):
    """GRPO's clipped surrogate: per-sample sum_t mask * obj / norm_i, and (clipped, counted) tokens."""
    import torch
    ratio = torch.exp(logp - old)
    clipped = ratio.clamp(1 - args.clip_ratio, 1 + args.clip_ratio)
    a = adv.unsqueeze(-1)
    obj = torch.minimum(ratio * a, clipped * a)
    per_sample = (obj * mask).sum(-1) / normalizer(mask, args.normalization, args.max_generation_len)
    acting = (clipped * a < ratio * a).to(mask.dtype) * mask  # the clip is the minimum: no gradient
    return per_sample, acting.sum().item(), mask.sum().item()


def update(models: Models, batch: Batch, args: PPOConfig, device, objective: Optional[Callable] = None) -> dict:
    import torch
    t0 = time.perf_counter()
    objective = objective or token_objective
    model, optimizer, tokens, n = models.policy, models.optimizer, batch.tokens, batch.size
    model.train()
    old = batch.old_logp.clone()
    missing = (~batch.has_old).nonzero().flatten().tolist()
    if missing:  # pi_old = the policy before the first step
        with torch.no_grad():
            for mb in micro_batches(len(missing), args.mini_batch_size):
                rows = missing[mb]
                ids, lm = tokens.input_ids[rows].to(device), tokens.loss_mask[rows].to(device)
                logits = logits_of(model, ids, tokens.attention_mask[rows].to(device))
                old[rows] = completion_logprobs(logits, ids, lm, [batch.temperature[i] for i in rows],
                                                [batch.top_p[i] for i in rows]).cpu()
    steps = []
    for _epoch in range(args.ppo_epochs):
        for mini in micro_batches(n, args.ppo_mini_batch_size or n):  # one optimizer step each
            m = mini.stop - mini.start
            optimizer.zero_grad(set_to_none=True)
            s = dict(loss=0.0, pg_loss=0.0, kl=0.0, logp=0.0, clipped=0.0, counted=0.0)
            for start in range(mini.start, mini.stop, args.mini_batch_size):  # gradient accumulation
                mb = slice(start, min(start + args.mini_batch_size, mini.stop))
                ids, att = tokens.input_ids[mb].to(device), tokens.attention_mask[mb].to(device)
                lm = tokens.loss_mask[mb].to(device)
                temp, top_p = batch.temperature[mb], batch.top_p[mb]
                logits = logits_of(model, ids, att)
                logp = completion_logprobs(logits, ids, lm, temp, top_p)
                mask = lm[:, 1:].to(logp.dtype)
                adv = batch.advantages[mb].to(device, logp.dtype)
                per_sample, clipped, counted = objective(logp, old[mb].to(device), mask, adv, args)
                pg = -per_sample.sum() / m
                loss, kl = pg, torch.zeros((), device=device)
                norm = normalizer(mask, args.normalization, args.max_generation_len)
                if args.kl_coef > 0:
                    with torch.no_grad(), model.disable_adapter():  # type: ignore[operator]
                        ref = completion_logprobs(logits_of(model, ids, att), ids, lm, temp, [1.0] * len(temp))
                    d = ref - completion_logprobs(logits, ids, lm, temp, [1.0] * len(temp))
                    kl = ((d.exp() - d - 1) * mask).sum(-1).div(norm).sum() / m
                    loss = loss + args.kl_coef * kl
                loss.backward()
                s["loss"] += loss.item()
                s["pg_loss"] += pg.item()
                s["kl"] += kl.item()
                s["logp"] += ((logp.detach() * mask).sum(-1) / norm).sum().item()
                s["clipped"] += clipped
                s["counted"] += counted
            s["grad_norm"] = clip_and_step(optimizer, args.grad_clip)
            s["logp"] /= m
            steps.append(s)
    mean = {k: sum(s[k] for s in steps) / len(steps) for k in ("loss", "pg_loss", "kl", "logp", "grad_norm")}
    clip_frac = sum(s["clipped"] for s in steps) / max(sum(s["counted"] for s in steps), 1)
    return dict(loss=mean["loss"], pg_loss=mean["pg_loss"], kl=mean["kl"], logp_mean=mean["logp"],
                grad_norm=mean["grad_norm"], clip_frac=clip_frac, optimizer_steps=len(steps),
                step_time_s=time.perf_counter() - t0)
