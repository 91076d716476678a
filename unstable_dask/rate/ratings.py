"""The rate job: replay every committed game of a run and write TrueSkill + Bradley-Terry tables.

Replay rules (the ratings are a pure function of the lake):

* Order: committed rounds of `job.run.name`, each in (round, game_id) order; seats by pid.
  Eval games are replayed too unless `[ratings] include_eval = false` (a league's games always are).
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
* Speed: 2-team games go through the closed-form update of `duels.py`, N-player games
  through `trueskill.TrueSkill.rate`; both agree with the package to rounding.
* Incremental: the replay state (every mu/sigma and counter) is saved in the lake table
  `ratings_state`; a later rate job replays only rounds newer than the saved ones, which equals a
  full replay. A rating-parameter change, a lineage change of a rated model, a newly committed
  round older than the saved state, or a state or history whose checksum (kept in the state's
  metadata) does not match what the last rate wrote forces a full replay.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pyarrow as pa
import trueskill

from unstable_dask.config import Job, RatingsConfig
from unstable_dask.errors import JobError
from unstable_dask.lake import Lake, catalog
from unstable_dask.rate import bradley_terry, replay_state
from unstable_dask.rate.duels import FAST, MIRROR, MULTI, SOLO, dense_ranks, enter_track, package_rate, replay_duels
from unstable_dask.skill import make_env

OVERALL = "*"

# The tables this job writes: their schemas live in the catalog with every other table's.
SCHEMAS: dict[str, pa.Schema] = {t: catalog.SCHEMAS[t] for t in ("ratings", "rating_history", "head_to_head", "ratings_state")}


@dataclass
class RatingsResult:
    run_name: str
    ratings: pa.Table
    rating_history: pa.Table
    head_to_head: pa.Table
    games_rated: int  # games replayed by this job (new rounds only when incremental)
    mirror_games: int
    skipped_games: int  # missing reward or model_uid
    rounds: list[int]
    incremental: bool
    paths: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def __str__(self) -> str:
        return (f"rate: {self.games_rated} games rated ({self.mirror_games} mirror self-play, not rated; "
                f"{self.skipped_games} skipped) over {len(self.rounds)} rounds"
                f"{' (incremental)' if self.incremental else ''} in {self.seconds:.1f} s")


# ---------------------------------------------------------------- reading and replaying games

_GAMES_SQL = """SELECT round, game_id, env_id,
       list_transform(list_sort(seats), lambda s: s.model_uid) AS uids,
       list_transform(list_sort(seats), lambda s: s.reward) AS rewards
