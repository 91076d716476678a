"""TrueSkill for one game at a time, as the rate job replays them: a duel is one game in one track.

2-team games (two models, or one model vs the dummy) use the closed-form 2-team
TrueSkill update below; N-player games go through `trueskill.TrueSkill.rate`. The package's
default backend computes the normal cdf from a Chebyshev erfc approximation (fractional error
< 1.2e-7), so the closed form uses the same approximation and the same draw margin and agrees
with the package to rounding. Where the package would raise FloatingPointError (an upset so
extreme that float64 cannot represent it) that game is rated with the mpmath backend.
"""
from __future__ import annotations

import math

from unstable_dask.config import RatingsConfig
from unstable_dask.skill import inherited, make_env

FAST, SOLO, MIRROR, MULTI = 0, 1, 2, 3  # duel kinds
_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _erfc(x: float) -> float:
    # The Chebyshev fit trueskill's default backend uses (see module docstring).
    z = abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    r = t * math.exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277)))))))))
    return 2.0 - r if x < 0 else r


def replay_duels(start: int, end: int, da: list, db: list, dout: list, dkind: list, mu: list, sg: list,
                 seen: list, parent: list, cfg: RatingsConfig, margin: float) -> int:
    """Rate duels start..end-1 in place; return the index of the first duel it cannot rate.

    A duel is one game in one track: slots da[k] vs db[k] (db = -1: the dummy), dout = +1 when
    da won, -1 when db won, 0 for a draw. Returns early (that index) at a MULTI duel or where the
    package would raise FloatingPointError; the caller rates that one and calls again.
    """
    exp, sqrt = math.exp, math.sqrt
    mu0, sigma0, k_inherit = cfg.mu, cfg.sigma, cfg.inherit_sigma_factor
    tau2, beta2x2 = cfg.tau ** 2, 2.0 * cfg.beta ** 2
    for k in range(start, end):
        kind = dkind[k]
        if kind == MULTI:
            return k
        for s in (da[k], db[k]):
            if s >= 0 and not seen[s]:
                enter_track(s, mu, sg, seen, parent, mu0, sigma0, k_inherit)
        if kind == MIRROR:
            continue
        a, b, o = da[k], db[k], dout[k]
        ma, va = mu[a], sg[a] ** 2 + tau2
        mb, vb = (mu[b], sg[b] ** 2 + tau2) if b >= 0 else (mu0, sigma0 ** 2 + tau2)
        if o < 0:  # winner first, as the package sorts teams by rank
            a, b, ma, mb, va, vb = b, a, mb, ma, vb, va
        c2 = va + vb + beta2x2
        c = sqrt(c2)
        t, eps = (ma - mb) / c, margin / c
        if o != 0:
            x = t - eps
            d = 0.5 * _erfc(-x / _SQRT2)
            v = _INV_SQRT_2PI * exp(-0.5 * x * x) / d if d else -x
            w = v * (v + x)
            if not 0.0 < w < 1.0:
                return k
        else:
            at = abs(t)
            pa_, pb_ = eps - at, -eps - at
            d = 0.5 * (_erfc(-pa_ / _SQRT2) - _erfc(-pb_ / _SQRT2))
            if not d:
                return k
            fa, fb = _INV_SQRT_2PI * exp(-0.5 * pa_ * pa_), _INV_SQRT_2PI * exp(-0.5 * pb_ * pb_)
            v = (fb - fa) / d
            w = v * v + (pa_ * fa - pb_ * fb) / d
            if t < 0:
                v = -v
        if a >= 0:
            mu[a], sg[a] = ma + va / c * v, sqrt(va * (1.0 - va / c2 * w))
        if b >= 0:
            mu[b], sg[b] = mb - vb / c * v, sqrt(vb * (1.0 - vb / c2 * w))
    return end


def enter_track(s: int, mu: list, sg: list, seen: list, parent: list, mu0: float, sigma0: float, k: float) -> None:
    """First game of slot s in its track (parent[s] = -1: none)."""
    mu[s], sg[s] = inherited(s, lambda x: parent[x] if parent[x] >= 0 else None,
                             lambda x: (mu[x], sg[x]) if seen[x] else None, mu0, sigma0, k)
    seen[s] = True


def package_rate(cfg: RatingsConfig, ratings: list[tuple[float, float]], ranks: list[int]) -> list[tuple[float, float]]:
    """One game through trueskill.TrueSkill.rate, with the mpmath backend where floats fail."""
    for backend in (None, "mpmath"):
        env = make_env(cfg, backend)
        try:
            out = env.rate([(env.create_rating(m, s),) for m, s in ratings], ranks=ranks)
            return [(float(g[0].mu), float(g[0].sigma)) for g in out]
        except FloatingPointError:
            if backend is not None:
                raise
    raise AssertionError("unreachable")


def dense_ranks(rewards: list[float]) -> list[int]:
    """0 = best; equal rewards share a rank."""
    order = sorted(set(rewards), reverse=True)
    return [order.index(r) for r in rewards]
