"""The league's schedule and ratings on leagues whose games are played by formula (synthetic_lake:
known strengths, a seat edge), through the real pairing (play/league.py), rate job and lake.
The same league with real rounds of the builtin tiny model is tests/test_league_rounds.py."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional

import pytest

from unstable_dask.config import entrant_spec
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.play.league import deal_games, plan_pass, resolve_entrants, seatings
from unstable_dask.rate import bradley_terry
from unstable_dask.rate.league import PRIOR, rate_league

from helpers import synthetic_lake as sl

LEAGUE = "syn-league"


def syn_job(lake: Path, checkpoints: int = 3, league: Optional[dict] = None):
    """A league over run syn's checkpoints (written to the lake), base and random, on KuhnPoker."""
    for k in range(len(Lake(lake).table("checkpoints").rows("syn")) + 1, checkpoints + 1):
        sl.write_checkpoint(lake, "syn", k, f"ckpt-{k}", f"ckpt-{k - 1}" if k > 1 else None)
    sets = {"entrants": ["syn:*", "base", "random"], "games": [{"env_id": "KuhnPoker-v0-train"}], "budget_per_entrant": 400} | (league or {})
    return load_job(None, {"run.lake": str(lake), "run.name": "syn", "ratings.bootstrap": 200,
                           **{f"league.{k}": v for k, v in sets.items()}})


def spaced(job, gap: float) -> dict[str, float]:
    """True strengths: random < base < ckpt-1 < ckpt-2 < ..., `gap` logits apart."""
    uids = ["random", "base:builtin:tiny"] + [f"syn:ckpt-{k}" for k in range(1, 10)]
    return {u: gap * i for i, u in enumerate(uids)}


def league_games(lake: Path) -> list[dict]:
    return Lake(lake).sql("SELECT round, game_id, group_id, seed, seats FROM games WHERE run = ?", [LEAGUE]).to_pylist()


def test_seatings_give_each_side_every_seat_equally_often():
    assert seatings("a", "b", 2) == [("a", "b"), ("b", "a")]
    for n in range(2, 7):
        orders = seatings("a", "b", n)
        assert len(set(orders)) == len(orders) and all({"a", "b"} <= set(o) for o in orders)
        for pid in range(n):  # each seat held by each side in the same number of games
            held = Counter(o[pid] for o in orders)
            assert held["a"] == held["b"], (n, pid, orders)
        # each side holds as many seats as the other over the deal
        assert sum(o.count("a") for o in orders) == sum(o.count("b") for o in orders)
    assert len(seatings("a", "b", 3)) == 6  # 2 of 3 seats then 1 of 3, in every rotation


def test_a_deal_is_one_seed_for_every_pair_in_every_seat_order(tmp_path):
    job = syn_job(tmp_path / "lake", league={"games": [{"env_id": "KuhnPoker-v0-train"},
                                                       {"env_id": "Snake-v0-train", "num_players": 3}]})
    by_uid = {e.uid: e for e in resolve_entrants(job, Lake(job.run.lake))}
    kuhn, snake = job.league.games
    d = [deal_games(job, by_uid, "random", "syn:ckpt-1", kuhn, k) for k in (0, 1)]
    other = deal_games(job, by_uid, "base:builtin:tiny", "syn:ckpt-2", kuhn, 0)
    assert [g.seed for g in d[0]] == [g.seed for g in other] and d[0][0].seed != d[1][0].seed
    assert [[s.model_uid for s in g.seats] for g in d[0]] == [["random", "syn:ckpt-1"], ["syn:ckpt-1", "random"]]
    assert len({g.game_id for g in d[0] + d[1] + other}) == 6 and len({g.group_id for g in d[0]}) == 1
    three = deal_games(job, by_uid, "random", "syn:ckpt-1", snake, 0)
    assert len(three) == 6 and all(len(g.seats) == 3 and g.split == "league" for g in three)
    assert all(s.plays == "engine" and s.source and s.source.endswith("adapters/syn/ckpt-1")
               for g in three for s in g.seats if s.model_uid == "syn:ckpt-1")


