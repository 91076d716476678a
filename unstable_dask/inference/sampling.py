"""The distribution a token is drawn from, as log-probs: one definition for the engines and the learner.

A round samples at `temperature` T and nucleus `top_p`. The behaviour policy is therefore

    pi_b(x) = softmax(logits / T)(x) / Z_N   for x in the nucleus N, 0 outside it

where N is the smallest set of most likely tokens (of softmax(logits / T)) whose mass reaches
top_p, and Z_N is that mass. The HF engine records log pi_b of each sampled token, vLLM returns the
same with `logprobs_mode="processed_logprobs"` (temperature, top-k and top-p applied), and the
learner computes log pi_theta with this very function, so the importance ratio of an on-policy
sample is exactly 1 and clipping measures real policy drift. Top-p is kept (not ignored) because
the sampled token is always inside the nucleus: its probability under the un-truncated softmax
is not the probability it was drawn with. The nucleus set is chosen without gradient (a discrete
choice); gradient flows through the renormalised log-probs of the tokens inside it.

T <= 0 means greedy decoding: there is no sampling distribution, and the un-tempered log-softmax
is returned (a greedy round is not on-policy data for any learner).
"""
from __future__ import annotations

import torch


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log-probs over the last dimension of `logits` under temperature T and nucleus top_p (float32)."""
    scores = logits.float()
    if temperature <= 0:
        return torch.log_softmax(scores, dim=-1)
    scores = scores / temperature
    if top_p < 1.0:
        with torch.no_grad():
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            probs = sorted_scores.softmax(dim=-1)
            # drop a token when the mass of the tokens ranked above it already exceeds top_p
            # (the most likely token is always kept)
            drop_sorted = probs.cumsum(dim=-1) - probs > top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def sampling_entropy(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Entropy (nats) over the last dimension of the distribution `sampling_logprobs` defines
    (float32, with gradient; tokens outside the nucleus add nothing, and no NaN)."""
    logp = sampling_logprobs(logits, temperature, top_p)
    # 0 * log 0 = 0: zero the -inf entries before the product, so neither value nor gradient is NaN
    logp = logp.masked_fill(torch.isinf(logp), 0.0)
    return -(logp.exp() * logp).sum(-1)


def masked_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, target_mask: torch.Tensor,
                        temperature: float, top_p: float) -> torch.Tensor:
    """log pi(x_t | x_<t) under (temperature, top_p) for the tokens x_1..x_L-1 of rows of `input_ids`.

    `logits` [B, L-1, V] predict tokens 1..L-1; returns [B, L-1] float32 where entry t-1 scores
    token t when `target_mask[:, t-1]` is set (the completion tokens) and 0 elsewhere. Only the
    masked positions go through `sampling_logprobs` (a sort over the vocabulary), so prompts cost
    no memory there, and a prompt token outside the nucleus (-inf) never meets a 0 mask (NaN).
    """
    keep = target_mask.bool()
    picked = sampling_logprobs(logits[keep], temperature, top_p)
    values = picked.gather(-1, input_ids[:, 1:][keep].unsqueeze(-1)).squeeze(-1)
    return torch.zeros(keep.shape, dtype=values.dtype, device=values.device).masked_scatter(keep, values)

