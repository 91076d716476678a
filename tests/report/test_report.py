"""The HTML report: renders from a synthetic lake, opens in real headless Chromium, runs no model text,
loads nothing, and its charts (Vega-Lite, drawn by Vega) carry the lake's numbers."""
from __future__ import annotations

import html as html_lib
import json
import math
import re
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from unstable_dask.jobfile import default_job
from unstable_dask.lake import Lake
from unstable_dask.rate import ratings
from unstable_dask.report import arena, charts, report

from helpers import synthetic_lake as sl
from helpers.browser import marks, num, opened


def specs(page_html: str) -> dict[str, dict]:
    """The Vega-Lite spec of each chart with an id, read back from the page's HTML."""
    return {k: json.loads(html_lib.unescape(v)) for k, v in
            re.findall(r'<figure class="chart" id="([^"]+)">\s*<div class="vl" data-spec=\'([^\']*)\'', page_html)}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("report")
    sl.make_run(d / "lake", "syn", rounds=3, games_per_round=30, seed=5)
    job = default_job()
    job.run.lake, job.run.name, job.run.reports = str(d / "lake"), "syn", str(d / "reports")
    ratings.rate(job)
    page = report.report(job)
    # A second run to compare with, and a third with no ratings yet: the index lists them all and
    # the empty run's page says what is missing.
    sl.make_run(d / "lake", "syn2", rounds=2, games_per_round=12, seed=9, hostile=False)
    for name in ("syn2", "empty"):
        other = job.model_copy(deep=True)
        other.run.name = name
        if name == "syn2":
            ratings.rate(other)
        report.report(other)
    return page


def test_page_is_escaped_without_a_browser(site: Path) -> None:
    html = site.read_text(encoding="utf-8")
    assert html.count("<script") == 1  # one script: the Vega bundle and our own (charts, sorting)
    for bad in sl.HOSTILE:
        assert bad not in html  # every hostile string is escaped
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=&#34;window.__pwned = 2&#34;&gt;" in html
    rest = html.replace(charts.bundle(), "")  # the bundle's code names the SVG namespace and the Vega editor
    assert "http://" not in rest and "https://" not in rest  # no CDN, nothing remote
    # In the charts, model text is data only: never a field name, a sort order or an expression.
    found = specs(html)
    assert {"bt-all", "h2h-map", "learner-chart"} <= set(found)

    def strings(v: Any, path: str = "") -> Iterator[tuple[str, str]]:
        if isinstance(v, dict):
            for k, x in v.items():
                yield path, k
                yield from strings(x, f"{path}/{k}")
        elif isinstance(v, list):
            for x in v:
                yield from strings(x, path)
        elif isinstance(v, str):
            yield path, v
    hostile = [(path, v) for spec in found.values() for path, v in strings(spec) if sl.HOSTILE[1] in v]
    assert hostile and all(path.startswith("/datasets/") for path, _ in hostile), hostile
    index = (site.parent.parent / "index.html").read_text(encoding="utf-8")
    assert 'href="syn/index.html"' in index and 'href="empty/index.html"' in index
    assert "No ratings yet" in (site.parent.parent / "empty" / "index.html").read_text(encoding="utf-8")


