"""The rating model every stage agrees on: the TrueSkill environment of a job's [ratings], and the
prior a model enters a track with. The rate job applies them to every game (rate/), the scheduler
to a checkpoint that has not played yet (play/opponents.py, match-quality opponents)."""
from __future__ import annotations

from typing import Callable, Optional, TypeVar

import trueskill

from unstable_dask.config import RatingsConfig
from unstable_dask.errors import JobError

T = TypeVar("T")


def make_env(cfg: RatingsConfig, backend: Optional[str] = None) -> trueskill.TrueSkill:
    return trueskill.TrueSkill(mu=cfg.mu, sigma=cfg.sigma, beta=cfg.beta, tau=cfg.tau,
                               draw_probability=cfg.draw_probability, backend=backend)


def inherited(model: T, parent_of: Callable[[T], Optional[T]], rated: Callable[[T], Optional[tuple[float, float]]],
              mu0: float, sigma0: float, k: float) -> tuple[float, float]:
    """The rating a model enters a track with: its nearest rated ancestor's mu, with that
    ancestor's sigma * k capped at sigma0; (mu0, sigma0) when no ancestor is rated."""
    p, seen = parent_of(model), {model}
    while p is not None:
        if p in seen:
            raise JobError(f"checkpoints table: the lineage of {model!r} loops back on itself")
        r = rated(p)
        if r is not None:
            return r[0], min(r[1] * k, sigma0)
        seen.add(p)
        p = parent_of(p)
    return mu0, sigma0
