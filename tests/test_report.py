"""The HTML report: renders from a synthetic lake, opens in real headless Chromium, runs no model text."""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from unstable_dask.jobfile import default_job
from unstable_dask.rate import ratings
from unstable_dask.report import report

import synthetic_lake as sl

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run"]


def chromium_or_skip() -> str:
    """The Debian chromium binary; skips locally without it, fails in CI (CI=true)."""
    if os.path.exists(CHROMIUM):
        try:
            import playwright.sync_api  # noqa: F401
            return CHROMIUM
        except ImportError:
            msg = "the playwright package is missing (pip install playwright)"
    else:
        msg = "Debian chromium is missing (apt-get install -y --no-install-recommends chromium)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"report browser test needs a browser: {msg}")
    pytest.skip(msg)


@contextmanager
def opened(path: Path) -> Iterator[tuple[Any, list[str]]]:
    """The page at `path` in headless Chromium, and the console errors and warnings, uncaught page
    errors and dialogs (an injected alert) it produced."""
    exe = chromium_or_skip()
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=ARGS)
        try:
            pg = browser.new_page()
            errors: list[str] = []
            pg.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.on("dialog", lambda d: (errors.append("dialog: " + d.message), d.dismiss()))
            pg.goto(path.resolve().as_uri())
            pg.wait_for_load_state("load")
            yield pg, errors
        finally:
            browser.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("report")
    sl.make_run(d / "lake", "syn", rounds=3, games_per_round=30, seed=5)
    job = default_job()
    job.run.lake, job.run.name, job.run.reports = str(d / "lake"), "syn", str(d / "reports")
    ratings.rate(job)
    page = report.report(job)
    # A second run with no ratings yet: the index lists both and its page says what is missing.
    job2 = job.model_copy(deep=True)
    job2.run.name = "empty"
    report.report(job2)
    return page


def test_page_is_escaped_without_a_browser(site: Path) -> None:
    html = site.read_text(encoding="utf-8")
    assert html.count("<script") == 1  # only our own sorting script
    for bad in sl.HOSTILE:
        assert bad not in html  # every hostile string is escaped
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=&#34;window.__pwned = 2&#34;&gt;" in html
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")  # no CDN, nothing remote
    assert "https://" not in html
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
        assert page.locator("svg polyline").count() >= 3  # rating history, checkpoints, learner, rounds
        assert page.locator("svg rect").count() >= 10  # heat-map cells and legends
        assert page.locator("svg.ci circle").count() >= 4  # BT CI bars
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


def _wilson(p: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


_NUMBER = re.compile(r"-?\d[\d.e+-]*")


def _assert_tips(shown: list[str], expected: list[str]) -> None:
    """Same words, same numbers up to the 6 digits shown (at a rate of 0 or 1 an interval's end is
    0 or 1 up to rounding: 1.4e-17 from Python's pow, 0 from DuckDB's sqrt)."""
    assert [_NUMBER.sub("#", t) for t in shown] == [_NUMBER.sub("#", t) for t in expected]
    for a, b in zip(shown, expected):
        assert [float(x) for x in _NUMBER.findall(a)] == pytest.approx([float(x) for x in _NUMBER.findall(b)], rel=1e-5, abs=1e-9), (a, b)


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
    tips = {}
    for r in (0, 1):
        mine = [s for s in seats if s["round"] == r]
        rate = sum(1.0 if s["reward"] > s["other"] else 0.5 if s["reward"] == s["other"] else 0.0 for s in mine) / len(mine)
        lo, hi = _wilson(rate, len(mine))
        tips[("vs random", r)] = f"{rate:.6g} (95% CI {lo:.6g} .. {hi:.6g})"
        # `loop` prints the same figures after each round
        assert f"eval vs random (24 games): win rate {rate:.2f} [{lo:.2f}, {hi:.2f}], invalid moves" in \
            "\n".join(round_summary(job, r))
        ev = [t["invalid_move"] for t in turns if t["round"] == r and t["split"] == "eval"]
        inv = sum(ev) / len(ev)
        lo, hi = _wilson(inv, len(ev))
        tips[("eval", r)] = f"{inv:.6g} (95% CI {lo:.6g} .. {hi:.6g})"

    # Where the hardware waited: lock-step, so the update ran between the two rounds, not inside one.
    from unstable_dask.report.timeline import timeline
    con = Lake(job.run.lake).connect()
    busy = timeline(con, job.run.name)
    steps = con.sql("SELECT sum(step_time_s) FROM learner_steps").fetchall()[0][0]
    con.close()
    assert [t["round"] for t in busy] == [0, 1]
    assert all(0 < f <= 1 for t in busy for f in t["workers"].values())
    assert busy[0]["learner_in_round_s"] == 0 and busy[0]["learner_in_gap_s"] == pytest.approx(steps, rel=1e-6)
    html = page.read_text()
    section = html[html.index('id="timeline"'):]
    assert section[:section.index("</section>")].count("<tr><td>") == 2
    # ... and the newest round's engine line: hf has no prefix cache, so no hit rate
    frac = Lake(job.run.lake).sql("SELECT in_flight_frac FROM rounds WHERE round = 1").to_pylist()[0]["in_flight_frac"]
    assert f'<p id="engine">Round 1 played on hf; games in flight {frac:.2f} of round.concurrency.</p>' in section

    with opened(page) as (pg, errors):
        captions = pg.locator("#curves figcaption").all_inner_texts()
        assert len(captions) == 5, captions  # win rate, invalid moves, format, length, TrueSkill
        win = pg.locator("#curves figure", has_text="Eval win rate")
        assert win.locator("polyline").count() == 1 and win.locator("polygon").count() == 1  # the line and its CI band
        shown = win.locator("circle title").all_text_contents()
        _assert_tips(shown, [f"vs random: {tips[('vs random', r)]} at {r}" for r in (0, 1)])
        invalid = pg.locator("#curves figure", has_text="Invalid-move rate").locator("circle title").all_text_contents()
        _assert_tips([t for t in invalid if t.startswith("eval")], [f"eval: {tips[('eval', r)]} at {r}" for r in (0, 1)])
        # The table has a row per round, split and opponent of the checkpoint that played it.
        rows = pg.locator("#curves-table tbody tr").all_inner_texts()
        assert any(r.startswith("1\tckpt-1\teval\trandom") for r in rows), rows
        mu = pg.locator("#curves figure", has_text="TrueSkill").locator("circle title").all_text_contents()
        assert len(mu) == 4  # mu and conservative, two rounds
        # The learner charts are curves, not counters.
        learner = pg.locator("#learner figcaption").all_inner_texts()
        assert learner and not [c for c in learner if c.split()[0] in ("update", "batch_seed")]
        assert errors == []
