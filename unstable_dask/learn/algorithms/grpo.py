"""GRPO / Dr. GRPO / DAPO-style token-mean, with PPO-style epochs (cleanrl style: explicit loops).

Groups. `round.group_size = G` plays every train start state G times (same env, seed, seating
and opponents) and gives the G games one `group_id`. A group here is (group_id, pid): the same seat
of the same start state, G exchangeable attempts by one agent (pooling both seats of a zero-sum
game would cancel the outcome). The batch query samples whole groups, and the default sampling
transform GroupRelativeAdvantage(scale="group") gives A = (r - mean of the group) / (its
unbiased std + 1e-8), every attempt weighing the same however many turns it took (transforms.py has
the exact formula; scale="batch" divides by the batch's std instead, scale="none" is Dr. GRPO).
A group whose attempts all scored alike has A = 0 on every row: without a KL penalty it carries no
signal, so the trainer drops it before optimizer steps are cut (learner_steps.zero_std_group_frac,
rows_dropped). With kl_coef > 0 it is kept: its KL term is the only force on a policy whose groups
all fail alike (every move invalid), and it pulls that policy back towards the base, which scores.

Default transforms: no final transform (RoleAdvantageByEnvFormatter's EMA baseline is shared by a
group up to tau-sized drift, which the z-score would blow up into noise) and
GroupRelativeAdvantage() as the only sampling transform. A job that lists transforms gets exactly
those, in the order listed.

Per completion token t of sample i, with log pi under the row's sampling distribution, pi_old the
learner's own log-prob before the update (passes.py) and w_t the importance weight against the
engine that sampled the token (pi_old / pi_b, truncated at learn.is_cap), as verl computes it:

    ratio = exp(log pi - log pi_old)
    l1    = -A_i * ratio,   l2 = -A_i * clip(ratio, 1 - clip_ratio, 1 + clip_ratio)
    l     = max(l1, l2)                                   (PPO's clip)
    l     = min(l, -A_i * clip_ratio_c)   where A_i < 0    (dual-clip; clip_ratio_c = 3, 0: off)
    k3    = min(exp(ref - log pi_T) - (ref - log pi_T) - 1, 10)   (the KL to the base, clamped)
    loss  = aggregate over tokens of  w_t * l + kl_coef * k3 - entropy_coef * H_t
                                                   (`normalization`: see reinforce.py)

The k3 KL is to the frozen base (the adapter disabled), with both at the row's temperature and
without top-p (pi_T, ref): truncated distributions have different supports, where KL is infinite.

PPO-style updates: `ppo_epochs` passes over the batch, rows shuffled with the batch seed and cut
into mini-batches of `ppo_mini_batch_size` rows (default: the whole batch); one optimizer step per
mini-batch, its gradient accumulated over micro-batches of `mini_batch_size` rows. With more than
one step, a no-grad first pass over the first epoch's micro-batches gives pi_old, so the first
step's ratio is exactly 1 (clip_frac_first = 0) and later steps' are not: clipping acts, and
clip_frac is the share of tokens whose gradient the clip removed. With one step, pi_old is that
step's own log-prob. A step whose gradient is exactly zero is skipped (skipped_steps).
The metrics are means over the optimizer steps (clip_frac over all their tokens); ppo_kl is verl's:
the mean over tokens of log pi_old - log pi.

`update` takes the per-sample objective as an argument: gspo.py reuses the loop.
"""
from __future__ import annotations

import time
from typing import Callable, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator

from unstable_dask.config import MAX_EPOCHS, LearnConfig
from unstable_dask.learn import distributed, passes
from unstable_dask.learn.algorithms import Batch, Models, Spec
from unstable_dask.learn.tokens import clip_and_step

SPEC = Spec(unit="group", behaviour_logprobs=True, needs_groups=True)


