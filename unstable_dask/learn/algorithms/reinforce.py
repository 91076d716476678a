"""REINFORCE as in UnstableBaselines, with its masking bug fixed (cleanrl style: one update, explicit).

For each sample: tokens = the prompt ids the engine fed ++ the completion ids it generated (EOS
included when generation stopped by itself), loss mask = completion tokens only (prompt AND
padding masked), log pi = the log-prob under the distribution the tokens were sampled from
(temperature and top-p of the sample's round, policy.py), and

    seq_logp = sum(mask * log pi) / max_generation_len     ("constant", Dr. GRPO)
             | sum(mask * log pi) / sum(mask)              ("token-mean")
    loss     = -mean(A * seq_logp)

accumulated over batch_size // mini_batch_size micro-batches, then grad clip, one AdamW step.
A is the batch query's advantage: the job's reward transforms, turn by turn (sampled as turns).
"""
from __future__ import annotations

import time
from typing import Literal, Optional

from pydantic import Field

from unstable_dask.config import LearnConfig
from unstable_dask.learn.algorithms import Batch, Models, Spec
from unstable_dask.learn.tokens import clip_and_step, completion_logprobs, logits_of, micro_batches, sequence_logprobs

SPEC = Spec(unit="turn")


class Config(LearnConfig):
    """[learn] with algorithm = "reinforce"."""
    algorithm: Literal["reinforce"] = "reinforce"
    normalization: Literal["constant", "token-mean"] = "constant"
    """Per-sequence divisor of summed token log-probs: max_generation_len ("constant", Dr. GRPO)
    or the completion's length ("token-mean")."""
    max_generation_len: Optional[int] = Field(None, gt=0)
    """The "constant" divisor; None: [model].max_new_tokens (filled in when the job is loaded)."""
    final_transforms: list[str] = ["RoleAdvantageByEnvFormatter()"]
    sampling_transforms: list[str] = ["NormalizeRewardsByEnv(z_score=True)"]


def update(models: Models, batch: Batch, args: Config, device) -> dict:
    """One REINFORCE update over the batch; returns the step's metrics."""
    t0 = time.perf_counter()
    model, optimizer, tokens, n = models.policy, models.optimizer, batch.tokens, batch.size
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, logp_sum = 0.0, 0.0
    for mb in micro_batches(n, args.mini_batch_size):
        ids, att, lm = tokens.input_ids[mb].to(device), tokens.attention_mask[mb].to(device), tokens.loss_mask[mb].to(device)
        logp = completion_logprobs(logits_of(model, ids, att), ids, lm, batch.temperature[mb], batch.top_p[mb])
        mask = lm[:, 1:].to(logp.dtype)  # shifted: mask[t] scores token t+1
        adv = batch.advantages[mb].to(device, logp.dtype)
        seq = sequence_logprobs(logp, mask, args.normalization, args.max_generation_len)
        # Sum over the micro-batch divided by the full batch size: the accumulated gradient is
        # exactly that of -mean(A * seq_logp) over the batch, whatever the micro-batch split.
        loss = -(adv * seq).sum() / n
        loss.backward()
        loss_sum += loss.item()
        logp_sum += seq.detach().sum().item()
    grad_norm = clip_and_step(optimizer, args.grad_clip)
    return dict(loss=loss_sum, pg_loss=loss_sum, logp_mean=logp_sum / n, grad_norm=grad_norm,
                optimizer_steps=1, step_time_s=time.perf_counter() - t0)