@pytest.mark.slow
def test_adaptive_pairing_plays_unseparated_neighbours_until_every_adjacent_pair_is_separated(tmp_path):
    job = syn_job(tmp_path / "lake", league={"name": LEAGUE, "first_pass": ["random", "base"]})
    truth = spaced(job, 1.2)
    plans = sl.run_league(job, truth)
    assert plans[-1].reason == "separated" and plans[-1].played < 5 * job.league.budget_per_entrant
    first = plans[0]
    assert first.phase == "first"
    assert set(first.pairs) == {("base:builtin:tiny", "random")} | {
        tuple(sorted((u, x))) for u in ("syn:ckpt-1", "syn:ckpt-2", "syn:ckpt-3") for x in ("base:builtin:tiny", "random")}
    for p in plans[1:-1]:
        assert p.phase == "adaptive" and set(p.pairs) <= {tuple(sorted(q)) for q in p.unseparated} and p.pairs
    rows = Lake(job.run.lake).sql("SELECT * FROM league_ratings WHERE run = ? ORDER BY rank", [LEAGUE]).to_pylist()
    assert [r["entrant"] for r in rows] == ["syn:ckpt-3", "syn:ckpt-2", "syn:ckpt-1", "base:builtin:tiny", "random"]
    assert all(r["separated"] and r["p_above_next"] >= 0.95 for r in rows[:-1])
    anchor = [r for r in rows if r["anchor"]]
    assert [(a["entrant"], a["rating"], a["rating_low"], a["rating_high"]) for a in anchor] == \
        [("random", 1000.0, 1000.0, 1000.0)]
    ck = {r["entrant"]: r for r in rows}["syn:ckpt-2"]
    assert (ck["kind"], ck["source_run"], ck["checkpoint"], ck["iteration"], ck["base_model"]) == \
        ("checkpoint", "syn", "ckpt-2", 2, "builtin:tiny")
    assert all(r["rating_low"] <= r["rating"] <= r["rating_high"] for r in rows)


@pytest.mark.slow
def test_a_league_of_equals_stops_on_its_budget(tmp_path):
    job = syn_job(tmp_path / "lake", checkpoints=2, league={"name": LEAGUE, "budget_per_entrant": 15})
    plans = sl.run_league(job, {u: 0.0 for u in spaced(job, 0.0)})
    assert plans[-1].reason == "budget"
    played = len(league_games(tmp_path / "lake"))
    assert played == plans[-1].played <= 4 * 15  # 4 entrants
    assert played > 60 - 2  # spent up to less than a deal (2 games: both seat orders)
    assert plans[-1].unseparated  # some adjacent pair never separated


def test_the_schedule_is_a_function_of_the_lake_and_a_killed_pass_is_played_again(tmp_path):
    """A pass whose driver died before its commit leaves files the lake does not show: the next
    plan is the same games, and only the committed pass counts."""
    lake = tmp_path / "lake"
    job = syn_job(lake, checkpoints=2, league={"name": LEAGUE})
    rate_league(job)
    first = plan_pass(job, Lake(lake))
    assert plan_pass(job, Lake(lake)).games == first.games  # same lake, same plan
    games = [{**sl.game(0, 0, g.env_id, [sl.seat(s.pid, s.model_uid, 1.0 - 2 * s.pid) for s in g.seats], "league"),
              "game_id": g.game_id, "group_id": g.group_id, "seed": g.seed} for g in first.games]
    sl.write_round(lake, LEAGUE, 0, games, checkpoint=None, do_commit=False)  # killed before its commit
    rate_league(job)
    assert plan_pass(job, Lake(lake)).games == first.games
    sl.commit(lake, LEAGUE, 0, games, checkpoint=None)
    rate_league(job)
    after = plan_pass(job, Lake(lake))
    assert after.phase == "adaptive" and not {g.game_id for g in after.games} & {g.game_id for g in first.games}