def test_report_in_headless_chromium(site: Path) -> None:
    with opened(site) as (page, errors):
        # Open every <details> so any hostile markup inside would be parsed and shown.
        page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
        page.wait_for_timeout(200)
        assert errors == []
        assert page.evaluate("typeof window.__pwned") == "undefined"
        rows = page.locator("#lb-all tbody tr")
        assert rows.count() >= 4
        models = page.locator("#lb-all td.model").all_inner_texts()
        assert "ckpt-2" in models and sl.HOSTILE[1] in models  # hostile model name shown as text
        assert page.locator("div.vl svg [aria-roledescription='line mark']").count() >= 3  # rating history, checkpoints, rounds
        # The head-to-head map: a cell per ordered pair that met, with the lake's win rate and games
        # (the hostile model name is a label like any other).
        lake = Lake(site.parent.parent.parent / "lake")
        want = {(r["model_a"], r["model_b"]): r for r in lake.sql(
            "SELECT model_a, model_b, win_rate_a, games FROM head_to_head WHERE run = 'syn' AND env_id = '*'").to_pylist()}
        cells = marks(page.locator("#h2h-map"), "rect mark")
        assert len(cells) == len(want) >= 10
        for c in cells:
            w = want[(c["model"], c["against"])]
            assert num(c["win rate (draws half)"]) == pytest.approx(w["win_rate_a"], abs=5e-4) and int(c["games"]) == w["games"]
        assert sl.HOSTILE[1] in {c["model"] for c in cells}
        # BT interval bars: every rated model's score and 95% CI as the rate job wrote them
        bt = {r["model_uid"]: r for r in lake.sql(
            "SELECT model_uid, bt_score, bt_ci_low, bt_ci_high FROM ratings WHERE run = 'syn' AND env_id = '*'").to_pylist()}
        bars = marks(page.locator("#bt-all"), "point")
        assert len(bars) == len(bt) >= 4
        for b in bars:
            r = bt[b["model"]]
            assert [num(b[k]) for k in ("BT score", "95% CI low", "95% CI high")] == \
                pytest.approx([r["bt_score"], r["bt_ci_low"], r["bt_ci_high"]], rel=1e-5)
        assert page.locator("img").count() == 0 and page.locator("pre script").count() == 0
        completions = " ".join(page.locator("pre.completion").all_inner_texts())
        assert "<script>window.__pwned = 1</script>" in completions and "onerror=" in completions
        # Sorting works (our script runs): sort by model name ascending, then descending.
        header = page.locator("#lb-all thead th", has_text="model")
        header.click()
        first = page.locator("#lb-all td.model").first.inner_text()
        header.click()
        assert page.locator("#lb-all td.model").first.inner_text() != first
        assert errors == [] and page.evaluate("typeof window.__pwned") == "undefined"
        index = page.context.browser.new_page()
        index.goto((site.parent.parent / "index.html").resolve().as_uri())
        assert index.locator("a[href='syn/index.html']").count() == 1


def test_index_compares_runs(site: Path) -> None:
    """The runs index overlays the runs' eval curves: a line per run and fixed opponent, each point
    the win rate (draws half) and its Wilson interval counted here from the lake's seats."""
    lake = Lake(site.parent.parent.parent / "lake")
    seats = lake.sql("""SELECT s.run, s.round, s.reward, o.reward AS other FROM seats s JOIN seats o
        ON o.run = s.run AND o.game_id = s.game_id AND o.pid <> s.pid
        WHERE s.split = 'eval' AND s.is_learner AND o.model_uid = 'random' AND s.num_players = 2""").to_pylist()
    expected = {}
    for run, round_ in {(x["run"], x["round"]) for x in seats}:
        mine = [x for x in seats if (x["run"], x["round"]) == (run, round_)]
        rate = sum(1.0 if x["reward"] > x["other"] else 0.5 if x["reward"] == x["other"] else 0.0 for x in mine) / len(mine)
        expected[(f"{run} vs random", round_)] = (rate, *_wilson(rate, len(mine)))
    assert {run for run, _ in expected} == {"syn vs random", "syn2 vs random"}
    with opened(site.parent.parent / "index.html") as (pg, errors):
        runs = pg.locator("#runs tbody tr").all_inner_texts()
        assert [r.split("\t")[:2] for r in runs] == [["empty", "0"], ["syn", "3"], ["syn2", "2"]]
        points = marks(pg.locator("#compare-eval"), "point")
        _assert_points([p for p in points if p["series"].endswith(" vs random")], "eval win rate", expected)
        assert errors == []


def _wilson(p: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def _assert_points(shown: list[dict[str, str]], ylabel: str, expected: dict[tuple[str, int], tuple[float, float, float]]) -> None:
    """The points drawn are the expected (series, round) -> (value, CI low, CI high), up to the 6
    digits shown (at a rate of 0 or 1 an interval's end is 0 or 1 up to rounding: 1.4e-17 from
    Python's pow, 0 from DuckDB's sqrt)."""
    got = {(p["series"], int(num(p["round"]))): tuple(num(p[k]) for k in (ylabel, "95% CI low", "95% CI high")) for p in shown}
    assert len(got) == len(shown) and set(got) == set(expected), (got, expected)
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-9), k


