"""Bradley-Terry maximum likelihood with bootstrap 95% confidence intervals (as Chatbot Arena).

P(i beats j) = sigmoid(theta_i - theta_j); a draw counts as half a win for each side. Scores are
on the Elo scale, 1000 + 400 * log10(e) * theta, with the mean model at 1000. A weak ridge prior
(theta ~ N(0, 1/ridge)) keeps the estimate finite for a model that never lost; with it the optimum
has mean(theta) = 0 by itself, so no model needs to be pinned.

The confidence interval resamples games with replacement (`bootstrap` times), refits, and takes
the 2.5th and 97.5th percentiles. Resampling games is drawing a multinomial over the outcome
cells (i won / draw / j won for each pair) with the observed frequencies, which is what is done
here: the result depends only on the counts, never on game order, and is fixed by `seed`.
rank = 1 + the number of models whose lower bound is above this model's upper bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
from scipy.linalg import cho_factor, cho_solve

ELO_SCALE = 400.0 / math.log(10.0)
ELO_BASE = 1000.0


@dataclass
class BTResult:
    models: list[str]  # sorted
    score: np.ndarray  # Elo-scale maximum-likelihood score
    ci_low: np.ndarray  # 2.5th bootstrap percentile (nan when bootstrap = 0)
    ci_high: np.ndarray  # 97.5th bootstrap percentile
    rank: np.ndarray  # 1 + models whose ci_low > this ci_high (point scores when bootstrap = 0)
    samples: np.ndarray  # (bootstrap, models) Elo-scale scores of the resamples (0 rows when bootstrap = 0)


def mle(n_models: int, i: np.ndarray, j: np.ndarray, s: np.ndarray, n: np.ndarray,
        ridge: float = 0.01, tol: float = 1e-10, max_iter: int = 100, start: np.ndarray | None = None) -> np.ndarray:
    """theta maximising sum s log p_ij + (n - s) log(1 - p_ij) - ridge/2 |theta|^2 (Newton's method).

    Cells: model i[k] vs j[k], n[k] games, s[k] = wins of i + draws / 2.
    """
    theta = np.zeros(n_models) if start is None else start.copy()
    for _ in range(max_iter):
        # clipped: a resample where a model only ever wins can send a Newton step far out (exp overflows)
        p = 1.0 / (1.0 + np.exp(np.clip(theta[j] - theta[i], -700.0, 700.0)))
        r = s - n * p  # d loglik / d theta_i for each cell
        grad = np.bincount(i, r, n_models) - np.bincount(j, r, n_models) - ridge * theta
        wgt = n * p * (1.0 - p)
        # Negative Hessian: the weighted graph Laplacian of the comparisons plus the ridge.
        H: np.ndarray = -(np.bincount(i * n_models + j, wgt, n_models * n_models)
              + np.bincount(j * n_models + i, wgt, n_models * n_models)).reshape(n_models, n_models)
        H[np.diag_indices(n_models)] += np.bincount(i, wgt, n_models) + np.bincount(j, wgt, n_models) + ridge
        # H is positive definite (ridge > 0). Cholesky through scipy: numpy's threaded solve is
        # 100x slower on small matrices when the cores are busy.
        step = cho_solve(cho_factor(H), grad)
        theta += step
        if np.max(np.abs(step)) < tol:
            break
    return theta


def outcome_cells(pairs: Iterable[tuple[str, str, int, int, int]]) -> tuple[list[str], np.ndarray]:
    """Canonical (sorted, merged) outcome counts: rows (i, j, wins_i, draws, wins_j) with i < j."""
    acc: dict[tuple[str, str], list[int]] = {}
    for a, b, wa, d, wb in pairs:
        if a == b:
            continue  # self-play says nothing about relative strength
        key, counts = ((a, b), [wa, d, wb]) if a < b else ((b, a), [wb, d, wa])
        cell = acc.setdefault(key, [0, 0, 0])
        for k in range(3):
            cell[k] += int(counts[k])
    models = sorted({m for key in acc for m in key})
    ix = {m: k for k, m in enumerate(models)}
    rows = [(ix[a], ix[b], *acc[(a, b)]) for a, b in sorted(acc)]
    return models, np.array(rows, dtype=np.int64).reshape(-1, 5)


def fit(pairs: Iterable[tuple[str, str, int, int, int]], bootstrap: int = 200, seed: int = 0,
        ridge: float = 0.01, prior: int = 0) -> BTResult:
    """Fit BT on pairwise counts (model_a, model_b, wins_a, draws, wins_b), with bootstrap CIs.

    `prior`: virtual wins given to each side of every pair that met, in the fit and the resampling
    (the league's 1, as in the rule of succession: without it a pair that won its few games every
    time wins every resample, and would look certain)."""
    models, cells = outcome_cells(pairs)
    if not models:
        empty = np.zeros(0)
        return BTResult(models=[], score=empty, ci_low=empty, ci_high=empty, rank=np.zeros(0, dtype=np.int64),
                        samples=np.zeros((0, 0)))
    i, j, counts = cells[:, 0], cells[:, 1], cells[:, 2:].astype(np.float64)
    counts[:, [0, 2]] += prior

    def theta(c: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
        return mle(len(models), i, j, c[:, 0] + 0.5 * c[:, 1], c.sum(axis=1), ridge, start=start)

    best = theta(counts)
    point = ELO_BASE + ELO_SCALE * best
    lo = hi = np.full(len(models), np.nan)
    samples = np.zeros((0, len(models)))
    total = int(counts.sum())
    if bootstrap > 0 and total > 0:
        rng = np.random.default_rng(seed)
        probs = (counts / total).ravel()
        draws = rng.multinomial(total, probs, size=bootstrap).reshape(bootstrap, -1, 3).astype(np.float64)
        # Each resample starts Newton at the full-data optimum: a few steps instead of ten.
        samples = ELO_BASE + ELO_SCALE * np.stack([theta(d, best) for d in draws])
        lo, hi = np.percentile(samples, 2.5, axis=0), np.percentile(samples, 97.5, axis=0)
    bl, bh = (point, point) if np.isnan(lo).all() else (lo, hi)
    rank = 1 + (bl[None, :] > bh[:, None]).sum(axis=1)
    return BTResult(models=models, score=point, ci_low=lo, ci_high=hi, rank=rank.astype(np.int64), samples=samples)
