"""REINFORCE as in UnstableBaselines, with its masking bug fixed (cleanrl style: one update, explicit).

For each sample: tokens = prompt ++ completion (++ eos when generation stopped by itself), loss
mask = completion tokens only (prompt AND padding masked), and

    seq_logp = sum(mask * logp) / max_generation_len     ("constant", Dr. GRPO)
             | sum(mask * logp) / sum(mask)              ("token-mean")
    loss     = -mean(A * seq_logp)

accumulated over batch_size // mini_batch_size micro-batches, then grad clip, one AdamW step.
The helpers here (tokenize, token_logprobs, sequence_logprobs) are shared by a2c.py and grpo.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class ReinforceArgs:
    mini_batch_size: int = 8
    grad_clip: float = 0.2
    normalization: str = "constant"  # "constant" (divide by max_generation_len) | "token-mean"
    max_generation_len: int = 64
    max_train_len: Optional[int] = None  # truncate prompt + completion to this many tokens
    pad_id: int = 0


@dataclass
class Tokens:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens
    loss_mask: torch.Tensor  # [B, T] 1 on completion tokens
    last_prompt: torch.Tensor  # [B] index of each sample's last prompt token (A2C reads V there)
    truncated: torch.Tensor  # [B] bool: cut by max_train_len


def tokenize(tokenizer, prompts: Sequence[str], completions: Sequence[str], add_eos: Sequence[bool],
             max_train_len: Optional[int], pad_id: int) -> Tokens:
    """Prompt and completion are tokenized apart, so the loss mask falls exactly on the completion.

    A sample longer than max_train_len loses prompt tokens from the left first (the completion is
    what carries gradient), then completion tokens from the right.
    """
    rows, masks, last, cut = [], [], [], []
    for p, c, eos in zip(prompts, completions, add_eos):
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(c, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
        over = 0 if max_train_len is None else len(p_ids) + len(c_ids) - max_train_len
        if over > 0:
            drop_p = min(over, max(len(p_ids) - 1, 0))  # keep >= 1 prompt token to condition on
            p_ids = p_ids[drop_p:]
            c_ids = c_ids[: max(len(c_ids) - (over - drop_p), 0)]
        rows.append(p_ids + c_ids)
        masks.append([0] * len(p_ids) + [1] * len(c_ids))
        last.append(len(p_ids) - 1)
        cut.append(over > 0)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    lm = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        att[i, : len(r)] = 1
        lm[i, : len(r)] = torch.tensor(m)
    return Tokens(ids, att, lm, torch.tensor(last), torch.tensor(cut))


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(x_t | x_<t) for t = 1..T-1, shape [B, T-1] (float32 whatever the model dtype)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    if logits.dtype in (torch.bfloat16, torch.float16):  # log-softmax in half precision loses the signal
        logits = logits.float()
    target = input_ids[:, 1:].unsqueeze(-1)
    return logits.gather(-1, target).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def sequence_logprobs(logp: torch.Tensor, mask: torch.Tensor, normalization: str, max_generation_len: int) -> torch.Tensor:
    """Per-sample log-prob of the completion, normalised as configured. `mask` aligns with `logp`."""
    total = (logp * mask).sum(-1)
    if normalization == "constant":
        return total / max_generation_len
    return total / mask.sum(-1).clamp(min=1)


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def update(model, optimizer: torch.optim.Optimizer, tokens: Tokens, advantages: torch.Tensor,
           args: ReinforceArgs, device: torch.device) -> dict:
    """One REINFORCE update over the batch; returns the step's metrics."""
    t0 = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    n = tokens.input_ids.shape[0]
    loss_sum, logp_sum = 0.0, 0.0
    for mb in micro_batches(n, args.mini_batch_size):
        ids = tokens.input_ids[mb].to(device)
        att = tokens.attention_mask[mb].to(device)
        logp = token_logprobs(model, ids, att)
        mask = tokens.loss_mask[mb, 1:].to(device, logp.dtype)  # shifted: mask[t] scores token t+1
        adv = advantages[mb].to(device, logp.dtype)
        seq = sequence_logprobs(logp, mask, args.normalization, args.max_generation_len)
        # Sum over the micro-batch divided by the full batch size: the accumulated gradient is
        # exactly that of -mean(A * seq_logp) over the batch, whatever the micro-batch split.
        loss = -(adv * seq).sum() / n
        loss.backward()
        loss_sum += loss.item()
        logp_sum += seq.detach().sum().item()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    optimizer.step()
    return dict(loss=loss_sum, pg_loss=loss_sum, logp_mean=logp_sum / n, grad_norm=float(grad_norm),
                step_time_s=time.perf_counter() - t0)
