"""The league's pages in headless Chromium, on a league played through the real pairing, rate job
and lake (games by formula, synthetic_lake.run_league, with hostile transcripts): every number
shown is checked against the league's tables or against a count made here from the games' seats."""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.rate import ratings
from unstable_dask.report import league as league_page
from unstable_dask.report import report

from helpers import synthetic_lake as sl
from helpers.browser import marks, num, opened

LEAGUE = "lg"


def _with_turns(lake_dir, league, round_, specs, strength, rng, seat_edge=0.3) -> None:
    """synthetic_lake.play_league_pass, with turns (hostile text) so the games have transcripts."""
    games, turns = [], []
    for g in specs:
        a, b = (s.model_uid for s in g.seats)
        ra, rb = sl.outcome(rng, strength[a] + seat_edge, strength[b])
        row = {**sl.game(round_, 0, g.env_id, [sl.seat(0, a, ra), sl.seat(1, b, rb)], g.split),
               "game_id": g.game_id, "group_id": g.group_id, "seed": g.seed}
        games.append(row)
        turns += sl.turn_rows(row, rng, hostile=True)
    sl.write_round(lake_dir, league, round_, games, turns, checkpoint=None)


@pytest.mark.slow
def test_league_pages_show_the_lakes_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lake = tmp_path / "lake"
    sl.make_run(lake, "syn", rounds=4, games_per_round=6, seed=1)  # checkpoints from iteration 0, rounds played
    for k in (1, 2):  # a second run with checkpoints only, from iteration 1: its line starts at the base model
        sl.write_checkpoint(lake, "syn2", k, f"ckpt-{k}", f"ckpt-{k - 1}" if k > 1 else None)
    job = load_job(None, {"run.lake": str(lake), "run.name": "syn", "run.reports": str(tmp_path / "reports"),
                          "ratings.bootstrap": 100, "league.name": LEAGUE, "league.entrants": ["syn:*", "syn2:*", "base", "random"],
                          "league.games": [{"env_id": "KuhnPoker-v0-train"}], "league.budget_per_entrant": 30})
    truth = {"random": -1.0, "base:builtin:tiny": 0.0} | {f"syn:ckpt-{k}": 0.5 * k for k in range(4)} | \
        {f"syn2:ckpt-{k}": 0.3 * k for k in (1, 2)}
    monkeypatch.setattr(sl, "play_league_pass", _with_turns)
    sl.run_league(job, truth, seed=4)
    ratings.rate(job)
    report.report(job)
    page = tmp_path / "reports" / LEAGUE / "index.html"

    db = Lake(lake)
    board = db.sql("SELECT * FROM league_ratings WHERE run = ? ORDER BY rank", [LEAGUE]).to_pylist()
    games = db.sql("SELECT game_id, group_id, seed, seats FROM games WHERE run = ? AND split = 'league'", [LEAGUE]).to_pylist()
    assert len(board) == 8 and len(games) > 20
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # (a, b) -> a's wins, draws, losses
    deals: dict[tuple[str, str], dict[int, list[tuple[str, ...]]]] = defaultdict(lambda: defaultdict(list))
    for g in games:
        (a, ra), (b, rb) = ((s["model_uid"], s["reward"]) for s in g["seats"])
        k = 0 if ra > rb else 1 if ra == rb else 2
        counts[(a, b)][k] += 1
        counts[(b, a)][2 - k] += 1
        deals[tuple(sorted((a, b)))][g["seed"]].append((a, b))

    with opened(page) as (pg, errors):
        shown = [t.split("\t")[1].removesuffix(" (anchor)") for t in pg.locator("#league-board tbody tr").all_inner_texts()]
        assert shown == [r["entrant"] for r in board]
        # interval bars: every entrant's anchored rating and interval (random, the anchor, at 1000)
        bars = {b["model"]: b for b in marks(pg.locator("#league-bars"), "point")}
        assert set(bars) == set(shown)
        for r in board:
            b = bars[r["entrant"]]
            assert [num(b[k]) for k in ("rating (random = 1000)", "interval low", "interval high")] == \
                pytest.approx([r["rating"], r["rating_low"], r["rating_high"]], rel=1e-5)
        # the matrix: the row's score against the column, as counted here from the seats
        cells = marks(pg.locator("#league-matrix"), "rect mark")
        assert {(c["model"], c["against"]) for c in cells} == set(counts)
        for c in cells:
            w, d, lost = counts[(c["model"], c["against"])]
            assert num(c["score (draws half)"]) == pytest.approx((w + d / 2) / (w + d + lost), abs=5e-4)
            assert int(c["games"]) == w + d + lost
        # strength vs iteration: a line per run; syn2's starts at the base model (iteration 0)
        rating = {r["entrant"]: r["rating"] for r in board}
        want = {("syn", k): rating[f"syn:ckpt-{k}"] for k in range(4)} | {("syn2", 0): rating["base:builtin:tiny"]} | \
            {("syn2", k): rating[f"syn2:ckpt-{k}"] for k in (1, 2)}
        got = {(p["series"], int(num(p["training iteration"]))): num(p["league rating"])
               for p in marks(pg.locator("#league-strength"), "point")}
        assert got == pytest.approx(want, rel=1e-5)
        # every pair that met links to its games
        links = pg.locator("#league-pairs a.pair")
        assert links.count() == len(counts) // 2
        first = pg.locator("#league-pairs tbody tr").first.all_inner_texts()[0].split("\t")[:2]
        assert errors == [] and pg.evaluate("typeof window.__pwned") == "undefined"
        href = links.first.get_attribute("href")
        links.first.click()
        pg.wait_for_load_state("load")
        assert pg.locator("h1").inner_text() == f"{first[0]} vs {first[1]}"
        assert errors == [f"request: {(page.parent / href).resolve().as_uri()}"]  # the link followed, nothing else
        assert pg.evaluate("typeof window.__pwned") == "undefined"

    # each pair's page: its games, every deal in both seat orders on one seed, text escaped, no script
    html = page.read_text(encoding="utf-8")
    hrefs = re.findall(r'<a class="pair" href="([^"]+)">', html)
    assert len(set(hrefs)) == len(counts) // 2
    for pair, by_seed in deals.items():
        text = (page.parent / league_page.pair_file(*pair)).read_text(encoding="utf-8")
        assert text.count('<div class="game"') == sum(len(v) for v in by_seed.values())
        assert all(sorted(orders) == sorted({orders[0], orders[0][::-1]}) for orders in by_seed.values())
        for seed in by_seed:
            assert text.count(f"seed {seed}</h4>") == 2
        assert "<script" not in text and not any(bad in text for bad in sl.HOSTILE)
    # the runs index: syn's best checkpoint in the league, and the league listed
    index = (tmp_path / "reports" / "index.html").read_text(encoding="utf-8")
    best = max(r["rating"] for r in board if r["source_run"] == "syn")
    cell = re.search(r'<td class="league-best" data-v="([^"]+)">(.*?)</td>', index, re.S)
    assert cell and float(cell.group(1)) == pytest.approx(best) and f"{round(best)}</b>" in cell.group(2)
    assert f'<a class="league" href="{LEAGUE}/index.html">' in index
