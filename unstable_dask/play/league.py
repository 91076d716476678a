"""A league: entrants from anywhere (checkpoints of any run in the lake, base models, adapter
folders, endpoints, the random agent) ranked against each other by duplicate, seat-balanced games.

Entrants. `league.entrants` specs (config.entrant_spec) resolve here, against the lake, to entrants
with a uid that is the seats' model_uid in the league's games:

  random              the random agent
  minimax, minimax-first, kuhn-best
                      an expert agent (play/experts.py), or its epsilon form `<expert>@<eps>`
  base:<model>        a base model with no adapter (`base` is [model].base)
  <run>:ckpt-<k>      a checkpoint of a run, on that run's base model
  endpoint:<model>    an endpoint of [endpoints], by its served model id
  adapter:<folder>    a LoRA adapter directory, on [model].base

Duplicate games. A pairing (a, b) plays deals: deal k of a game is one env seed, derived from
(league seed, game, k) and the same for every pair, and each deal is played once per seat
rotation (`seatings`): (a, b) and (b, a) in a 2-player game, so seat advantage and deal luck cancel.
A deal's games share a group_id; ids are keyed by pairing, game and deal, never by pass:

  group_id  <league>-<a>-vs-<b>-<env_id>-p<players>-<template>-d<kkkk>     (a < b)
  game_id   <group_id>-s<rotation>

Pairing. `plan_pass` is a pure function of (lake, [league], seed): the deals already in the lake
(group ids) and the league's ratings (league_ratings, league_pairs: rate/league.py, written after
every pass) decide the next pass. First every entrant plays the first-pass entrants; then (adaptive)
the adjacent pairs of the ranking not yet separated at `confidence`, those where a game says most
first (close ratings and a wide interval of their difference: score p(1-p) var), each for its next
`deals_per_pair` deals; or (round-robin) every pair, every pass. A pass is empty, and the league
done, when every adjacent pair is separated or the budget would be overrun. So a killed league
plays the same pass again, and a league with new entrants plays only games the lake lacks.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from unstable_dask.config import EXPERT_UIDS, RANDOM_UID, Job, LeagueGame, entrant_spec
from unstable_dask.errors import JobError
from unstable_dask.lake import Lake
from unstable_dask.play.opponents import AdapterDir, Checkpoint, Endpoint, ExpertAgent, Opponent, RandomAgent, Seat
from unstable_dask.play.schedule import GameSpec, TaskSpec, derive_seed

SPLIT = "league"
Kind = Literal["agent", "base", "checkpoint", "endpoint", "adapter"]


@dataclass(frozen=True)
class Entrant:
    uid: str  # seats.model_uid in the league's games
    kind: Kind
    player: Opponent  # what plays its seats
    run: Optional[str] = None  # a checkpoint's run
    iteration: Optional[int] = None  # a checkpoint's learner iteration; 0 for a base model
    base_model: Optional[str] = None  # the base model its engine seats run on

    def seat(self, pid: int) -> Seat:
        return dataclasses.replace(self.player.seat(pid), model_uid=self.uid)


def describe(uid: str) -> tuple[Kind, Optional[str], Optional[str]]:
    """(kind, run, checkpoint uid or model) of a league uid: what the rate job records per entrant."""
    if uid == RANDOM_UID or uid.partition("@")[0] in EXPERT_UIDS:
        return "agent", None, None
    prefix, _, rest = uid.partition(":")
    if prefix in ("base", "endpoint", "adapter"):  # config.KIND_PREFIXES: never a run's name here
        return ("base" if prefix == "base" else prefix), None, rest  # type: ignore[return-value]
    return "checkpoint", prefix, rest


def league_games(job: Job) -> list[LeagueGame]:
    """The games every pairing plays: league.games, or the env ids of round.train_envs."""
    if job.league.games:
        return list(job.league.games)
    solo = [e.env_id for e in job.round.train_envs if e.num_players < 2]
    if solo:
        raise JobError(f"{job.source}: key 'league.games' is empty, so the league plays round.train_envs, and "
                       f"{solo[0]!r} is a 1-player game; name 2-or-more-player games in league.games")
    return [LeagueGame(env_id=e.env_id, num_players=e.num_players, template=e.template) for e in job.round.train_envs]


def _checkpoints(job: Job, lake: Lake, run: str, selector: str, key: str) -> list[Entrant]:
    rows = lake.table("checkpoints").rows(run, order_by="iteration")
    if selector.startswith("ckpt-"):
        rows = [r for r in rows if r["uid"] == selector]
    elif selector.startswith("every-"):
        rows = [r for r in rows if r["iteration"] % int(selector.removeprefix("every-")) == 0]
    if not rows:
        raise JobError(f"{job.source}: key '{key}' selects no checkpoint: run {run!r} has "
                       f"{'no ' + selector if selector.startswith('ckpt-') else 'none that match'} in lake {lake.uri}")
    out = []
    for r in rows:
        uid = f"{run}:{r['uid']}"
        base = r["base_model"] if r["base_model"] != job.model.base else None
        adapter = lake.location(r["adapter_path"]) if r["adapter_path"] else None
        out.append(Entrant(uid, "checkpoint", Checkpoint(uid, adapter, r["iteration"], base=base), run,
                           r["iteration"], r["base_model"]))
    return out


def _expand(job: Job, lake: Lake, text: str, key: str) -> list[Entrant]:
    spec = entrant_spec(text)
    if spec.kind == "random":
        return [Entrant(RANDOM_UID, "agent", RandomAgent())]
    if spec.kind == "expert":
        return [Entrant(text, "agent", ExpertAgent(text))]
    if spec.kind == "base":
        model = spec.value or job.model.base
        uid = f"base:{model}"
        return [Entrant(uid, "base", Checkpoint(uid, None, 0, base=None if model == job.model.base else model),
                        iteration=0, base_model=model)]
    if spec.kind == "checkpoints":
        return _checkpoints(job, lake, spec.run or job.run.name, spec.value or "*", key)
    if text in job.endpoints:
        model = job.endpoints[text].model
        return [Entrant(f"endpoint:{model}", "endpoint", Endpoint(text, model))]
    return [Entrant(f"adapter:{Path(text).name}", "adapter", AdapterDir(text), base_model=job.model.base)]


def resolve_entrants(job: Job, lake: Lake) -> list[Entrant]:
    """The league's entrants, in the order the specs name them (a run's checkpoints by iteration)."""
    out: dict[str, Entrant] = {}
    for i, text in enumerate(job.league.entrants):
        for e in _expand(job, lake, text, f"league.entrants[{i}]"):
            if out.setdefault(e.uid, e) != e:
                raise JobError(f"{job.source}: key 'league.entrants[{i}]': two entrants would both be {e.uid!r} "
                               f"in the lake; rename one adapter folder")
    if len(out) < 2:
        raise JobError(f"{job.source}: key 'league.entrants' names {len(out)} entrant(s) in lake {lake.uri}: a "
                       f"league needs two or more")
    return list(out.values())


def single(job: Job, lake: Lake, text: str, key: str) -> str:
    """The uid of a spec that names one entrant (league.anchor, league.first_pass)."""
    return _expand(job, lake, text, key)[0].uid


# ---------------------------------------------------------------- duplicate games

def seatings(a: str, b: str, n: int) -> list[tuple[str, ...]]:
    """The seat orders a deal of an n-player game is played in: every rotation of a, b, a, b, ...
    and of the same with a and b swapped (distinct ones): each side takes each seat equally often."""
    pattern = [a if i % 2 == 0 else b for i in range(n)]
    out: list[tuple[str, ...]] = []
    for p in (pattern, [b if x == a else a for x in pattern]):
        for r in range(n):
            s = tuple(p[r:] + p[:r])
            if s not in out:
                out.append(s)
    return out


def game_key(job: Job, game: LeagueGame) -> str:
    return f"{game.env_id}-p{game.num_players}-{game.template or job.model.template}"


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


def group_id(league: str, a: str, b: str, key: str, deal: int) -> str:
    a, b = _pair(a, b)
    return f"{league}-{a}-vs-{b}-{key}-d{deal:04d}"


def deal_games(job: Job, entrants: dict[str, Entrant], a: str, b: str, game: LeagueGame, deal: int) -> list[GameSpec]:
    """One deal of a pairing in one game: the same env seed in every seat rotation."""
    a, b = _pair(a, b)
    key = game_key(job, game)
    gid = group_id(job.league_name, a, b, key, deal)
    seed = derive_seed(job.league.seed, zlib.crc32(key.encode()), deal)
    return [GameSpec(game_id=f"{gid}-s{r}", split=SPLIT, env_id=game.env_id, seed=seed, group_id=gid,
                     template=game.template or job.model.template,
                     seats=tuple(entrants[uid].seat(pid) for pid, uid in enumerate(order)))
            for r, order in enumerate(seatings(a, b, game.num_players))]


# ---------------------------------------------------------------- pairing

@dataclass
class Pass:
    """What a league plays next, and why it stops when that is nothing."""
    league: str
    entrants: list[Entrant]
    phase: str  # first | adaptive | round-robin: how `pairs` were chosen
    pairs: list[tuple[str, str]]  # pairings in this pass, most informative first
    games: list[GameSpec]
    played: int  # games of the league in the lake before this pass
    reason: str = ""  # when `games` is empty: "separated" or "budget"
    unseparated: list[tuple[str, str]] = field(default_factory=list)  # adjacent pairs of the ranking not yet separated

    def tasks(self, per_task: int, round_: int) -> list[TaskSpec]:
        return [TaskSpec(f"task-{t:04d}", self.league, round_, tuple(self.games[t * per_task:(t + 1) * per_task]))
                for t in range(math.ceil(len(self.games) / per_task))]


_RATINGS_SQL = "SELECT entrant, rating, passes FROM league_ratings WHERE run = ? ORDER BY rating DESC, entrant"
_PAIRS_SQL = "SELECT entrant, opponent, p_above, gap_sd FROM league_pairs WHERE run = ?"


def _ranking(job: Job, lake: Lake, uids: list[str]) -> tuple[list[str], dict[str, float], dict[tuple[str, str], tuple]]:
    """The entrants' ranking, ratings and pairwise (p_above, gap_sd) from the rate job's tables."""
    league, passes = job.league_name, len(lake.rounds(job.league_name))
    rows = lake.sql(_RATINGS_SQL, [league]).to_pylist()
    if any(r["passes"] != passes for r in rows) or (passes and not rows):
        raise JobError(f"league {league!r}: its ratings do not cover its {passes} committed passes in lake "
                       f"{lake.uri}; rate it first (the league command does)")
    rating = {r["entrant"]: r["rating"] for r in rows}
    pairs = {(r["entrant"], r["opponent"]): (r["p_above"], r["gap_sd"]) for r in lake.sql(_PAIRS_SQL, [league]).to_pylist()}
    return [r["entrant"] for r in rows if r["entrant"] in set(uids)], rating, pairs


def _information(rating: dict[str, float], pairs: dict, a: str, b: str) -> float:
    """How much a game between a and b says: p(1-p) of the expected score times the variance of
    their rating difference (close ratings, wide interval)."""
    p = 1.0 / (1.0 + 10.0 ** ((rating[b] - rating[a]) / 400.0))
    sd = pairs.get((a, b), (None, None))[1]
    return p * (1.0 - p) * (sd if sd is not None and sd == sd else 1e6) ** 2


def plan_pass(job: Job, lake: Lake) -> Pass:
    """The next pass of the league `job.league_name` (see the module doc)."""
    cfg, league = job.league, job.league_name
    entrants = resolve_entrants(job, lake)
    by_uid = {e.uid: e for e in entrants}
    uids = [e.uid for e in entrants]
    games = league_games(job)
    played_groups = set(lake.sql("SELECT DISTINCT group_id FROM games WHERE run = ?", [league]).column(0).to_pylist())
    played = lake.sql("SELECT count(*) AS n FROM games WHERE run = ?", [league]).column(0)[0].as_py()
    out = Pass(league, entrants, "first", [], [], played)

    def deals(a: str, b: str, first_only: bool) -> list[list[GameSpec]]:
        """The pair's next deals_per_pair deals per game not in the lake (first pass: deals 0.. only)."""
        todo = []
        for g in games:
            key = game_key(job, g)
            ks = range(cfg.deals_per_pair) if first_only else itertools.count()
            fresh = (k for k in ks if group_id(league, a, b, key, k) not in played_groups)
            todo += [deal_games(job, by_uid, a, b, g, k) for k in itertools.islice(fresh, cfg.deals_per_pair)]
        return todo

    if cfg.pairing == "adaptive":
        anchors = [single(job, lake, t, "league.first_pass") for t in cfg.first_pass or [cfg.anchor]]
        first = list(dict.fromkeys(_pair(u, x) for u in uids for x in anchors if u != x))
        out.pairs = [(a, b) for a, b in first if deals(a, b, first_only=True)]
    if not out.pairs:
        order, rating, pairs = _ranking(job, lake, uids) if played else ([], {}, {})
        out.phase = cfg.pairing
        out.unseparated = [(a, b) for a, b in zip(order, order[1:])
                           if (pairs.get((a, b), (0.0,))[0] or 0.0) < cfg.confidence]
        if played and not out.unseparated and set(order) == set(uids):
            out.reason = "separated"
            return out
        if cfg.pairing == "round-robin":
            out.pairs = [_pair(a, b) for a, b in itertools.combinations(uids, 2)]
        else:
            ranked = sorted(out.unseparated, key=lambda p: (-_information(rating, pairs, *p), p))
            out.pairs = [_pair(a, b) for a, b in ranked[:cfg.pairs_per_pass]]
    left = cfg.budget_per_entrant * len(entrants) - played
    for deal in (d for a, b in out.pairs for d in deals(a, b, out.phase == "first")):
        if len(deal) > left:  # whole deals only: a deal's seat rotations cancel each other's luck
            break
        out.games += deal
        left -= len(deal)
    if not out.games:
        out.reason = "budget"
    return out