FROM games WHERE run = ? AND round > ? {split} ORDER BY round, game_id"""


def read_games(con: duckdb.DuckDBPyConnection, run_name: str, include_eval: bool, after: int) -> pa.Table:
    """The run's games after round `after` in replay order (round, game_id), seats by pid:
    round, game_id, env_id, uids, rewards."""
    sql = _GAMES_SQL.format(split="" if include_eval else "AND split IN ('train', 'league')")
    return con.sql(sql, params=[run_name, after]).to_arrow_table()


def _lineage(con, run_name: str) -> dict[str, str]:
    return dict(con.sql("SELECT uid, parent_uid FROM checkpoints WHERE run = ? AND parent_uid IS NOT NULL "
                        "ORDER BY uid", params=[run_name]).fetchall())


def _flat(col: pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    lengths = pa.compute.fill_null(pa.compute.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), pa.compute.list_flatten(arr)


def prepare_duels(st: replay_state.State, games: pa.Table) -> tuple[dict, np.ndarray, int]:
    """Two duels per valid game (overall track, env track), counters and pair counts updated.

    Returns the duel lists, each valid game's round, and the number of skipped games.
    """
    M = len(st.models)
    off, uids = _flat(games.column("uids"))
    _, rewards = _flat(games.column("rewards"))
    ix = np.array([st.model_ix.get(u, -1) if u is not None else -1 for u in uids.dictionary_encode().dictionary.to_pylist()]
                  + [-1], dtype=np.int64)
    enc = uids.dictionary_encode().indices
    codes = ix[pa.compute.fill_null(enc, len(ix) - 1).to_numpy(zero_copy_only=False)]
    rew = pa.compute.fill_null(rewards.cast(pa.float64()), float("nan")).to_numpy(zero_copy_only=False)
    n = np.diff(off)
    bad_seats = np.concatenate([[0], np.cumsum((codes < 0) | np.isnan(rew))])
    valid = (n > 0) & (bad_seats[off[1:]] == bad_seats[off[:-1]])  # skip games with a missing uid/reward
    keep = np.flatnonzero(valid)
    off0, n = off[keep], n[keep]
    env = np.array([st.env_ix[e] for e in games.column("env_id").to_pylist()], dtype=np.int64)[keep]
    rounds = games.column("round").to_numpy()[keep]
    G = len(keep)
    tr = np.stack([np.zeros(G, np.int64), env], axis=1)  # (G, 2): track per duel
    m0 = codes[off0]
    m1 = np.where(n >= 2, codes[np.minimum(off0 + 1, len(codes) - 1)], -1)
    r0, r1 = rew[off0], np.where(n >= 2, rew[np.minimum(off0 + 1, len(rew) - 1)], 0.0)
    kind = np.where(n == 1, SOLO, np.where(n > 2, MULTI, np.where(m0 == m1, MIRROR, FAST)))
    out = np.sign(r0 - r1).astype(np.int64)
    da = tr * M + m0[:, None]
    db = np.where((kind == FAST)[:, None], tr * M + m1[:, None], -1)
    payload: dict[int, tuple[list[int], list[int]]] = {}
    for g in np.flatnonzero(kind == MULTI).tolist():
        seat_m, seat_r = codes[off0[g]:off0[g] + n[g]].tolist(), rew[off0[g]:off0[g] + n[g]].tolist()
        teams = list(dict.fromkeys(seat_m))  # distinct models in seat order
        if len(teams) == 1:
            kind[g] = MIRROR
            continue
        team_r = [float(np.mean([r for m, r in zip(seat_m, seat_r) if m == t])) for t in teams]
        ranks = dense_ranks(team_r)
        for k in (0, 1):
            slots = [int(tr[g, k]) * M + t for t in teams]
            payload[2 * g + k] = (slots, ranks)
            for s, rk in zip(slots, ranks):
                best_shared = ranks.count(0) > 1
                st.counts[s, 0] += 1
                st.counts[s, 1 if rk == 0 and not best_shared else 2 if rk == 0 else 3] += 1
        for i in range(len(teams)):
            for j in range(i + 1, len(teams)):
                res = int(np.sign(ranks[j] - ranks[i]))
                st.add_pairs(tr[g], np.full(2, teams[i]), np.full(2, teams[j]), np.full(2, res))
    kinds2 = np.repeat(kind, 2)
    # Order-independent counters, vectorised.
    rated = np.isin(kind, (FAST, SOLO))
    for k in (0, 1):
        col = 1 + np.select([out > 0, out == 0], [0, 1], 2)  # wins, draws, losses columns of da
        np.add.at(st.counts, (da[rated, k], 0), 1)
        np.add.at(st.counts, (da[rated, k], col[rated]), 1)
        fast = kind == FAST
        np.add.at(st.counts, (db[fast, k], 0), 1)
        np.add.at(st.counts, (db[fast, k], 4 - col[fast]), 1)
        np.add.at(st.counts, (da[kind == MIRROR, k], 4), 1)
    fast = kind == FAST
    st.add_pairs(tr[fast].ravel(), np.repeat(m0[fast], 2), np.repeat(m1[fast], 2), np.repeat(out[fast], 2))
    duels = {"da": da.ravel().tolist(), "db": db.ravel().tolist(), "dout": np.repeat(out, 2).tolist(),
             "dkind": kinds2.tolist(), "payload": payload}
    return duels, rounds, int(len(valid) - len(keep))


def _slow(st: replay_state.State, cfg: RatingsConfig, duels: dict, k: int) -> None:
    """Rate duel k with the package: an N-player game, or a 2-team game the closed form refused."""
    if duels["dkind"][k] == MULTI:
        slots, ranks = duels["payload"][k]
    else:
        slots, o = [duels["da"][k], duels["db"][k]], duels["dout"][k]
        ranks = [0, 0] if o == 0 else [0, 1] if o > 0 else [1, 0]
    for s in slots:
        if s >= 0 and not st.seen[s]:
            enter_track(s, st.mu, st.sg, st.seen, st.parent, cfg.mu, cfg.sigma, cfg.inherit_sigma_factor)
    new = package_rate(cfg, [(st.mu[s], st.sg[s]) if s >= 0 else (cfg.mu, cfg.sigma) for s in slots], ranks)
    for s, (m, sd) in zip(slots, new):
        if s >= 0:
            st.mu[s], st.sg[s] = m, sd


def replay(st: replay_state.State, cfg: RatingsConfig, duels: dict, rounds: np.ndarray, todo: list[int]) -> list[pa.Table]:
    """Replay the duels round by round; return a rating_history snapshot after each round."""
    margin = trueskill.calc_draw_margin(cfg.draw_probability, 2, env=make_env(cfg))
    snaps, M = [], len(st.models)
    args = (duels["da"], duels["db"], duels["dout"], duels["dkind"], st.mu, st.sg, st.seen, st.parent, cfg, margin)
    for r in todo:
        k, end = 2 * int(np.searchsorted(rounds, r, "left")), 2 * int(np.searchsorted(rounds, r, "right"))
        while k < end:
            k = replay_duels(k, end, *args)
            if k < end:
                _slow(st, cfg, duels, k)
                k += 1
        seen = np.flatnonzero(np.array(st.seen, dtype=bool))
        mu, sg = np.array(st.mu)[seen], np.array(st.sg)[seen]
        snaps.append(pa.table({
            "round": pa.array(np.full(len(seen), r), pa.int64()),
            "model_uid": [st.models[s % M] for s in seen.tolist()],
            "env_id": [st.envs[s // M] for s in seen.tolist()],
            "mu": mu, "sigma": sg, "conservative": mu - 3 * sg}, schema=SCHEMAS["rating_history"]))
    return snaps


# ---------------------------------------------------------------- output tables

def _outputs(state: pa.Table, cfg: RatingsConfig, seed: int) -> tuple[pa.Table, pa.Table]:
    """ratings and head_to_head from the replay state (BT per track from the pairwise counts)."""
    slots = [r for r in state.to_pylist() if r["kind"] == "slot"]
    pairs = [r for r in state.to_pylist() if r["kind"] == "pair"]
    bt: dict[tuple[str, str], tuple] = {}
    for env in sorted({r["env_id"] for r in pairs}):
        cells = [(r["model_uid"], r["model_b"], r["wins"], r["draws"], r["losses"]) for r in pairs if r["env_id"] == env]
        res = bradley_terry.fit(cells, bootstrap=cfg.bootstrap, seed=seed)
        for i, m in enumerate(res.models):
            bt[(env, m)] = (float(res.score[i]), float(res.ci_low[i]), float(res.ci_high[i]), int(res.rank[i]))
    rows = []
    for r in slots:
        score, lo, hi, rank = (None if v is None or v != v else v  # nan -> null
                               for v in bt.get((r["env_id"], r["model_uid"]), (None,) * 4))
        rows.append({**{k: r[k] for k in ("model_uid", "env_id", "mu", "sigma", "games", "wins", "draws", "losses",
                                          "mirror_games")},
                     "conservative": r["mu"] - 3 * r["sigma"], "bt_score": score, "bt_ci_low": lo, "bt_ci_high": hi,
                     "rank": rank})
    ratings = pa.Table.from_pylist(rows, schema=SCHEMAS["ratings"]).sort_by(
        [("env_id", "ascending"), ("conservative", "descending"), ("model_uid", "ascending")])
    h2h = []
    for r in pairs:
        for a, b, wa in ((r["model_uid"], r["model_b"], r["wins"]), (r["model_b"], r["model_uid"], r["losses"])):
            h2h.append({"env_id": r["env_id"], "model_a": a, "model_b": b, "games": r["games"], "wins_a": wa,
                        "draws": r["draws"], "win_rate_a": (wa + 0.5 * r["draws"]) / r["games"]})
    head = pa.Table.from_pylist(h2h, schema=SCHEMAS["head_to_head"]).sort_by(
        [("env_id", "ascending"), ("model_a", "ascending"), ("model_b", "ascending")])
    return ratings, head


# ---------------------------------------------------------------- the job

def rate(job: Job, full: bool = False, empty_ok: bool = False) -> RatingsResult:
    """Replay the committed games of job.run.name and write ratings, rating_history, head_to_head.

    `full=True` ignores the saved replay state (the result is the same, only slower). A run with no
    committed round is an error (a typo in run.name), unless `empty_ok` (a league before its first
    pass): then the tables are written empty.
    """
    t0 = time.perf_counter()
    cfg, run_name, lake = job.ratings, job.run.name, Lake(job.run.lake)
    committed = lake.rounds(run_name)  # one snapshot for the rounds and every game read below
    if not committed and not empty_ok:  # a typo in run.name, not a run to write empty ratings for
        runs = ", ".join(repr(r) for r in sorted(set(lake.snapshot.log("rounds").runs))) or "none"
        raise JobError(f"{job.source}: run {run_name!r} has no committed round in lake {lake.uri!r} (runs there: "
                       f"{runs}); nothing to rate")
    con = lake.connect()
    try:
        parent_of = _lineage(con, run_name)
        saved = None if full else replay_state.load(lake, run_name, cfg, parent_of, committed)
        done = saved[1] if saved else []
        games = read_games(con, run_name, cfg.include_eval, max(done, default=-1))
    finally:
        con.close()
    old = saved[0] if saved else pa.Table.from_pylist([], schema=SCHEMAS["ratings_state"])
    envs = [OVERALL] + sorted((set(old.column("env_id").to_pylist()) | set(games.column("env_id").to_pylist())) - {OVERALL})
    models = sorted(set(old.column("model_uid").to_pylist()) | set(old.column("model_b").drop_null().to_pylist())
                    | set(pa.compute.list_flatten(games.column("uids")).drop_null().to_pylist())
                    | set(parent_of) | set(parent_of.values()))
    st = replay_state.State(envs, models, parent_of)
    replay_state.restore(st, old)
    duels, rounds, skipped = prepare_duels(st, games)
    todo = [r for r in committed if r not in set(done)]
    snaps = replay(st, cfg, duels, rounds, todo)

    if saved:
        snaps.insert(0, saved[2])
    history = (pa.concat_tables(snaps) if snaps else SCHEMAS["rating_history"].empty_table()).sort_by(
        [("round", "ascending"), ("env_id", "ascending"), ("model_uid", "ascending")])
    state = replay_state.table_of(st)
    ratings, head = _outputs(state, cfg, job.run.seed)
    paths = [lake.write(name, run_name, None, name, table)
             for name, table in (("ratings", ratings), ("rating_history", history), ("head_to_head", head))]
    paths.append(replay_state.save(lake, run_name, state, history, cfg, parent_of, committed))  # last: the commit point
    kinds = np.array(duels["dkind"][::2], dtype=np.int64)
    return RatingsResult(run_name=run_name, ratings=ratings, rating_history=history, head_to_head=head,
                         games_rated=int(np.isin(kinds, (FAST, SOLO, MULTI)).sum()),
                         mirror_games=int((kinds == MIRROR).sum()), skipped_games=skipped, rounds=committed, incremental=bool(done),
                         paths=paths, seconds=time.perf_counter() - t0)
