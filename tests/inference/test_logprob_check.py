"""The log-prob check the engine tests share (logprob_check.py) accepts fp32 noise and a true
nucleus-boundary flip, and still fails the nucleus rules that are wrong by one token's mass."""
import pytest
import torch

from unstable_dask.inference.sampling import sampling_logprobs

from helpers import logprob_check

T, TOP_P = 0.7, 0.95


def boundary_logits() -> torch.Tensor:
    """Row 0: logits whose 10th most likely token has a mass above it of top_p + 2e-7 (below the
    fp32 noise of a cumulative sum), so its place in the nucleus is a coin flip; then 200 ordinary rows."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(201, 512, generator=gen) * 2
    tail = (torch.rand(511, generator=gen, dtype=torch.float64) * 0.5 + 0.5).sort(descending=True).values
    c, k = TOP_P + 2e-7, 10  # p0 + tail[:k-1] = c * (p0 + tail.sum())
    p0 = (c * tail.sum() - tail[: k - 1].sum()) / (1 - c)
    p = torch.cat([p0[None], tail])
    rows[0] = (torch.log(p / p.sum()) * T).float()
    return rows


def wrong_rule(logits: torch.Tensor) -> torch.Tensor:
    """`cumsum > top_p` drops the token that crosses top_p: off by one token's mass, everywhere."""
    scores = logits.float() / T
    s, order = scores.sort(-1, descending=True)
    drop = torch.zeros_like(s, dtype=torch.bool).scatter(-1, order, s.softmax(-1).cumsum(-1) > TOP_P)
    return torch.log_softmax(scores.masked_fill(drop, float("-inf")), -1)


def test_exact_and_fp32_noise_pass():
    logits = boundary_logits()[1:]
    targets = logits.argmax(-1)
    lp = sampling_logprobs(logits, T, TOP_P).gather(-1, targets[:, None])[:, 0]
    v = logprob_check.check(logits, targets, lp + 5e-7, T, TOP_P)
    assert v.flips == 0 and v.max_exact == pytest.approx(5e-7, rel=0.1)


def test_a_true_boundary_flip_passes_and_is_counted():
    logits = boundary_logits()
    targets = logits.argmax(-1)
    exact = sampling_logprobs(logits, T, TOP_P).gather(-1, targets[:, None])[:, 0]
    # the engine's fp32 cumsum kept the first dropped token of row 0: its normaliser is one token larger
    p = torch.softmax(logits[0].double() / T, -1)
    sp, _ = p.sort(descending=True)
    k = int((sp.cumsum(0) - sp <= TOP_P).sum())
    stored = exact.clone().double()
    stored[0] = float(torch.log(p[targets[0]]) - torch.log(sp[: k + 1].sum()))
    v = logprob_check.check(logits, targets, stored, T, TOP_P)
    assert v.flips == 1
    # the same jump on an ordinary row is not a boundary flip
    stored[5] -= float(torch.log1p(torch.tensor(1e-3)))
    with pytest.raises(AssertionError, match="token 5 "):
        logprob_check.check(logits, targets, stored, T, TOP_P)


def test_a_wrong_nucleus_rule_fails():
    logits = boundary_logits()[1:]
    targets = logits.argsort(-1, descending=True)[:, 3]  # well inside every nucleus
    stored = wrong_rule(logits).gather(-1, targets[:, None])[:, 0]
    with pytest.raises(AssertionError, match="neither within"):
        logprob_check.check(logits, targets, stored, T, TOP_P)


def test_top_p_one_allows_no_flip():
    logits = boundary_logits()
    targets = logits.argmax(-1)
    lp = sampling_logprobs(logits, T, 1.0).gather(-1, targets[:, None])[:, 0]
    with pytest.raises(AssertionError):
        logprob_check.check(logits, targets, lp - 1e-4, T, 1.0)