class PPOConfig(LearnConfig):
    """What GRPO and GSPO share: PPO-style epochs over one batch, a KL penalty to the base."""
    normalization: Literal["constant", "seq-mean-token-mean", "token-mean"] = "constant"
    """How token terms become the loss: per sequence over max_generation_len ("constant", Dr. GRPO),
    per sequence over its length ("seq-mean-token-mean", verl's and TRL's "grpo"), or over all the
    step's tokens ("token-mean", DAPO)."""
    max_generation_len: Optional[int] = Field(None, gt=0)
    """The "constant" divisor; unset: [model].max_new_tokens (filled in when the job is loaded)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the k3 KL to the frozen base model (0: no reference forward pass); each token's k3
    is clamped at 10, as verl does."""
    ppo_epochs: int = Field(1, gt=0, le=MAX_EPOCHS)
    """Passes over one sampled batch (verl's ppo_epochs)."""
    ppo_mini_batch_size: Optional[int] = Field(None, gt=0)
    """Rows per optimizer step inside an epoch (verl's ppo_mini_batch_size); unset: the whole batch.
    Between mini_batch_size and batch_size."""
    final_transforms: list[str] = []
    """Reward transforms once per game and learner seat; default none: the group's comparison is the
    baseline."""
    sampling_transforms: list[str] = ["GroupRelativeAdvantage()"]
    """Reward transforms over the sampled batch; default: the group-relative advantage, each reward
    minus its group's mean over the group's standard deviation (GRPO)."""

    def silent_rows_have_gradient(self) -> bool:
        return self.kl_coef > 0 or super().silent_rows_have_gradient()

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
    """The algorithm: GRPO, a clipped token-ratio objective on group-relative advantages."""
    clip_ratio: float = Field(0.2, gt=0.0)
    """PPO's token-ratio clip: ratio kept within [1 - clip_ratio, 1 + clip_ratio]."""
    clip_ratio_c: float = Field(3.0, ge=0.0)
    """Dual-clip for negative advantages (verl's clip_ratio_c): a token's loss is at most
    -A * clip_ratio_c, so a ratio far above 1 on a bad action cannot blow up; 0 turns it off.
    Must exceed 1 when on."""

    @field_validator("clip_ratio_c")
    @classmethod
    def _dual(cls, c: float) -> float:
        if 0 < c <= 1:
            raise ValueError("the dual-clip bound must be > 1 (verl's default 3.0), or 0 to turn it off")
        return c


def token_objective(logp, old, weights, mask, adv, args):
    """GRPO's per-token loss (dual-clipped PPO surrogate times the IS weights) and, for clip_frac,
    a mask of the tokens whose gradient the clip removed."""
    import torch
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    a = adv.unsqueeze(-1)
    l1, l2 = -a * ratio, -a * ratio.clamp(1 - args.clip_ratio, 1 + args.clip_ratio)
    loss = torch.maximum(l1, l2)
    clipped = l2 > l1
    if args.clip_ratio_c > 0:
        l3 = -a * args.clip_ratio_c
        clipped = torch.where(a < 0, clipped | (loss > l3), clipped)
        loss = torch.where(a < 0, torch.minimum(loss, l3), loss)
    return loss * weights, clipped


