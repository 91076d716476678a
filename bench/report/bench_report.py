"""Report size and render time as a run grows, against the report before this one, and the chart
options measured on the same page (Vega-Lite with its bundle vs static SVG from matplotlib).

    .venv/bin/python bench/report/bench_report.py [--rounds 20 50 200] [--baseline c041073] [--lakes DIR]

Per size: a synthetic run (tests/synthetic_lake.make_run: a checkpoint per round that plays its
predecessors, eval games vs random, single-player and 3-player games, 30 games a round, 8 of them
with turns), rated; then its page rendered by this tree and by the baseline revision (its
`git archive`, imported in a subprocess), each in a fresh process, twice (the first render builds
the Vega bundle in this tree): page bytes (per section for this tree), render seconds, and with
Chromium the seconds from opening the page until its charts are drawn (load for the baseline).
Then the options, on this tree's page: the charts' Vega-Lite specs (bytes in the page, plus the
bundle, inlined once) against matplotlib drawing the same rows as static SVG (bytes, seconds;
skipped without matplotlib). Synthetic text is short: a real run's transcripts add more bytes.
`--lakes DIR` keeps the lakes (DIR/r<N>) and reuses them on the next call (same seed, same lake).
Results: bench/results/report.json; the last lines printed are BENCHMARKS.md rows.
"""
from __future__ import annotations

import argparse
import html as html_lib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/report/", "unstable_dask/lake/"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save  # noqa: E402

RUN = "syn"
RENDER = """
import json, sys, time
from unstable_dask.jobfile import default_job
from unstable_dask.report import report
job = default_job()
job.run.lake, job.run.name, job.run.reports = sys.argv[1], sys.argv[2], sys.argv[3]
times = []
for _ in range(2):
    t = time.perf_counter()
    page = report.report(job)
    times.append(time.perf_counter() - t)
print(json.dumps({"first_s": times[0], "second_s": times[1], "bytes": page.stat().st_size, "page": str(page)}))
"""


def lake_for(rounds: int, where: Path) -> Path:
    """A rated synthetic run of `rounds` rounds under `where` (reused when complete)."""
    lake, done = where / f"r{rounds}" / "lake", where / f"r{rounds}" / "rated"
    if done.exists():
        return lake
    from unstable_dask.jobfile import default_job
    from unstable_dask.rate import ratings

    from helpers import synthetic_lake as sl
    shutil.rmtree(lake.parent, ignore_errors=True)
    t0 = time.perf_counter()
    sl.make_run(lake, RUN, rounds=rounds, games_per_round=30, seed=5)
    job = default_job()
    job.run.lake, job.run.name = str(lake), RUN
    ratings.rate(job)
    done.write_text(f"{time.perf_counter() - t0:.1f} s to write and rate\n")
    return lake


def render(code: Path, lake: Path, out: Path) -> dict:
    """Render the run page twice in a fresh process importing the package from `code`."""
    env = {**os.environ, "PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", RENDER, str(lake), RUN, str(out)], env=env, cwd=code,
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def browser_seconds(page: Path, drawn: bool) -> float | None:
    """Seconds from opening the page until its charts are drawn (or its load event), in Chromium."""
    if not Path("/usr/bin/chromium").exists():
        return None
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        try:
            pg = browser.new_page()
            t0 = time.perf_counter()
            pg.goto(page.resolve().as_uri(), timeout=300_000)
            if drawn:
                pg.wait_for_selector("body[data-charts=drawn]", state="attached", timeout=300_000)
            return time.perf_counter() - t0
        finally:
            browser.close()


def sections(page_html: str) -> dict[str, int]:
    """Bytes per <section id=...> of a page (the script after the last one counted apart)."""
    marks = [(m.start(), m.group(1)) for m in re.finditer(r'<section id="([^"]+)"', page_html)]
    script = page_html.rfind("<script>")
    out = {name: (marks[k + 1][0] if k + 1 < len(marks) else script) - start for k, (start, name) in enumerate(marks)}
    out["script"] = len(page_html) - script
    return out