@pytest.mark.slow
def test_learning_curves_show_the_lakes_numbers(tmp_path: Path, local_client) -> None:
    """Real tiny-model rounds (WinningNumber vs the random agent: wins, draws and losses all occur),
    a learner update between them; the curves in Chromium carry the numbers the lake holds."""
    from unstable_dask.jobfile import load_job
    from unstable_dask.lake import Lake
    from unstable_dask.learn.learner import learn
    from unstable_dask.loop import round_summary
    from unstable_dask.play.round import play_round
    env = {"env_id": "WinningNumber-v0-train", "num_players": 2, "num_actors": 1, "opponents": ["random"]}
    job = load_job("jobs/demo.toml", {
        "run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"), "model.max_new_tokens": 8,
        "round.train_games": 8, "round.eval_games": 24, "round.games_per_task": 16, "round.concurrency": 16,
        "round.train_envs": [env], "round.eval_envs": [env], "round.opponents": {"strategy": "fixed", "fixed": ["random"]},
        "learn.batch_size": 8, "learn.mini_batch_size": 8, "learn.gradient_checkpointing": False})
    play_round(job, client=local_client)
    learn(job)
    play_round(job, client=local_client)
    ratings.rate(job)
    page = report.report(job)
    # The expected numbers, straight from the lake's seats and turns (not the report's query).
    seats = Lake(job.run.lake).sql("""SELECT s.round, s.game_id, s.reward, max(o.reward) AS other FROM seats s JOIN seats o
        ON o.game_id = s.game_id AND o.pid <> s.pid WHERE s.split = 'eval' AND s.is_learner GROUP BY ALL""").to_pylist()
    turns = Lake(job.run.lake).sql("SELECT round, split, invalid_move FROM turns WHERE is_learner").to_pylist()
    tips, any_draw = {}, any(s["reward"] == s["other"] for s in seats)
    for r in (0, 1):
        mine = [s for s in seats if s["round"] == r]
        rate = sum(1.0 if s["reward"] > s["other"] else 0.5 if s["reward"] == s["other"] else 0.0 for s in mine) / len(mine)
        lo, hi = _wilson(rate, len(mine))
        tips[("vs random", r)] = (rate, lo, hi)
        draws = sum(s["reward"] == s["other"] for s in mine) / len(mine)
        # `loop` prints the same figures after each round
        assert f"eval vs random (24 games): win rate {rate:.2f} [{lo:.2f}, {hi:.2f}], draws {draws:.2f}, invalid moves" in \
            "\n".join(round_summary(job, r))
        ev = [t["invalid_move"] for t in turns if t["round"] == r and t["split"] == "eval"]
        inv = sum(ev) / len(ev)
        lo, hi = _wilson(inv, len(ev))
        tips[("eval", r)] = (inv, lo, hi)

    # Where the hardware waited: lock-step, so the update ran between the two rounds, not inside one.
    from unstable_dask.report.timeline import timeline
    con = Lake(job.run.lake).connect()
    busy = timeline(con, job.run.name)
    steps, n_steps = con.sql("SELECT sum(step_time_s), count(*) FROM learner_steps").fetchall()[0]
    con.close()
    assert [t["round"] for t in busy] == [0, 1]
    assert all(0 < f <= 1 for t in busy for f in t["workers"].values())
    # The learner's interval is (created_at - step_time_s, created_at) in epoch seconds: each end is
    # rounded to a float64 ulp of ~1.8e9 s (2.4e-7 s), so its length is exact to two of them, not
    # to a relative 1e-6 of a 0.05 s step (a CI run differed by 6.2e-8).
    assert busy[0]["learner_in_round_s"] == 0
    assert busy[0]["learner_in_gap_s"] == pytest.approx(steps, rel=0, abs=2 * n_steps * math.ulp(time.time()))
    html = page.read_text()
    section = html[html.index('id="timeline"'):]
    assert section[:section.index("</section>")].count("<tr><td>") == 2
    # ... and the newest round's engine line: hf has no prefix cache, so no hit rate
    frac = Lake(job.run.lake).sql("SELECT in_flight_frac FROM rounds WHERE round = 1").to_pylist()[0]["in_flight_frac"]
    assert f'<p id="engine">Round 1 played on hf; games in flight {frac:.2f} of round.concurrency.</p>' in section

    with opened(page) as (pg, errors):
        captions = pg.locator("#curves figcaption").all_inner_texts()
        # win rate, invalid moves, format, length, TrueSkill; the draw rate where an eval game was drawn
        assert len(captions) == 5 + any_draw, captions
        assert any("draw rate" in c for c in captions) == any_draw, captions
        win = pg.locator("#curves figure", has_text="Eval win rate")
        assert len(marks(win, "line mark")) == 1 and len(marks(win, "area mark")) == 1  # the line and its CI band
        _assert_points(marks(win, "point"), "win rate", {("vs random", r): tips[("vs random", r)] for r in (0, 1)})
        invalid = marks(pg.locator("#curves figure", has_text="Invalid-move rate"), "point")
        _assert_points([p for p in invalid if p["series"] == "eval"], "invalid-move rate",
                       {("eval", r): tips[("eval", r)] for r in (0, 1)})
        # The table has a row per round, split and opponent of the checkpoint that played it.
        rows = pg.locator("#curves-table tbody tr").all_inner_texts()
        assert any(r.startswith("1\tckpt-1\teval\trandom") for r in rows), rows
        mu = marks(pg.locator("#curves figure", has_text="TrueSkill"), "point")
        assert len(mu) == 4  # mu and conservative, two rounds
        # The learner charts are curves, not counters: one small chart per column, titled by it.
        learner = [t.removeprefix("Title text ").strip("'") for t in pg.locator(
            "#learner-chart [aria-roledescription='title']").evaluate_all("els => els.map(e => e.getAttribute('aria-label'))")]
        assert "loss" in learner and not [c for c in learner if c in ("update", "batch_seed", "iteration")]
        assert errors == []