def update(models: Models, batch: Batch, args: PPOConfig, device, objective: Optional[Callable] = None) -> dict:
    import torch
    t0 = time.perf_counter()
    objective = objective or token_objective
    per_sequence = objective is not token_objective  # GSPO: one ratio and one IS weight per sequence
    model, optimizer, tokens = models.policy, models.optimizer, batch.tokens
    epochs = passes.plan(tokens.attention_mask.sum(-1).tolist(), args.ppo_mini_batch_size, args.mini_batch_size,
                         args.ppo_epochs, batch.seed, share=tokens if args.shares_prefix() else None)
    several = sum(len(e) for e in epochs) > 1
    # pi_old, the IS weights and the kept mask of every row, fixed for the whole update
    old_all = torch.zeros_like(batch.behaviour)
    w_all = torch.ones(batch.size) if per_sequence else torch.ones_like(batch.behaviour)
    keep_all = torch.ones_like(w_all)

    def weigh(p: passes.Pass, old: "torch.Tensor") -> None:
        rows = p.rows
        weigher = batch.mismatch.sequence_weights if per_sequence else batch.mismatch.weights
        w, keep = weigher(old, p.take(batch.behaviour), batch.known[rows].to(old.device), p.mask,
                          batch.fresh_rows(rows))
        if per_sequence:
            w_all[rows], keep_all[rows] = w.cpu(), keep.cpu()
        else:
            w_all[rows, p.start:p.end], keep_all[rows, p.start:p.end] = w.cpu(), (keep * p.mask).cpu()

    if several:  # pi_old: a no-grad pass over the first epoch's very micro-batches (same shapes)
        model.eval()
        with torch.no_grad():
            for step in epochs[0]:
                for rows in distributed.shard(step):  # this rank's micro-batches (all in one process)
                    p = passes.forward(model, tokens, rows, batch.temperature, batch.top_p, device, args.shares_prefix())
                    old_all[rows, p.start:p.end] = p.logp.cpu()
                    weigh(p, p.logp)
                    batch.mismatch.add_entropy(p.entropy([batch.temperature[i] for i in rows],
                                                         [batch.top_p[i] for i in rows], grad=False), p.mask)
        distributed.share_rows([i for step in epochs[0] for rows in distributed.shard(step) for i in rows],
                               old_all, w_all, keep_all)
    # The completion tokens the IS weights keep (is_mode = "mask" drops some from the loss and from
    # "token-mean"'s normaliser); with one step they are known only after a no-grad pass.
    kept_all = tokens.loss_mask[:, 1:] * (keep_all.unsqueeze(-1) if per_sequence else keep_all)
    mask_mean = batch.mismatch.mode == "mask" and args.normalization == "token-mean"
    model.train()
    steps = []
    for epoch in epochs:
        for step in epoch:
            m = sum(len(rows) for rows in step)
            step_rows = [i for rows in step for i in rows]
            step_tokens = int(tokens.loss_mask[step_rows].sum())
            step_kept = (int(kept_all[step_rows].sum()) if several else
                         passes.kept_tokens(model, batch, step, device, per_sequence, args.shares_prefix()) if mask_mean else step_tokens)
            optimizer.zero_grad(set_to_none=True)
            s = dict(loss=0.0, pg_loss=0.0, kl=0.0, logp=0.0, ppo_kl=0.0, tokens=0.0, clipped=0.0, counted=0.0)
            for rows in distributed.shard(step):  # gradient accumulation over (this rank's) micro-batches
                temp, top = [batch.temperature[i] for i in rows], [batch.top_p[i] for i in rows]
                p = passes.forward(model, tokens, rows, batch.temperature, batch.top_p, device, args.shares_prefix())
                entropy = p.entropy(temp, top, grad=True) if args.entropy_coef > 0 else None
                if several:
                    old = p.take(old_all)
                else:  # one optimizer step: theta = theta_old in it
                    old = p.logp.detach()
                    weigh(p, old)
                    batch.mismatch.add_entropy(entropy if entropy is not None else p.entropy(temp, top, grad=False),
                                               p.mask)
                if per_sequence:
                    w, mask = w_all[rows].to(old.device), p.mask * keep_all[rows].to(old.device).unsqueeze(-1)
                else:
                    w, mask = p.take(w_all), p.take(keep_all) * p.mask  # keep_all is 1 outside the first pass's windows
                adv = batch.advantages[rows].to(device, p.logp.dtype)
                per_token, clipped = objective(p.logp, old, w, mask, adv, args)
                pg = passes.aggregate(per_token, mask, args.normalization, args.max_generation_len, m, step_kept)
                loss, kl = pg, torch.zeros((), device=device)
                if args.kl_coef > 0:  # k3 to the frozen base at temperature T, without top-p (same support)
                    ones = [1.0] * batch.size
                    with torch.no_grad(), model.disable_adapter():  # type: ignore[operator]
                        ref = passes.forward(model, tokens, rows, batch.temperature, ones, device, args.shares_prefix()).logp
                    d = ref - p.relogprobs(temp, [1.0] * len(rows))
                    k3 = (d.exp() - d - 1).clamp(max=10.0)
                    kl = passes.aggregate(k3, mask, args.normalization, args.max_generation_len, m, step_kept)
                    loss = loss + args.kl_coef * kl
                if entropy is not None:
                    loss = loss - args.entropy_coef * passes.aggregate(entropy, p.mask, args.normalization,
                                                                       args.max_generation_len, m, step_tokens)
                loss.backward()
                s["loss"] += loss.item()
                s["pg_loss"] += pg.item()
                s["kl"] += kl.item()
                s["logp"] += passes.aggregate(p.logp.detach(), p.mask, args.normalization, args.max_generation_len,
                                              m, step_tokens).item()
                s["ppo_kl"] += float(((old - p.logp.detach()) * mask).sum())
                s["tokens"] += float(mask.sum())
                if clipped.dim() == 2:  # tokens whose gradient the clip removed
                    s["clipped"] += float((clipped.to(mask.dtype) * mask).sum())
                    s["counted"] += float(mask.sum())
                else:  # GSPO: sequences
                    kept = mask.sum(-1) > 0
                    s["clipped"] += float((clipped & kept).sum())
                    s["counted"] += float(kept.sum())
            s = distributed.reduce_step(optimizer, s)  # over the ranks, before the clip
            skipped = passes.step_is_zero(optimizer)
            s["grad_norm"] = 0.0 if skipped else clip_and_step(optimizer, args.grad_clip)
            s["skipped"] = float(skipped)
            steps.append(s)
    mean = {k: sum(s[k] for s in steps) / len(steps) for k in ("loss", "pg_loss", "kl", "logp", "grad_norm")}
    return dict(loss=mean["loss"], pg_loss=mean["pg_loss"], kl=mean["kl"], logp_mean=mean["logp"],
                grad_norm=mean["grad_norm"],
                clip_frac=sum(s["clipped"] for s in steps) / max(sum(s["counted"] for s in steps), 1),
                clip_frac_first=steps[0]["clipped"] / max(steps[0]["counted"], 1),
                ppo_kl=sum(s["ppo_kl"] for s in steps) / max(sum(s["tokens"] for s in steps), 1),
                optimizer_steps=int(sum(1 - s["skipped"] for s in steps)),
                skipped_steps=int(sum(s["skipped"] for s in steps)), step_time_s=time.perf_counter() - t0)