@pytest.mark.slow
def test_an_extended_league_plays_only_what_the_lake_lacks(tmp_path):
    lake = tmp_path / "lake"
    small = syn_job(lake, checkpoints=3, league={"name": LEAGUE, "entrants": ["syn:ckpt-1", "syn:ckpt-3", "base", "random"]})
    truth = spaced(small, 1.2)
    sl.run_league(small, truth)
    before = {g["game_id"] for g in league_games(lake)}
    grown = syn_job(lake, checkpoints=3, league={"name": LEAGUE})  # syn:* adds ckpt-2
    plans = sl.run_league(grown, truth, seed=1)
    games = league_games(lake)
    assert len(games) == len({g["game_id"] for g in games})  # no game twice
    assert before < {g["game_id"] for g in games}
    assert plans[0].phase == "first" and all("syn:ckpt-2" in p for p in plans[0].pairs)  # only the newcomer's first games
    assert plans[-1].reason == "separated"


@pytest.mark.slow
def test_league_ratings_are_the_rate_jobs_trueskill_and_pairs_agree_both_ways(tmp_path):
    """TrueSkill of league games equals a replay with the trueskill package (test_ratings.oracle)."""
    from helpers.reference_ratings import oracle
    lake = tmp_path / "lake"
    job = syn_job(lake, checkpoints=2, league={"name": LEAGUE, "budget_per_entrant": 6})
    sl.run_league(job, spaced(job, 0.8))
    res = rate_league(job)
    want, _ = oracle(lake, job.ratings, run=LEAGUE)
    got = {r["entrant"]: (r["mu"], r["sigma"]) for r in res.ratings.to_pylist()}
    assert set(got) == {u for track, u in want if track == "*"}
    for uid, (mu, sigma) in got.items():
        assert mu == pytest.approx(want[("*", uid)][0], abs=1e-6) and sigma == pytest.approx(want[("*", uid)][1], abs=1e-6)
    pairs = {(r["entrant"], r["opponent"]): r for r in res.pairs.to_pylist()}
    for (a, b), r in pairs.items():
        o = pairs[(b, a)]
        assert (r["games"], r["wins"], r["draws"], r["losses"]) == (o["games"], o["losses"], o["draws"], o["wins"])
        assert r["p_above"] + o["p_above"] <= 1.0 + 1e-12
    assert sum(r["games"] for r in res.ratings.to_pylist()) == 2 * len(league_games(lake))
    again = rate_league(job)  # a pure function of the lake
    assert again.ratings.equals(res.ratings) and again.pairs.equals(res.pairs)
    job.ratings.include_eval = False  # league games are not eval games: still rated
    assert rate_league(job).ratings.equals(res.ratings)


@pytest.mark.parametrize("wins", range(1, 9))
def test_a_clean_sweep_separates_a_pair_when_the_exact_sign_test_would(wins):
    """With the league's prior (one virtual win each way) a pair that won all its n games is separated
    at 0.95 exactly when the one-sided sign test rejects at 0.05 (0.5^n < 0.05: n >= 5); without it
    one game would do."""
    s = bradley_terry.fit([("a", "b", wins, 0, 0)], bootstrap=200, seed=0, prior=PRIOR).samples
    assert ((s[:, 0] > s[:, 1]).mean() >= 0.95) == (0.5 ** wins < 0.05)


def test_entrant_specs():
    assert entrant_spec("syn:every-2") == ("checkpoints", "syn", "every-2")
    assert entrant_spec("base:builtin:smollm2-135m-instruct") == ("base", None, "builtin:smollm2-135m-instruct")
    assert entrant_spec("ckpt-3") == ("checkpoints", None, "ckpt-3") and entrant_spec("ckpt-3").single
    assert not entrant_spec("*").single


def test_every_k_selects_the_iterations_k_divides(tmp_path):
    job = syn_job(tmp_path / "lake", checkpoints=5, league={"entrants": ["syn:every-2", "syn:ckpt-5", "random"]})
    assert [e.uid for e in resolve_entrants(job, Lake(job.run.lake))] == ["syn:ckpt-2", "syn:ckpt-4", "syn:ckpt-5",
                                                                           "random"]  # in the specs' order