def _svg_of(fig) -> str:
    import matplotlib.pyplot as plt
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def matplotlib_svg(spec: dict) -> str:
    """The rows of one of the report's Vega-Lite specs drawn by matplotlib as a static SVG: lines
    with points and bands, a heat map, interval bars or small multiples, as the spec draws them."""
    import matplotlib.pyplot as plt
    rows = spec["datasets"]["rows"]
    if "facet" in spec:  # learner small multiples: one panel per field of wide rows
        x = spec["spec"]["encoding"]["x"]["field"]
        fields = [f for f in rows[0] if f != x]
        cols = 3
        fig, axes = plt.subplots((len(fields) + cols - 1) // cols, cols, figsize=(9, 1.6 * ((len(fields) + cols - 1) // cols)),
                                 squeeze=False)
        for ax, f in zip(axes.flat, fields):
            pts = [(r[x], r[f]) for r in rows if r[f] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=1.5, lw=1)
            ax.set_title(f, fontsize=8)
        return _svg_of(fig)
    if "a" in rows[0]:  # heat map
        order = sorted({r["a"] for r in rows} | {r["b"] for r in rows})
        ix = {m: k for k, m in enumerate(order)}
        grid = [[float("nan")] * len(order) for _ in order]
        for r in rows:
            grid[ix[r["a"]]][ix[r["b"]]] = r["w"]
        fig, ax = plt.subplots(figsize=(0.35 * len(order) + 2, 0.3 * len(order) + 1))
        ax.imshow(grid, cmap="RdBu", vmin=0, vmax=1)
        for r in rows:
            ax.text(ix[r["b"]], ix[r["a"]], f"{r['w']:.2f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(order)), order, rotation=60, fontsize=7)
        ax.set_yticks(range(len(order)), order, fontsize=7)
        return _svg_of(fig)
    if "model" in rows[0]:  # interval bars
        fig, ax = plt.subplots(figsize=(5, 0.2 * len(rows) + 0.8))
        for k, r in enumerate(rows):
            ax.plot([r["low"], r["high"]], [k, k], color="#888")
            ax.plot([r["score"]], [k], "o", color="#4c78a8")
        ax.set_yticks(range(len(rows)), [r["model"] for r in rows], fontsize=7)
        ax.invert_yaxis()
        return _svg_of(fig)
    fig, ax = plt.subplots(figsize=(5.6, 2.6))  # lines with points and bands
    for name in dict.fromkeys(r["series"] for r in rows):
        mine = [r for r in rows if r["series"] == name]
        (ln,) = ax.plot([r["x"] for r in mine], [r["y"] for r in mine], marker="o", ms=2, lw=1.2, label=name)
        band = [r for r in mine if r["lo"] is not None]
        if band:
            ax.fill_between([r["x"] for r in band], [r["lo"] for r in band], [r["hi"] for r in band], color=ln.get_color(),
                            alpha=0.15, lw=0)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    return _svg_of(fig)


def vega_lite_seconds(lake: Path) -> float:
    """Seconds the run page's chart functions take (Altair building and validating the specs)."""
    from unstable_dask.lake import Lake
    from unstable_dask.report import charts, report
    spent = [0.0]

    def timed(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0
        return run
    saved = {k: getattr(charts, k) for k in ("line", "heatmap", "intervals", "facets")}
    try:
        for k, fn in saved.items():
            setattr(charts, k, timed(fn))
        report.gather(Lake(lake), RUN)
    finally:
        for k, fn in saved.items():
            setattr(charts, k, fn)
    return spent[0]


def options(page_html: str, lake: Path) -> dict:
    """Vega-Lite (as the page holds it) vs matplotlib SVG for the same charts."""
    from unstable_dask.report import charts
    found = [html_lib.unescape(s) for s in re.findall(r"data-spec='([^']*)'", page_html)]
    out = {"charts": len(found), "vega_lite_spec_bytes": sum(len(s) for s in found),
           "vega_bundle_bytes": len(charts.bundle().encode("utf-8")), "vega_lite_s": round(vega_lite_seconds(lake), 2)}
    try:
        import matplotlib
    except ImportError:
        return out | {"matplotlib": "not installed (pip install matplotlib to measure it)"}
    matplotlib.use("svg")
    matplotlib.rcParams.update({"svg.fonttype": "none", "text.parse_math": False, "font.size": 8,
                                "svg.hashsalt": "bench"})  # text as text (smaller), model names never mathtext
    t0 = time.perf_counter()
    svgs = [matplotlib_svg(json.loads(s)) for s in found]
    return out | {"matplotlib": matplotlib.__version__, "matplotlib_svg_bytes": sum(len(s.encode("utf-8")) for s in svgs),
                  "matplotlib_s": round(time.perf_counter() - t0, 2)}


def baseline_tree(rev: str, where: Path) -> Path:
    """The package as it was at `rev`, unpacked from git."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "unstable_dask"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(where, filter="data")
    return where


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, nargs="+", default=[20, 50, 200])
    ap.add_argument("--baseline", default="c041073", help="the revision before the Vega-Lite report (all-pairs heat map, SVG by hand)")
    ap.add_argument("--lakes", help="keep the synthetic lakes here and reuse them")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-report-"))
    lakes = Path(args.lakes) if args.lakes else tmp
    try:
        base = baseline_tree(args.baseline, tmp / "baseline")
        out = []
        for n in args.rounds:
            lake = lake_for(n, lakes)
            new, old = render(ROOT, lake, tmp / f"new{n}"), render(base, lake, tmp / f"old{n}")
            page_html = Path(new["page"]).read_text(encoding="utf-8")
            res = {"rounds": n, "models": n + 2, "games": 30 * n,
                   "bytes": new["bytes"], "baseline_bytes": old["bytes"], "size_ratio": round(new["bytes"] / old["bytes"], 3),
                   "render_first_s": round(new["first_s"], 2), "render_s": round(new["second_s"], 2),
                   "baseline_render_s": round(old["second_s"], 2),
                   "render_ratio": round(new["second_s"] / old["second_s"], 3),
                   "browser_drawn_s": browser_seconds(Path(new["page"]), True),
                   "baseline_browser_load_s": browser_seconds(Path(old["page"]), False),
                   "sections": sections(page_html), "options": options(page_html, lake)}
            out.append(res)
            print(json.dumps(res), flush=True)
        save("report", {"baseline": args.baseline, "runs": out, "load_avg_1m": os.getloadavg()[0],
                        "note": "one process per render; times on a shared 2-core machine are valid as ratios within a row"}, settings=vars(args))
        for r in out:
            o = r["options"]
            print(row(r["rounds"], r["models"], f"{r['bytes'] / 1e6:.2f} MB", f"{r['baseline_bytes'] / 1e6:.2f} MB",
                      f"x{r['size_ratio']}", f"{r['render_s']} s ({r['render_first_s']} s first)", f"{r['baseline_render_s']} s",
                      f"{r['browser_drawn_s']:.1f} s" if r["browser_drawn_s"] else "-",
                      f"{r['baseline_browser_load_s']:.1f} s" if r["baseline_browser_load_s"] else "-"))
        for r in out:
            o = r["options"]
            if "matplotlib_svg_bytes" in o:
                print(row(r["rounds"], o["charts"], f"{o['vega_lite_spec_bytes'] / 1e3:.0f} kB + {o['vega_bundle_bytes'] / 1e3:.0f} kB bundle",
                          f"{o['vega_lite_s']} s", f"{o['matplotlib_svg_bytes'] / 1e3:.0f} kB", f"{o['matplotlib_s']} s"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