@pytest.mark.slow
def test_a_long_run_shows_the_best_and_newest(tmp_path: Path) -> None:
    """More checkpoints and rounds than a page shows: the leaderboard, its interval bars, the
    head-to-head map and the matrices hold the TOP_K best models and the NEWEST newest checkpoints,
    the per-round tables the newest TABLE_ROUNDS rounds while the charts hold every round, the
    transcripts SAMPLE_MODELS models, and notes say what is left out and how to query it."""
    n = report.TABLE_ROUNDS + 4
    sl.make_run(tmp_path / "lake", "long", rounds=n, games_per_round=6, seed=3)
    job = default_job()
    job.run.lake, job.run.name, job.run.reports = str(tmp_path / "lake"), "long", str(tmp_path / "reports")
    ratings.rate(job)
    html = report.report(job).read_text(encoding="utf-8")
    board = Lake(tmp_path / "lake").sql("SELECT model_uid FROM ratings WHERE run = 'long' AND env_id = '*' "
                                        "ORDER BY conservative DESC, model_uid").column(0).to_pylist()
    newest = {f"ckpt-{k}" for k in range(n - arena.NEWEST, n)}
    shown = [m for m in board if m in set(board[:arena.TOP_K]) | newest]
    assert len(shown) == arena.TOP_K + arena.NEWEST - len(newest & set(board[:arena.TOP_K])) < len(board)

    def cells(table_id: str, cls: str = "model") -> list[str]:
        table = re.search(f'<table[^>]* id="{table_id}"[^>]*>(.*?)</table>', html, re.S)
        assert table, table_id
        return [html_lib.unescape(c) for c in re.findall(f'<td class="{cls}">(.*?)</td>', table.group(1))]

    assert cells("lb-all") == shown
    assert f"{len(board) - len(shown)} more models not shown" in html
    charts_ = specs(html)
    assert [r["model"] for r in charts_["bt-all"]["datasets"]["rows"]] == shown
    h2h = charts_["h2h-map"]["datasets"]["rows"]
    assert h2h and {r["a"] for r in h2h} | {r["b"] for r in h2h} <= set(shown)
    assert set(cells("wf-all")) <= set(shown) and len(cells("wf-all")) > 1
    # per-round tables: the newest rounds; the learning curves: every round
    table = html[html.index('id="curves-table"'):]
    rounds = {int(r) for r in re.findall(r'<tr><td data-v="(\d+)">', table[:table.index("</table>")])}
    assert sorted(rounds) == list(range(n - report.TABLE_ROUNDS, n)) and "The table holds the newest" in html
    assert {r["x"] for r in charts_["curve-1"]["datasets"]["rows"]} == set(range(n))  # eval win rate
    timeline = html[html.index('id="timeline"'):]
    assert timeline[:timeline.index("</section>")].count("<tr><td>") == report.TABLE_ROUNDS
    transcripts = html[html.index('id="transcripts"'):]
    assert transcripts.count("<summary>ckpt-") == report.SAMPLE_MODELS
