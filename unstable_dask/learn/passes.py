"""What every update does with a batch, once: how rows are cut into optimizer steps and micro-batches,
one forward pass over a micro-batch, pi_old and the importance weights against the behaviour policy,
and how token terms become one loss. The algorithm files use these and keep only their math.

pi_old and the behaviour policy (verl's "decoupled" PPO, TRL's vLLM correction). The denominator of
every ratio is pi_old, the learner's own log-prob of the token before the update, computed by the
learner in its own numerics. The engine's stored log-prob (pi_b, the behaviour policy: another
engine, dtype, kernel or an older checkpoint) enters only as an importance weight on each token,
w = pi_old / pi_b: "truncate" multiplies the token's term by min(w, cap) (TIS); "mask" drops the
tokens with w outside [1/cap, cap] from the loss and its normaliser and keeps the others unweighted
(MIS, IcePop-style); "off" ignores pi_b (the metrics are still recorded). GSPO, whose ratio is per
sequence, takes the geometric mean of its tokens' w instead.
When the update is one optimizer step, pi_old is the gradient pass's own log-prob (theta = theta_old
there): no extra forward pass. With several steps (PPO epochs, mini-batches) a no-grad first pass
over the very micro-batches of the first epoch gives pi_old, so the first step's ratio is 1 bit for
bit whatever the dtype (same shapes, same kernels).

The first pass (or the single pass) also measures the engine/learner mismatch for learner_steps:
|log pi_old - log pi_b| (mean, max), the share of tokens outside the learner's nucleus (pi_old = 0),
the weights' mean, max, truncated share and effective sample size, and the policy's entropy (the
same per-token entropy that `learn.entropy_coef` rewards, verl's entropy_coeff).

Micro-batches: rows of one optimizer step sorted by length before they are cut, each trimmed to its
longest row, and the LM head applied only from the micro-batch's first completion position on
(`logits_to_keep` where the model has it): the loss needs logits at ~40 completion positions of a
~300-token row, not at every prompt position. Optimizer steps get rows shuffled with the batch seed
(reproducible), so a mini-batch is not one game's turns. learn.share_prefix (without gradient
checkpointing): the tokens all rows of a micro-batch start with are forwarded once and their keys
and values reused by every row, and a step's rows are ordered by content where that computes fewer
positions than ordering by length (a seat's turns share their rules text).

torch is imported inside functions: algorithm files import this module, and loading a job reads
their Config without importing torch.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Optional, Sequence, cast

from unstable_dask.learn.tokens import LOGP_FLOOR, Tokens, completion_logprobs

if TYPE_CHECKING:
    import torch


def plan(lengths: Sequence[int], rows_per_step: Optional[int], micro_size: int, epochs: int,
         seed: int, share: Optional[Tokens] = None) -> list[list[list[list[int]]]]:
    """epochs -> optimizer steps -> micro-batches, as row indices. Each epoch shuffles the rows with
    `seed` (the batch seed: reproducible) before cutting steps of `rows_per_step` (None: all rows);
    each step's rows are sorted by length, then cut into micro-batches of `micro_size`. `share`: the
    batch's tokens when forward passes share prefixes (learn.share_prefix); a step's rows are then
    sorted by content instead where that computes fewer positions (`positions`)."""
    import torch
    n = len(lengths)
    gen = torch.Generator().manual_seed(int(seed))
    ids = share.input_ids.tolist() if share is not None else []
    out = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).tolist() if rows_per_step is not None and rows_per_step < n else list(range(n))
        per = rows_per_step or n
        steps = []
        for s in range(0, n, per):
            rows = sorted(order[s:s + per], key=lambda i: (lengths[i], i))
            micro = [rows[m:m + micro_size] for m in range(0, len(rows), micro_size)]
            if share is not None:
                by_content = sorted(rows, key=lambda i: (ids[i][:lengths[i]], i))
                other = [by_content[m:m + micro_size] for m in range(0, len(rows), micro_size)]
                micro = min(micro, other, key=lambda mb: positions(share, mb))
            steps.append(micro)
        out.append(steps)
    return out


def shared_prefix(tokens: Tokens, rows: list[int], limit: int) -> int:
    """How many leading tokens all of `rows` have in common, at most `limit`."""
    if len(rows) < 2 or limit <= 0:
        return 0
    block = tokens.input_ids[rows, :limit]
    return int((block == block[:1]).all(0).long().cumprod(0).sum())


def _window(tokens: Tokens, rows: list[int]) -> tuple[int, int]:
    """(length, first): a micro-batch's longest row and the first position whose logits its loss
    needs (the one before its earliest completion token)."""
    length = int(tokens.attention_mask[rows].sum(-1).max())
    target = tokens.loss_mask[rows, 1:length]
    return length, int(target.any(0).nonzero().min()) if bool(target.any()) else length - 1


def positions(tokens: Tokens, micro: list[list[int]]) -> int:
    """Token positions the forward passes over these micro-batches compute when each computes its
    shared prefix once (the cost `plan` minimises)."""
    total = 0
    for rows in micro:
        length, first = _window(tokens, rows)
        shared = shared_prefix(tokens, rows, first)
        total += shared + len(rows) * (length - shared)
    return total


@functools.lru_cache(maxsize=None)
def _keeps_logits(cls: Any) -> bool:
    """Whether a model class computes logits for a suffix only (transformers' `logits_to_keep`)."""
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


@dataclass
class Pass:
    """One forward pass over a micro-batch, windowed to its completion positions."""
    rows: list[int]
    start: int  # window start, in the [B, T-1] coordinates of the batch's per-token tensors
    end: int  # window end (exclusive)
    logits: "torch.Tensor"  # [b, W, V]
    logp: "torch.Tensor"  # [b, W] float32 log-probs under each row's sampling distribution (floored)
    mask: "torch.Tensor"  # [b, W] 1.0 on completion tokens
    window_ids: "torch.Tensor"  # [b, W+1] the tokens of the window (logits[:, t] predicts window_ids[:, t+1])
    window_lm: "torch.Tensor"  # [b, W+1] their loss mask

    def take(self, x: "torch.Tensor") -> "torch.Tensor":
        """This pass's rows and window of a [B, T-1] per-token tensor of the batch."""
        return x[self.rows][:, self.start:self.end].to(self.logp.device)

    def relogprobs(self, temperature: Sequence[float], top_p: Sequence[float]) -> "torch.Tensor":
        """The same tokens' log-probs from the same logits under other sampling settings (per row of
        the pass), with gradient."""
        return completion_logprobs(self.logits, self.window_ids, self.window_lm, temperature, top_p)

    def entropy(self, temperature: Sequence[float], top_p: Sequence[float], grad: bool) -> "torch.Tensor":
        """[b, W] entropy (nats) of each row's sampling distribution (its temperature and top-p, per
        row of the pass) at its completion positions, 0 elsewhere; with gradient when `grad`."""
        import torch

        from unstable_dask.inference.sampling import sampling_entropy
        keep = self.mask.bool()
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            parts = [sampling_entropy(self.logits[i][keep[i]], temperature[i], top_p[i]) for i in range(keep.shape[0])]
            values = torch.cat(parts) if parts else self.mask.new_zeros(0)
            return torch.zeros(keep.shape, dtype=values.dtype, device=values.device).masked_scatter(keep, values)


def forward(model: Any, tokens: Tokens, rows: list[int], temperature: Sequence[float], top_p: Sequence[float],
            device: Any, share: bool = False) -> Pass:
    """Log-probs of the completion tokens of `rows` under their sampling distributions, computing
    logits only from the first completion position of the micro-batch on. `share`
    (learn.share_prefix): the tokens all rows start with are forwarded once, as one row whose keys
    and values every row then attends to (with gradient through them)."""
    import torch
    length, first = _window(tokens, rows)
    ids = tokens.input_ids[rows, :length].to(device)
    att = tokens.attention_mask[rows, :length].to(device)
    lm = tokens.loss_mask[rows, :length].to(device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    keeps = _keeps_logits(cast(Hashable, type(base)))
    # transformers drops the cache under gradient checkpointing: the rows would lose their prefix
    checkpointing = model.training and bool(getattr(base, "is_gradient_checkpointing", False))
    shared = shared_prefix(tokens, rows, first) if share and keeps and not checkpointing else 0
    if shared:
        cache = model(input_ids=ids[:1, :shared], use_cache=True, logits_to_keep=1).past_key_values
        cache.batch_repeat_interleave(len(rows))
        logits = model(input_ids=ids[:, shared:], attention_mask=att, past_key_values=cache, use_cache=True,
                       logits_to_keep=length - first).logits[:, :-1]
    elif keeps:
        # logits at positions first..length-1; the last one predicts past the row: dropped
        logits = model(input_ids=ids, attention_mask=att, logits_to_keep=length - first).logits[:, :-1]
    else:
        logits = model(input_ids=ids, attention_mask=att).logits[:, first:-1]
    window_ids = ids[:, first:]  # token t+1 of window position t
    window_lm = lm[:, first:]
    logp = completion_logprobs(logits, window_ids, window_lm, [temperature[i] for i in rows], [top_p[i] for i in rows])
    return Pass(rows, first, length - 1, logits, logp, window_lm[:, 1:].to(torch.float32), window_ids, window_lm)


def aggregate(x: "torch.Tensor", mask: "torch.Tensor", mode: str, max_len: Optional[int], rows: int,
              tokens: int) -> "torch.Tensor":
    """A micro-batch's share of one step's loss from per-token terms `x` [b, W] (verl's agg_loss):
    "constant": mean over the step's rows of sum_t x / max_len (Dr. GRPO); "seq-mean-token-mean":
    mean over rows of mean_t x; "token-mean": sum of x over the step's tokens / their number (DAPO).
    `rows` / `tokens`: the whole step's rows and completion tokens, so micro-batches add up to it."""
    if mode == "token-mean":
        return (x * mask).sum() / max(tokens, 1)
    if mode == "constant":
        if max_len is None:  # jobfile fills it in from [model].max_new_tokens
            raise ValueError("normalization 'constant' needs max_generation_len")
        return (x * mask).sum() / (max_len * rows)
    return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / rows


@dataclass
class Mismatch:
    """pi_old against the behaviour log-probs, token by token, and the importance weights from it."""
    mode: str  # "truncate" | "mask" | "off"
    cap: float
    gaps: list = field(default_factory=list)  # |log pi_old - log pi_b| on tokens with pi_b
    raw: list = field(default_factory=list)  # untruncated weights pi_old / pi_b
    fresh_gaps: list = field(default_factory=list)  # the same on rows of Batch.fresh (the guard's)
    outside: int = 0  # tokens with pi_old = 0 (outside the learner's nucleus)
    tokens: int = 0
    entropy_sum: float = 0.0

    def weights(self, old: "torch.Tensor", behaviour: "torch.Tensor", known: "torch.Tensor",
                mask: "torch.Tensor", fresh: Optional["torch.Tensor"] = None) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(weights, kept mask) [b, W] for one micro-batch, recording its mismatch. Rows without
        known behaviour log-probs (`known` [b] False) get weight 1; `fresh` [b]: rows whose gap
        the guard reads (Batch.fresh)."""
        import torch
        on = mask.bool() & known.unsqueeze(-1)
        log_ratio = (old - behaviour).clamp(-20.0, 20.0)  # verl clamps the same way before exp
        ratio = torch.where(on, log_ratio.exp(), torch.ones_like(old)).detach()
        self.gaps.append((old - behaviour)[on].abs().detach().cpu())
        if fresh is not None:
            self.fresh_gaps.append((old - behaviour)[on & fresh.to(on.device).unsqueeze(-1)].abs().detach().cpu())
        self.raw.append(ratio[on].cpu())
        self.outside += int(((old <= LOGP_FLOOR) & mask.bool()).sum())
        self.tokens += int(mask.sum())
        return self._bound(ratio, mask)

    def sequence_weights(self, old: "torch.Tensor", behaviour: "torch.Tensor", known: "torch.Tensor",
                         mask: "torch.Tensor", fresh: Optional["torch.Tensor"] = None) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(weights, kept) [b] per sequence (GSPO): the geometric mean of its tokens' ratios, bounded
        as the token weights are."""
        import torch
        self.weights(old, behaviour, known, mask, fresh)  # the token-level record, for the metrics
        n = mask.sum(-1).clamp(min=1)
        log_ratio = ((old - behaviour).clamp(-20.0, 20.0) * mask).sum(-1) / n
        ratio = torch.where(known, log_ratio.exp(), torch.ones_like(log_ratio)).detach()
        return self._bound(ratio, torch.ones_like(ratio))

    def kept(self, old: "torch.Tensor", behaviour: "torch.Tensor", known: "torch.Tensor", mask: "torch.Tensor",
             per_sequence: bool = False) -> "torch.Tensor":
        """The [b, W] mask of the completion tokens the weights keep in the loss (all of them unless
        mode is "mask"), recording nothing: what `weights` / `sequence_weights` would keep."""
        import torch
        log_ratio = (old - behaviour).clamp(-20.0, 20.0)
        if per_sequence:
            seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            ratio = torch.where(known, seq.exp(), torch.ones_like(seq))
            return mask * self._bound(ratio, torch.ones_like(ratio))[1].unsqueeze(-1)
        on = mask.bool() & known.unsqueeze(-1)
        return self._bound(torch.where(on, log_ratio.exp(), torch.ones_like(old)), mask)[1]

    def _bound(self, ratio: "torch.Tensor", mask: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        import torch
        if self.mode == "truncate":
            return ratio.clamp(max=self.cap), mask
        if self.mode == "mask":
            inside = ((ratio <= self.cap) & (ratio >= 1.0 / self.cap)).to(mask.dtype)
            return torch.ones_like(ratio), mask * inside
        return torch.ones_like(ratio), mask

    def add_entropy(self, entropy: "torch.Tensor", mask: "torch.Tensor") -> None:
        """Record a pass's per-token entropies (`Pass.entropy`) at the completion positions."""
        self.entropy_sum += float((entropy.detach() * mask).sum())

    def fresh_gap(self) -> Optional[float]:
        """Mean |log pi_old - log pi_b| over the tokens of Batch.fresh rows (None: none)."""
        import torch
        gaps = torch.cat(self.fresh_gaps) if self.fresh_gaps else torch.zeros(0)
        return float(gaps.mean()) if len(gaps) else None

    def metrics(self) -> dict:
        import torch
        gaps = torch.cat(self.gaps) if self.gaps else torch.zeros(0)
        raw = torch.cat(self.raw) if self.raw else torch.zeros(0)
        out = dict(logp_gap_mean=float(gaps.mean()) if len(gaps) else None,
                   logp_gap_max=float(gaps.max()) if len(gaps) else None,
                   outside_nucleus_frac=self.outside / max(self.tokens, 1),
                   entropy=self.entropy_sum / max(self.tokens, 1) if self.entropy_sum else None)
        if len(raw):
            high = (raw > self.cap) | ((raw < 1.0 / self.cap) if self.mode == "mask" else torch.zeros_like(raw, dtype=torch.bool))
            out.update(is_weight_mean=float(raw.mean()), is_weight_max=float(raw.max()),
                       is_bounded_frac=float(high.float().mean()),
                       is_ess=float(raw.mean() ** 2 / (raw ** 2).mean()))
        return out


def kept_tokens(model: Any, batch: Any, step: list[list[int]], device: Any, per_sequence: bool = False,
                share: bool = False) -> int:
    """The completion tokens of one optimizer step's micro-batches (`batch`: an algorithms.Batch)
    that the importance weights keep: the "token-mean" normaliser under learn.is_mode = "mask",
    where dropped tokens leave the loss and its normaliser. A no-grad pass, needed only when the
    weights are not known before the gradient pass (one optimizer step)."""
    import torch
    n = 0
    with torch.no_grad():
        for rows in step:
            p = forward(model, batch.tokens, rows, batch.temperature, batch.top_p, device, share)
            n += int(batch.mismatch.kept(p.logp, p.take(batch.behaviour), batch.known[rows].to(p.logp.device), p.mask,
                                         per_sequence).sum())
    return n


def step_is_zero(optimizer: Any) -> bool:
    """True when the accumulated gradient is exactly zero everywhere (or absent): AdamW would still
    move the weights by its momentum, so such a step is skipped."""
    return all(p.grad is None or not bool(p.grad.any()) for g in optimizer.param_groups for p in g["params"])
