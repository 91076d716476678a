"""The ratings' reference: the documented replay rules written as a direct loop over the
`trueskill` package, which the rate job must equal."""
from __future__ import annotations

from pathlib import Path

import trueskill

from unstable_dask.lake import Lake
from unstable_dask.rate import duels


def oracle(lake_dir: Path, cfg, include_eval: bool = True, run: str = "syn") -> tuple[dict, dict]:
    """The documented rules as a direct loop, every game through trueskill.TrueSkill.rate."""
    env = trueskill.TrueSkill(mu=cfg.mu, sigma=cfg.sigma, beta=cfg.beta, tau=cfg.tau,
                              draw_probability=cfg.draw_probability)
    con = Lake(lake_dir).connect()
    games = con.sql("SELECT round, env_id, split, seats FROM games WHERE run = ? ORDER BY round, game_id",
                    params=[run]).fetchall()
    parent = dict(con.sql("SELECT uid, parent_uid FROM checkpoints WHERE run = ?", params=[run]).fetchall())
    con.close()
    R: dict[tuple[str, str], trueskill.Rating] = {}
    history: dict[tuple[int, str, str], tuple[float, float]] = {}

    def enter(track: str, uid: str) -> None:
        if (track, uid) in R:
            return
        p = parent.get(uid)
        while p is not None and (track, p) not in R:
            p = parent.get(p)
        if p is None:
            R[(track, uid)] = env.create_rating()
        else:
            pr = R[(track, p)]
            R[(track, uid)] = env.create_rating(pr.mu, min(pr.sigma * cfg.inherit_sigma_factor, cfg.sigma))

    last_round = None
    for rnd, env_id, split, seats in games:
        if last_round is not None and rnd != last_round:
            history.update({(last_round, u, t): (r.mu, r.sigma) for (t, u), r in R.items()})
        last_round = rnd
        if split == "eval" and not include_eval:
            continue
        seats = sorted(seats, key=lambda s: s["pid"])
        teams = list(dict.fromkeys(s["model_uid"] for s in seats))
        team_reward = [sum(s["reward"] for s in seats if s["model_uid"] == t) /
                       sum(1 for s in seats if s["model_uid"] == t) for t in teams]
        for track in ("*", env_id):
            for t in teams:
                enter(track, t)
            if len(seats) == 1:
                groups = [(R[(track, teams[0])],), (env.create_rating(),)]
                rw = team_reward[0]
                ranks = [0, 0] if rw == 0 else [0, 1] if rw > 0 else [1, 0]
            elif len(teams) == 1:
                continue  # mirror self-play
            else:
                groups = [(R[(track, t)],) for t in teams]
                ranks = duels.dense_ranks(team_reward)
            new = env.rate(groups, ranks=ranks)
            for t, g in zip(teams, new):
                R[(track, t)] = g[0]
    if last_round is not None:
        history.update({(last_round, u, t): (r.mu, r.sigma) for (t, u), r in R.items()})
    return {k: (r.mu, r.sigma) for k, r in R.items()}, history
