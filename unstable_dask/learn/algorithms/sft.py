"""SFT: supervised fine-tuning on turns the job selects (an expert's moves), a warm start for RL.

Each row is a turn the job's `learn.select` picked (learn/selection.py; default: the turns of expert
seats such as `minimax` outside eval games): x = its observation in the learner's own prompt template,
y = its action written as that template asks (`[4]`, or `\\boxed{4}`), then EOS, both tokenized as the
engine would have fed and generated them. The loss is the mean negative log-likelihood per target
token over the batch, prompt and padding masked:

    loss = - sum_{i,t} log pi(y_{i,t} | x_i, y_{i,<t}) / sum_i |y_i|

under the model's own distribution (temperature 1, no top-p), accumulated over micro-batches of
mini_batch_size rows, then grad clip and one AdamW step per update (learn.updates_per_round updates,
each a batch drawn with its own seed: with batch_size >= the selected turns, that many epochs).
No reward, advantage or engine log-prob enters: SPEC.rows = "selected" keeps the learner's guards
of played rows (exact ids, served weights, staleness) away from rows no engine made.
Metrics: loss = nll (nats per target token, before the step), token_accuracy (target tokens that
are the model's argmax), exact_match (rows whose every target token is). The checkpoint is a
normal adapter: the next `learn` (reinforce, grpo, ...) continues from it (its parent_uid).
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import field_validator

from unstable_dask.config import LearnConfig
from unstable_dask.learn import distributed, passes
from unstable_dask.learn.algorithms import Batch, Models, Spec
from unstable_dask.learn.selection import DEFAULT_SELECT
from unstable_dask.learn.tokens import clip_and_step

SPEC = Spec(unit="turn", rows="selected")


class Config(LearnConfig):
    """[learn] with algorithm = "sft"."""
    algorithm: Literal["sft"] = "sft"
    """The algorithm: supervised fine-tuning (NLL) on the turns learn.select picks."""
    select: str = DEFAULT_SELECT
    """One SELECT over `turns` (the run's turns of the iteration's rounds) returning whole turns
    (at least round, game_id, turn, pid, env_id, observation, action): the rows SFT imitates, each
    observation rendered in the learner's template and the action as its target. Default: the turns
    of expert seats (minimax, minimax-first, kuhn-best) outside eval games. SQL function
    expert_action(expert, env_id, observation) relabels any turn with the expert's move (DAgger)."""
    step_transforms: list[str] = []
    """Unused by sft (no rewards): must stay empty; choose turns with learn.select."""

    @field_validator("final_transforms", "step_transforms", "sampling_transforms")
    @classmethod
    def _no_rewards(cls, v: list[str]) -> list[str]:
        if v:
            raise ValueError("sft imitates the turns learn.select picks and has no rewards: leave the reward "
                             "transforms empty and filter turns in learn.select instead")
        return v


def update(models: Models, batch: Batch, args: Config, device) -> dict:
    """One SFT step over the batch; returns the step's metrics."""
    import torch
    t0 = time.perf_counter()
    model, optimizer, tokens, n = models.policy, models.optimizer, batch.tokens, batch.size
    model.train()
    optimizer.zero_grad(set_to_none=True)
    (step,), = passes.plan(tokens.attention_mask.sum(-1).tolist(), None, args.mini_batch_size, 1, batch.seed,
                             share=tokens if args.shares_prefix() else None)
    n_tokens = int(tokens.loss_mask.sum())
    nll, hits, exact = 0.0, 0.0, 0.0
    for rows in distributed.shard(step):
        p = passes.forward(model, tokens, rows, batch.temperature, batch.top_p, device, args.shares_prefix())
        loss = -passes.aggregate(p.logp, p.mask, "token-mean", None, n, n_tokens)
        loss.backward()
        nll += loss.item()
        with torch.no_grad():  # logits[:, t] predict window_ids[:, t + 1]
            right = (p.logits.argmax(-1) == p.window_ids[:, 1:]) & p.mask.bool()
            hits += float(right.sum())
            exact += float((right.sum(-1) == p.mask.sum(-1)).sum())
    nll, hits, exact = distributed.reduce_step(optimizer, dict(nll=nll, hits=hits, exact=exact)).values()
    skipped = passes.step_is_zero(optimizer)
    grad_norm = 0.0 if skipped else clip_and_step(optimizer, args.grad_clip)
    return dict(loss=nll, nll=nll, advantage_mean=None, advantage_std=None,  # no advantages: every row weighs 1
                token_accuracy=hits / max(n_tokens, 1), exact_match=exact / max(n, 1),
                grad_norm=grad_norm, optimizer_steps=0 if skipped else 1, skipped_steps=int(skipped),
                step_time_s=time.perf_counter() - t0)
