"""The ratings side of a league: its games rated as any run's are (rate.ratings: a TrueSkill replay,
Bradley-Terry, head_to_head, under the league's run name), then put on one scale.

Bradley-Terry on the league's pairwise counts, with one virtual win for each side of every pair
that met (bradley_terry.fit's `prior`), and `ratings.bootstrap` resamples seeded by league.seed.
Every resample is anchored like the fit: the anchor entrant at league.anchor_rating, so a rating
reads the same in any league with that anchor, and an interval is the uncertainty relative to it.
Written (replace tables, a pure function of the lake and the job's [league] and [ratings]):

  league_ratings  per entrant: what it is (run, checkpoint, iteration, base model), its anchored
                  rating and interval, TrueSkill mu/sigma, W/D/L, rank, and whether the bootstrap
                  separates it from the next entrant of the ranking at league.confidence
  league_pairs    per ordered pair of rated entrants: W/D/L and score when they met, the share of
                  resamples rating the entrant above the opponent, the sd of their difference

The league's pairing (play/league.py) reads both to choose the next pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa

from unstable_dask.config import Job
from unstable_dask.lake import Lake, catalog
from unstable_dask.play.league import describe, single
from unstable_dask.rate import bradley_terry, ratings

PRIOR = 1  # virtual wins for each side of a pair that met: a 4-0 is not certainty (rule of succession)


@dataclass
class LeagueRatings:
    league: str
    ratings: pa.Table  # league_ratings, strongest first
    pairs: pa.Table  # league_pairs
    replay: ratings.RatingsResult  # the rate job's run over the league's games

    def __str__(self) -> str:
        return f"{self.replay} (league {self.league})"


def league_job(job: Job) -> Job:
    """The job as the rate job sees the league: its run is the league's."""
    return job.model_copy(update={"run": job.run.model_copy(update={"name": job.league_name})})


def rate_league(job: Job) -> LeagueRatings:
    """Rate the league `job.league_name` and write league_ratings and league_pairs."""
    cfg, league, lake = job.league, job.league_name, Lake(job.run.lake)
    replay = ratings.rate(league_job(job), empty_ok=True)  # before its first pass a league has no games
    head = [r for r in replay.head_to_head.to_pylist() if r["env_id"] == ratings.OVERALL]
    cells = [(r["model_a"], r["model_b"], r["wins_a"], r["draws"], r["games"] - r["wins_a"] - r["draws"])
             for r in head if r["model_a"] < r["model_b"]]
    fit = bradley_terry.fit(cells, bootstrap=job.ratings.bootstrap, seed=cfg.seed, prior=PRIOR)
    models, n = fit.models, len(fit.models)
    anchor = single(job, lake, cfg.anchor, "league.anchor") if n else ""
    # Anchored: the fit and every resample shifted so that the anchor sits at anchor_rating (until the
    # anchor has played, BT's own scale: mean 1000).
    ref, ref_samples, to = ((fit.score[models.index(anchor)], fit.samples[:, [models.index(anchor)]], cfg.anchor_rating)
                            if anchor in models else (0.0, 0.0, 0.0))
    point, samples = fit.score - ref + to, fit.samples - ref_samples + to
    boot = len(samples) > 0
    tail = 100 * (1 - cfg.confidence) / 2
    low, high = (np.percentile(samples, [tail, 100 - tail], axis=0) if boot else (np.full(n, np.nan),) * 2)
    above = (samples[:, :, None] > samples[:, None, :]).mean(axis=0) if boot else np.full((n, n), np.nan)
    gap_sd = (samples[:, :, None] - samples[:, None, :]).std(axis=0) if boot else np.full((n, n), np.nan)

    skill = {r["model_uid"]: r for r in replay.ratings.to_pylist() if r["env_id"] == ratings.OVERALL}
    ckpts = {(r["run"], r["uid"]): r for r in lake.sql("SELECT run, uid, iteration, base_model FROM checkpoints").to_pylist()}
    order = sorted(range(n), key=lambda i: (-point[i], models[i]))
    rows = []
    for rank, i in enumerate(order, 1):
        m = models[i]
        kind, run, rest = describe(m)
        ck = ckpts.get((run, rest), {}) if kind == "checkpoint" else {}
        nxt = order[rank] if rank < n else None
        p_next = None if nxt is None or not boot else float(above[i, nxt])
        rows.append(dict(
            entrant=m, kind=kind, source_run=run, checkpoint=rest if kind == "checkpoint" else None,
            iteration=0 if kind == "base" else ck.get("iteration"),
            base_model=rest if kind == "base" else ck.get("base_model"),
            rating=float(point[i]), rating_low=_num(low[i]), rating_high=_num(high[i]), anchor=m == anchor,
            mu=skill[m]["mu"], sigma=skill[m]["sigma"], games=skill[m]["games"], wins=skill[m]["wins"],
            draws=skill[m]["draws"], losses=skill[m]["losses"], rank=rank, p_above_next=p_next,
            separated=None if p_next is None else p_next >= cfg.confidence, passes=len(replay.rounds)))
    met = {(r["model_a"], r["model_b"]): r for r in head}
    pairs = []
    for i, a in enumerate(models):
        for j, b in enumerate(models):
            if i == j:
                continue
            h = met.get((a, b))
            games = h["games"] if h else 0
            wins, draws = (h["wins_a"], h["draws"]) if h else (0, 0)
            pairs.append(dict(entrant=a, opponent=b, games=games, wins=wins, draws=draws, losses=games - wins - draws,
                              score=(wins + draws / 2) / games if games else None,
                              p_above=_num(above[i, j]), gap_sd=_num(gap_sd[i, j])))
    table = pa.Table.from_pylist(rows, schema=catalog.SCHEMAS["league_ratings"])
    pair_table = pa.Table.from_pylist(pairs, schema=catalog.SCHEMAS["league_pairs"])
    lake.write("league_ratings", league, None, "league_ratings", table)
    lake.write("league_pairs", league, None, "league_pairs", pair_table)
    return LeagueRatings(league, table, pair_table, replay)


def _num(v: float) -> Optional[float]:
    return None if v != v else float(v)

