"""Bradley-Terry: recovers known strengths, order-independent, deterministic, ties count half."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
from scipy.optimize import minimize

from unstable_dask.rate import bradley_terry as bt


def synthetic_pairs(theta: dict[str, float], games: int, seed: int, draw: float = 0.1) -> list[tuple]:
    rng = random.Random(seed)
    names = sorted(theta)
    out = []
    for _ in range(games):
        a, b = rng.sample(names, 2)
        if rng.random() < draw:
            out.append((a, b, 0, 1, 0))
        elif rng.random() < 1 / (1 + math.exp(theta[b] - theta[a])):
            out.append((a, b, 1, 0, 0))
        else:
            out.append((a, b, 0, 0, 1))
    return out


def test_recovers_known_strengths() -> None:
    theta = {f"m{k}": 0.5 * k - 1.75 for k in range(8)}  # mean 0, like the fit
    # No draws here: random draws would shrink every score toward the mean (a draw counts half).
    res = bt.fit(synthetic_pairs(theta, 12000, seed=1, draw=0.0), bootstrap=200, seed=0)
    assert res.models == sorted(theta)
    assert list(np.argsort(res.score)) == list(range(8))  # rank order recovered
    truth = np.array([bt.ELO_BASE + bt.ELO_SCALE * theta[m] for m in res.models])
    covered = (res.ci_low <= truth) & (truth <= res.ci_high)
    assert covered.sum() >= 7, (res.ci_low, truth, res.ci_high)
    assert np.all(res.ci_low < res.score) and np.all(res.score < res.ci_high)
    assert res.rank[-1] == 1 and res.rank[0] > res.rank[-1]


def test_mle_is_the_penalised_optimum() -> None:
    pairs = synthetic_pairs({"a": 0.0, "b": 1.0, "c": -0.5, "d": 2.0}, 400, seed=2)
    models, cells = bt.outcome_cells(pairs)
    i, j = cells[:, 0], cells[:, 1]
    s, n = cells[:, 2] + 0.5 * cells[:, 3], cells[:, 2:].sum(axis=1)

    def nll(t: np.ndarray) -> float:
        d = t[i] - t[j]
        return float(-(s * -np.logaddexp(0, -d) + (n - s) * -np.logaddexp(0, d)).sum() + 0.005 * (t ** 2).sum())

    ref = minimize(nll, np.zeros(4), method="BFGS", options={"gtol": 1e-10}).x
    ours = bt.mle(4, i, j, s, n, ridge=0.01)
    assert np.allclose(ours, ref, atol=1e-4) and nll(ours) <= nll(ref) + 1e-9


def test_order_independent_and_deterministic() -> None:
    pairs = synthetic_pairs({"x": 0.3, "y": -0.2, "z": 0.0, "w": 1.0}, 500, seed=3)
    shuffled = pairs[:]
    random.Random(9).shuffle(shuffled)
    flipped = [(b, a, wb, d, wa) for a, b, wa, d, wb in shuffled]  # the same games seen from the other side
    r1, r2, r3 = (bt.fit(p, bootstrap=50, seed=4) for p in (pairs, shuffled, flipped))
    for r in (r2, r3):
        assert r.models == r1.models
        assert np.array_equal(r.score, r1.score) or np.allclose(r.score, r1.score, atol=1e-9)
        assert np.allclose(r.ci_low, r1.ci_low, atol=1e-9) and np.allclose(r.ci_high, r1.ci_high, atol=1e-9)
    again = bt.fit(pairs, bootstrap=50, seed=4)
    assert np.array_equal(again.ci_low, r1.ci_low) and np.array_equal(again.rank, r1.rank)
    other = bt.fit(pairs, bootstrap=50, seed=5)
    assert not np.array_equal(other.ci_low, r1.ci_low)


def test_ties_count_half_and_rank_rule() -> None:
    res = bt.fit([("a", "b", 0, 10, 0)], bootstrap=20, seed=0)
    assert res.score[0] == pytest.approx(res.score[1]) == pytest.approx(bt.ELO_BASE)
    assert res.score[0] == pytest.approx(bt.fit([("a", "b", 5, 0, 5)], bootstrap=0).score[0])
    # Clearly separated: a >> b >> c, with many games.
    res = bt.fit([("a", "b", 900, 0, 100), ("b", "c", 900, 0, 100), ("a", "c", 990, 0, 10)], bootstrap=100, seed=0)
    assert list(res.rank) == [1, 2, 3]
    # Indistinguishable: nobody's lower bound is above anybody's upper bound.
    res = bt.fit([("a", "b", 3, 0, 2), ("b", "c", 2, 1, 2)], bootstrap=100, seed=0)
    assert list(res.rank) == [1, 1, 1]


def test_undefeated_model_stays_finite_and_no_bootstrap_gives_nan_ci() -> None:
    res = bt.fit([("a", "b", 20, 0, 0)], bootstrap=0)
    assert np.all(np.isfinite(res.score)) and res.score[0] > res.score[1]
    assert np.isnan(res.ci_low).all() and list(res.rank) == [1, 2]
    assert bt.fit([], bootstrap=10).models == []
    assert bt.fit([("a", "a", 3, 0, 0)]).models == []  # self-play carries no information
