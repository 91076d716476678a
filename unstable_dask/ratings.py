"""The rate job: replay every committed game of a run and write TrueSkill + Bradley-Terry tables.

Replay rules (the ratings are a pure function of the lake):

* Order: committed rounds of `job.run.name`, each in (round, game_id) order; seats by pid.
  Eval games are replayed too unless `[ratings] include_eval = false`.
* Tracks: every game updates two independent TrueSkill tracks, the overall one (env_id '*')
  and the one of its env_id.
* Outcome: higher final reward = better rank, equal rewards share a rank. A single-player game
  is played against a dummy opponent with a fresh prior each time (reward > 0 win, < 0 loss,
  0 draw); the dummy is never stored. Games with a missing reward or model_uid are skipped.
* Mirror self-play (one model_uid in every seat) says nothing about relative skill: such games
  do not move TrueSkill or Bradley-Terry and are counted in `mirror_games` only. When a model
  holds several (not all) seats of an N-player game, its seats merge into one team whose
  reward is their mean, so each model is rated once per game.
* Priors: a model enters a track at its first game there. A checkpoint inherits the current mu of
  its nearest ancestor already in that track (lineage from the `checkpoints` table) with
  sigma * inherit_sigma_factor, capped at the initial sigma; other models start at (mu, sigma).
* Speed: 2-team games (two models, or one model vs the dummy) use the closed-form 2-team
  TrueSkill update below; N-player games go through `trueskill.TrueSkill.rate`. The package's
  default backend computes the normal cdf from a Chebyshev erfc approximation (fractional error
  < 1.2e-7), so the closed form uses the same approximation and the same draw margin and agrees
  with the package to rounding. Where the package would raise FloatingPointError (an upset so
  extreme that float64 cannot represent it) that game is rated with the mpmath backend.
* Incremental: the replay state (every mu/sigma and counter) is saved in the lake table
  `ratings_state`; a later rate job replays only rounds newer than the saved ones, which equals a
  full replay. A rating-parameter change, a lineage change of a rated model, or a newly committed
  round older than the saved state forces a full replay.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import trueskill

from . import bradley_terry, lake
from .config import Job, JobError, RatingsConfig

OVERALL = "*"

SCHEMAS: dict[str, pa.Schema] = {
    "ratings": pa.schema([
        ("model_uid", pa.string()), ("env_id", pa.string()),  # env_id '*' = all envs
        ("mu", pa.float64()), ("sigma", pa.float64()), ("conservative", pa.float64()),  # mu - 3 sigma
        ("games", pa.int64()), ("wins", pa.int64()), ("draws", pa.int64()), ("losses", pa.int64()),
        ("mirror_games", pa.int64()),  # self-play games, not rated
        ("bt_score", pa.float64()), ("bt_ci_low", pa.float64()), ("bt_ci_high", pa.float64()),
        ("rank", pa.int64()),  # 1 + models whose BT lower bound is above this upper bound
    ]),
    "rating_history": pa.schema([
        ("round", pa.int64()), ("model_uid", pa.string()), ("env_id", pa.string()),
        ("mu", pa.float64()), ("sigma", pa.float64()), ("conservative", pa.float64()),
    ]),
    "head_to_head": pa.schema([
        ("env_id", pa.string()), ("model_a", pa.string()), ("model_b", pa.string()),
        ("games", pa.int64()), ("wins_a", pa.int64()), ("draws", pa.int64()),
        ("win_rate_a", pa.float64()),  # (wins_a + draws / 2) / games
    ]),
    # Replay state. kind='slot': one (env_id, model_uid) with mu, sigma and W/D/L counters;
    # kind='pair': pairwise counts of model_uid (a) vs model_b with wins = wins_a, losses = wins_b.
    "ratings_state": pa.schema([
        ("kind", pa.string()), ("env_id", pa.string()), ("model_uid", pa.string()), ("model_b", pa.string()),
        ("mu", pa.float64()), ("sigma", pa.float64()), ("games", pa.int64()), ("wins", pa.int64()),
        ("draws", pa.int64()), ("losses", pa.int64()), ("mirror_games", pa.int64()),
    ]),
}

FAST, SOLO, MIRROR, MULTI = 0, 1, 2, 3  # duel kinds
_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@dataclass
class RatingsResult:
    run: str
    ratings: pa.Table
    rating_history: pa.Table
    head_to_head: pa.Table
    games_rated: int  # games replayed by this job (new rounds only when incremental)
    mirror_games: int
    rounds: list[int]
    incremental: bool
    paths: list[Path] = field(default_factory=list)
    seconds: float = 0.0


# ---------------------------------------------------------------- closed-form 2-team TrueSkill

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
                _enter(s, mu, sg, seen, parent, mu0, sigma0, k_inherit)
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


def _enter(s: int, mu: list, sg: list, seen: list, parent: list, mu0: float, sigma0: float, k: float) -> None:
    """First game of slot s in its track: inherit from the nearest ancestor seen in this track."""
    p = parent[s]
    while p >= 0 and not seen[p]:
        p = parent[p]
    if p >= 0:
        mu[s], sg[s] = mu[p], min(sg[p] * k, sigma0)
    else:
        mu[s], sg[s] = mu0, sigma0
    seen[s] = True


def make_env(cfg: RatingsConfig, backend: Optional[str] = None) -> trueskill.TrueSkill:
    return trueskill.TrueSkill(mu=cfg.mu, sigma=cfg.sigma, beta=cfg.beta, tau=cfg.tau,
                               draw_probability=cfg.draw_probability, backend=backend)


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


# ---------------------------------------------------------------- replay state

class _State:
    """mu/sigma/counters per slot = track * M + model, plus pairwise counts per track."""

    def __init__(self, envs: list[str], models: list[str], parent_of: dict[str, str]):
        self.envs, self.models = envs, models  # envs[0] == OVERALL; models sorted
        self.env_ix = {e: i for i, e in enumerate(envs)}
        self.model_ix = {m: i for i, m in enumerate(models)}
        M, n = len(models), len(envs) * len(models)
        self.mu, self.sg, self.seen = [0.0] * n, [0.0] * n, [False] * n
        self.counts = np.zeros((n, 5), dtype=np.int64)  # games, wins, draws, losses, mirror
        self.pairs: dict[tuple[int, int, int], np.ndarray] = {}  # (track, a, b), a < b -> [wins_a, draws, wins_b]
        pm = [self.model_ix.get(parent_of.get(m, ""), -1) for m in models]
        for m in range(M):  # a lineage loop would make _enter spin forever
            p, steps = pm[m], 0
            while p >= 0:
                p, steps = pm[p], steps + 1
                if steps > M:
                    raise JobError(f"checkpoints table: the lineage of {models[m]!r} loops back on itself")
        self.parent = [t * M + p if p >= 0 else -1 for t in range(len(envs)) for p in pm]

    def slot(self, env: str, model: str) -> int:
        return self.env_ix[env] * len(self.models) + self.model_ix[model]

    def add_pairs(self, track: int, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """Add pairwise results (out: +1 a won, 0 draw, -1 b won) to the counts of track."""
        swap = a > b
        lo, hi = np.where(swap, b, a), np.where(swap, a, b)
        res = np.where(swap, -out, out)  # now from lo's side
        key = lo.astype(np.int64) * len(self.models) + hi
        cell = key * 3 + (1 - res)  # 0 lo won, 1 draw, 2 hi won
        uniq, n = np.unique(cell, return_counts=True)
        for c, k in zip(uniq.tolist(), n.tolist()):
            pair = (track, c // 3 // len(self.models), c // 3 % len(self.models))
            self.pairs.setdefault(pair, np.zeros(3, dtype=np.int64))[c % 3] += k


def _fingerprint(cfg: RatingsConfig, models: list[str], parent_of: dict[str, str]) -> str:
    blob = json.dumps({"ts": [cfg.mu, cfg.sigma, cfg.beta, cfg.tau, cfg.draw_probability, cfg.inherit_sigma_factor,
                              cfg.include_eval], "lineage": [[m, parent_of.get(m)] for m in models]})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _state_path(lake_dir: Path, run: str) -> Path:
    return lake.table_dir(lake_dir, "ratings_state", run) / "state.parquet"


def _load_state(lake_dir: Path, run: str, cfg: RatingsConfig, parent_of: dict[str, str],
                committed: list[int]) -> Optional[tuple[pa.Table, list[int]]]:
    """The saved state, if it may be extended by the rounds committed since; else None."""
    path = _state_path(lake_dir, run)
    if not lake.is_whole_parquet(path):
        return None
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"unstable_dask"])
    done = meta["rounds"]
    models = sorted(set(table.column("model_uid").to_pylist()) | set(table.column("model_b").drop_null().to_pylist()))
    if meta["fingerprint"] != _fingerprint(cfg, models, parent_of) or not set(done) <= set(committed):
        return None
    if any(r <= max(done, default=-1) for r in set(committed) - set(done)):
        return None  # a round older than the state was committed late: canonical order changed
    return table, done
