"""The HTML report: renders from a synthetic lake, opens in real headless Chromium, runs no model text."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import synthetic_lake as sl
from unstable_dask import ratings, report
from unstable_dask.config import default_job

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
    exe = chromium_or_skip()
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("dialog", lambda d: (errors.append("dialog: " + d.message), d.dismiss()))
            page.goto(site.resolve().as_uri())
            page.wait_for_load_state("load")
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
            index = browser.new_page()
            index.goto((site.parent.parent / "index.html").resolve().as_uri())
            assert index.locator("a[href='syn/index.html']").count() == 1
        finally:
            browser.close()
