"""Headless Chromium for the report tests: a page opened once its charts are drawn, with every
console error, page error, dialog and outside request it produced."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

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
    """The page at `path` in headless Chromium once its charts are drawn, and the console errors and
    warnings, uncaught page errors, dialogs (an injected alert) and requests for anything but the
    page itself (a CDN, an image) it produced."""
    exe = chromium_or_skip()
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=ARGS)
        try:
            pg = browser.new_page()
            errors: list[str] = []
            url = path.resolve().as_uri()
            pg.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.on("dialog", lambda d: (errors.append("dialog: " + d.message), d.dismiss()))
            pg.on("request", lambda r: errors.append("request: " + r.url) if r.url != url else None)
            pg.goto(url)
            pg.wait_for_selector("body[data-charts=drawn]", state="attached", timeout=60_000)
            yield pg, errors
        finally:
            browser.close()


def marks(where: Any, role: str) -> list[dict[str, str]]:
    """The chart marks of one role ('point', 'rect mark', 'line mark', ...) under the locator
    `where`, each as the fields of its aria-label, which Vega writes from the mark's encodings and
    tooltip ('round: 1; win rate: 0.5; series: vs random; ...')."""
    labels = where.locator(f"[aria-roledescription='{role}']").evaluate_all(
        "els => els.map(e => e.getAttribute('aria-label'))")
    return [dict(kv.split(": ", 1) for kv in label.split("; ")) for label in labels]


def num(text: str) -> float:
    """A number as Vega prints it (a U+2212 minus sign)."""
    return float(text.replace("\u2212", "-").replace(",", ""))
