"""REINFORCE as in UnstableBaselines, with its masking bug fixed (cleanrl style: one update, explicit).

For each sample: tokens = the prompt ids the engine fed ++ the completion ids it generated (EOS
included when generation stopped by itself), loss mask = completion tokens only (prompt AND
padding masked), log pi = the log-prob under the distribution the tokens were sampled from
(temperature and top-p of the sample's round, learn/tokens.py), w_t the importance weight of the
token against the engine that sampled it (passes.py: pi_old / pi_b, truncated at learn.is_cap; 1 on
the engine's own numerics), and the loss, aggregated as `normalization` says:

    "constant"             -mean_i [ A_i * sum_t w_t log pi_t / max_generation_len ]   (Dr. GRPO; UB's)
    "seq-mean-token-mean"  -mean_i [ A_i * mean_t w_t log pi_t ]
    "token-mean"           -sum_{i,t} A_i w_t log pi_t / (completion tokens of the batch)  (DAPO)

minus learn.entropy_coef times the entropy H_t of the sampling distribution at each completion
token, aggregated the same way (verl: policy_loss = pg_loss - entropy_coeff * entropy_loss),

accumulated over micro-batches of mini_batch_size rows, then grad clip, one AdamW step (skipped
when the gradient is exactly zero: AdamW's momentum would move the adapter for nothing). One
optimizer step means pi_old is the gradient pass's own log-prob: no extra forward pass.
A is the batch query's advantage: the job's reward transforms, turn by turn (sampled as turns).
"""
from __future__ import annotations

import time
from typing import Literal, Optional

from pydantic import Field

from unstable_dask.config import LearnConfig
from unstable_dask.learn import distributed, passes
from unstable_dask.learn.algorithms import Batch, Models, Spec
from unstable_dask.learn.tokens import clip_and_step

SPEC = Spec(unit="turn")


class Config(LearnConfig):
    """[learn] with algorithm = "reinforce"."""
    algorithm: Literal["reinforce"] = "reinforce"
    """The algorithm: REINFORCE on single turns."""
    normalization: Literal["constant", "seq-mean-token-mean", "token-mean"] = "constant"
    """How token terms become the loss: per sequence over max_generation_len ("constant", Dr. GRPO),
    per sequence over its length ("seq-mean-token-mean"), or over the batch's tokens ("token-mean")."""
    max_generation_len: Optional[int] = Field(None, gt=0)
    """The "constant" divisor; unset: [model].max_new_tokens (filled in when the job is loaded)."""
    final_transforms: list[str] = ["RoleAdvantageByEnvFormatter()"]
    """Reward transforms once per game and learner seat; default (UnstableBaselines'): the final
    reward minus its role's running average, an EMA per env and seat."""
    sampling_transforms: list[str] = ["NormalizeRewardsByEnv(z_score=True)"]
    """Reward transforms over the sampled batch; default: rewards z-scored per env (UnstableBaselines')."""


def update(models: Models, batch: Batch, args: Config, device) -> dict:
    """One REINFORCE update over the batch; returns the step's metrics."""
    t0 = time.perf_counter()
    model, optimizer, tokens, n = models.policy, models.optimizer, batch.tokens, batch.size
    model.train()
    optimizer.zero_grad(set_to_none=True)
    (step,), = passes.plan(tokens.attention_mask.sum(-1).tolist(), None, args.mini_batch_size, 1, batch.seed,
                             share=tokens if args.shares_prefix() else None)
    n_tokens = int(tokens.loss_mask.sum())
    # is_mode = "mask" drops tokens from the loss and from "token-mean"'s normaliser: count them first
    n_kept = (passes.kept_tokens(model, batch, step, device, share=args.shares_prefix())
              if batch.mismatch.mode == "mask" and args.normalization == "token-mean" else n_tokens)
    loss_sum, pg_sum, logp_sum = 0.0, 0.0, 0.0
    for rows in distributed.shard(step):  # this rank's micro-batches (all of them in one process)
        p = passes.forward(model, tokens, rows, batch.temperature, batch.top_p, device, args.shares_prefix())
        old = p.logp.detach()  # theta = theta_old in the one optimizer step
        w, mask = batch.mismatch.weights(old, p.take(batch.behaviour), batch.known[rows].to(old.device), p.mask,
                                         batch.fresh_rows(rows))
        entropy = p.entropy([batch.temperature[i] for i in rows], [batch.top_p[i] for i in rows],
                            grad=args.entropy_coef > 0)
        batch.mismatch.add_entropy(entropy, p.mask)
        adv = batch.advantages[rows].to(device, p.logp.dtype).unsqueeze(-1)
        pg = -passes.aggregate(adv * w * p.logp, mask, args.normalization, args.max_generation_len, n, n_kept)
        loss = pg
        if args.entropy_coef > 0:
            loss = pg - args.entropy_coef * passes.aggregate(entropy, p.mask, args.normalization,
                                                             args.max_generation_len, n, n_tokens)
        loss.backward()
        loss_sum += loss.item()
        pg_sum += pg.item()
        logp_sum += passes.aggregate(old, p.mask, args.normalization, args.max_generation_len, n, n_tokens).item()
    loss_sum, pg_sum, logp_sum = distributed.reduce_step(optimizer, dict(loss=loss_sum, pg=pg_sum, logp=logp_sum)).values()
    skipped = passes.step_is_zero(optimizer)
    grad_norm = 0.0 if skipped else clip_and_step(optimizer, args.grad_clip)
    return dict(loss=loss_sum, pg_loss=pg_sum, logp_mean=logp_sum, grad_norm=grad_norm,
                optimizer_steps=0 if skipped else 1, skipped_steps=int(skipped), step_time_s=time.perf_counter() - t0)
