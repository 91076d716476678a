"""The report job: a static, offline HTML site per run (reports/<run>/index.html) plus an index.

Everything is read from the lake with SQL (model text is passed as parameters, never spliced into
SQL) and rendered by jinja2 with autoescape on. Charts are inline SVG built here as numbers
(coordinates) and drawn by template macros, so every label goes through autoescape as well. The
only script is static/report.js (table sorting), inlined from the package; no model text is ever
placed inside a <script> block, and the page loads nothing from the network.
"""
from __future__ import annotations

import base64
import hashlib
import math
import os
import uuid
from pathlib import Path
from typing import Any, Optional

import jinja2
import pyarrow as pa
from markupsafe import Markup

from . import lake
from .config import Job

HERE = Path(__file__).resolve().parent
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f"]
MAX_SERIES = 12  # lines per chart; the rest are left out (named in the caption)
SAMPLES_PER_MODEL = 2  # transcript games per checkpoint
MAX_TURN_CHARS = 4000  # long prompts/observations are cut (the lake keeps them whole)


def _rows(con, sql: str, params: list) -> list[dict]:
    return con.sql(sql, params=params).to_arrow_table().to_pylist()


def _nice(v: float) -> str:
    return f"{v:.6g}" if abs(v) < 1e6 else f"{v:.3e}"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    step *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= n)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def line_chart(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
               bands: Optional[dict[str, list[tuple[float, float, float]]]] = None,
               width: int = 640, height: int = 260) -> Optional[dict]:
    """A line chart as coordinates for the `line_chart` template macro (None without data)."""
    names = [k for k, pts in series.items() if pts][:MAX_SERIES]
    pts_all = [p for k in names for p in series[k]] + [(x, y) for k in names for x, lo, hi in (bands or {}).get(k, [])
                                                       for y in (lo, hi)]
    if not pts_all:
        return None
    x0, x1 = min(p[0] for p in pts_all), max(p[0] for p in pts_all)
    y0, y1 = min(p[1] for p in pts_all), max(p[1] for p in pts_all)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad
    L, R, T, B = 56, 150, 12, 36  # margins: the legend sits on the right

    def sx(x: float) -> float:
        return round(L + (x - x0) / (x1 - x0) * (width - L - R), 1)

    def sy(y: float) -> float:
        return round(height - B - (y - y0) / (y1 - y0) * (height - T - B), 1)

    lines = []
    for k, name in enumerate(names):
        pts = sorted(series[name])
        band = sorted((bands or {}).get(name, []))
        poly = " ".join(f"{sx(x)},{sy(hi)}" for x, _, hi in band) + " " + \
            " ".join(f"{sx(x)},{sy(lo)}" for x, lo, _ in reversed(band))
        lines.append({"name": name, "color": PALETTE[k % len(PALETTE)], "path": " ".join(f"{sx(x)},{sy(y)}" for x, y in pts),
                      "dots": [(sx(x), sy(y), _nice(x), _nice(y)) for x, y in pts], "band": poly.strip(),
                      "legend_y": T + 14 * k + 8})
    return {"width": width, "height": height, "lines": lines, "xlabel": xlabel, "ylabel": ylabel,
            "left": L, "right": width - R, "top": T, "bottom": height - B,
            "xticks": [(sx(t), _nice(t)) for t in _ticks(x0, x1)], "yticks": [(sy(t), _nice(t)) for t in _ticks(y0, y1)],
            "omitted": [k for k, pts in series.items() if pts][MAX_SERIES:]}


def heatmap(h2h: list[dict]) -> Optional[dict]:
    """Win rate of the row model against the column model, as cells for the `heatmap` macro."""
    models = sorted({r["model_a"] for r in h2h})
    if not models:
        return None
    cell, left, top = 34, 170, 12
    ix = {m: k for k, m in enumerate(models)}
    cells = []
    for r in h2h:
        w = r["win_rate_a"]
        red, blue = int(255 * min(1, 2 * (1 - w))), int(255 * min(1, 2 * w))  # 0 red .. 0.5 white .. 1 blue
        color = f"rgb({red},{min(red, blue)},{blue})"
        cells.append({"x": left + ix[r["model_b"]] * cell, "y": top + ix[r["model_a"]] * cell, "color": color,
                      "text": f"{w:.2f}", "a": r["model_a"], "b": r["model_b"], "games": r["games"]})
    n = len(models)
    return {"cells": cells, "size": cell, "width": left + n * cell + 10, "height": top + n * cell + 150,
            "rows": [(m, top + k * cell + cell / 2) for k, m in enumerate(models)],
            "cols": [(m, left + k * cell + cell / 2, top + n * cell + 6) for k, m in enumerate(models)]}


def _bt_bars(rows: list[dict]) -> None:
    """Add x positions (0..100) of each row's BT CI bar, on one scale per leaderboard."""
    vals = [v for r in rows for v in (r["bt_ci_low"], r["bt_ci_high"], r["bt_score"]) if v is not None]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    span = (hi - lo) or 1.0
    for r in rows:
        pos = {k: None if r[k] is None else round(4 + 92 * (r[k] - lo) / span, 1) for k in ("bt_score", "bt_ci_low", "bt_ci_high")}
        r["bar"] = pos if pos["bt_score"] is not None else None


def _table_exists(con, name: str) -> bool:
    return bool(con.sql("SELECT count(*) FROM duckdb_views() WHERE view_name = ?", params=[name]).fetchall()[0][0])


def gather(lake_dir: Path, run: str) -> dict[str, Any]:
    """Everything the run page shows, as plain Python values."""
    con = lake.connect(lake_dir)
    try:
        ratings = _rows(con, "SELECT * EXCLUDE (run) FROM ratings WHERE run = ? "
                        "ORDER BY env_id, conservative DESC, model_uid", [run])
        history = _rows(con, "SELECT * EXCLUDE (run) FROM rating_history WHERE run = ? ORDER BY round, model_uid", [run])
        h2h = _rows(con, "SELECT * EXCLUDE (run) FROM head_to_head WHERE run = ? AND env_id = '*' "
                    "ORDER BY model_a, model_b", [run])
        ckpts = _rows(con, "SELECT uid, parent_uid, iteration FROM checkpoints WHERE run = ? ORDER BY iteration, uid", [run])
        rounds = _rows(con, """
            WITH g AS (SELECT round, split, count(*) AS games, avg(num_turns) AS game_length
                       FROM games WHERE run = ? GROUP BY ALL),
                 s AS (SELECT round, split, avg((reward > 0)::DOUBLE) AS learner_win_rate, avg(reward) AS learner_reward
                       FROM seats WHERE run = ? AND is_learner GROUP BY ALL),
                 t AS (SELECT round, split, count(*) AS model_turns, avg(format_ok::DOUBLE) AS format_success,
                              avg(invalid_move::DOUBLE) AS invalid_move_rate, avg(completion_tokens) AS completion_tokens
                       FROM turns WHERE run = ? AND prompt IS NOT NULL GROUP BY ALL)
            SELECT * FROM g LEFT JOIN s USING (round, split) LEFT JOIN t USING (round, split) ORDER BY round, split""",
                       [run, run, run])
        per_env = _rows(con, """
            SELECT g.env_id, g.split, count(DISTINCT g.game_id) AS games, avg(g.num_turns) AS game_length,
                   avg((s.reward > 0)::DOUBLE) AS learner_win_rate
            FROM games g LEFT JOIN seats s ON s.game_id = g.game_id AND s.run = g.run AND s.is_learner
            WHERE g.run = ? GROUP BY ALL ORDER BY g.env_id, g.split""", [run])
        learner = _learner(con, run)
        samples = _samples(con, run)
    finally:
        con.close()
    envs = sorted({r["env_id"] for r in ratings}, key=lambda e: (e != "*", e))
    boards = {e: [dict(r) for r in ratings if r["env_id"] == e] for e in envs}
    for rows in boards.values():
        _bt_bars(rows)
    overall = [h for h in history if h["env_id"] == "*"]
    hist_chart = line_chart({m: [(h["round"], h["mu"]) for h in overall if h["model_uid"] == m]
                             for m in dict.fromkeys(h["model_uid"] for h in overall)}, "round", "mu",
                            bands={m: [(h["round"], h["mu"] - h["sigma"], h["mu"] + h["sigma"]) for h in overall
                                       if h["model_uid"] == m] for m in dict.fromkeys(h["model_uid"] for h in overall)})
    rated = {r["model_uid"]: r for r in boards.get("*", [])}
    ck_pts = [(c["iteration"], rated[c["uid"]]) for c in ckpts if c["uid"] in rated]
    ckpt_chart = line_chart({"mu": [(i, r["mu"]) for i, r in ck_pts], "conservative": [(i, r["conservative"]) for i, r in ck_pts]},
                            "checkpoint iteration", "rating", bands={"mu": [(i, r["mu"] - 3 * r["sigma"], r["mu"] + 3 * r["sigma"])
                                                                            for i, r in ck_pts]})
    stat_keys = ["format_success", "invalid_move_rate", "game_length", "completion_tokens", "learner_win_rate"]
    round_charts = {k: line_chart({sp: [(r["round"], r[k]) for r in rounds if r["split"] == sp and r[k] is not None]
                                   for sp in ("train", "eval")}, "round", k) for k in stat_keys}
    return {"run": run, "envs": envs, "boards": boards, "hist_chart": hist_chart, "ckpt_chart": ckpt_chart,
            "heatmap": heatmap(h2h), "rounds": rounds, "round_charts": round_charts, "per_env": per_env,
            "learner": learner, "samples": samples, "checkpoints": ckpts}


def _learner(con, run: str) -> dict[str, dict]:
    """One chart per numeric learner_steps column, averaged per iteration."""
    schema = con.sql("SELECT * FROM learner_steps LIMIT 0").to_arrow_table().schema
    cols = [f.name for f in schema if f.name not in ("iteration", "run", "step")
            and (pa.types.is_integer(f.type) or pa.types.is_floating(f.type))]
    if not cols:
        return {}
    # Column names come from the lake's own schema, quoted as identifiers; values stay parameters.
    avgs = ", ".join(f'avg("{c}") AS "{c}"' for c in (c.replace('"', '""') for c in cols))
    rows = _rows(con, f"SELECT iteration, {avgs} FROM learner_steps WHERE run = ? GROUP BY iteration ORDER BY iteration", [run])
    charts = {}
    for c in cols:
        pts = [(r["iteration"], r[c]) for r in rows if r[c] is not None and math.isfinite(r[c])]
        if pts:
            charts[c] = line_chart({c: pts}, "iteration", c, width=420, height=200)
    return charts


def _samples(con, run: str) -> list[dict]:
    """A few games per learner model (first by round, game_id), with their turns."""
    models = [r["model_uid"] for r in _rows(con, "SELECT DISTINCT model_uid FROM turns WHERE run = ? AND is_learner "
                                           "ORDER BY model_uid", [run])]
    out = []
    for m in models:
        games = _rows(con, """SELECT game_id, round, env_id, split, seats FROM games WHERE run = ? AND game_id IN
                                  (SELECT game_id FROM turns WHERE run = ? AND model_uid = ? AND is_learner)
                              ORDER BY round, game_id LIMIT ?""", [run, run, m, SAMPLES_PER_MODEL])
        for g in games:
            g["turns"] = _rows(con, """SELECT turn, pid, model_uid, observation, prompt, completion, action, format_ok,
                                              invalid_move FROM turns WHERE run = ? AND game_id = ? ORDER BY turn""",
                               [run, g["game_id"]])
            for t in g["turns"]:
                for k in ("observation", "prompt", "completion"):
                    if t[k] is not None and len(t[k]) > MAX_TURN_CHARS:
                        t[k] = t[k][:MAX_TURN_CHARS] + f"\n... [{len(t[k]) - MAX_TURN_CHARS} more characters]"
        out.append({"model": m, "games": games})
    return out


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = lambda v, fmt="{:.2f}": "" if v is None else fmt.format(v)
    # Our own static files (not data) are inlined so the page works from file:// with no requests.
    static = {p.name: Markup(p.read_text(encoding="utf-8")) for p in sorted((HERE / "static").iterdir()) if p.is_file()}
    env.globals["static"] = static
    # The Content-Security-Policy allows exactly our script (by hash): even if escaping ever failed,
    # an injected <script> or on* attribute would not run.
    digest = hashlib.sha256(str(static["report.js"]).encode("utf-8")).digest()
    env.globals["script_hash"] = "sha256-" + base64.b64encode(digest).decode("ascii")
    return env


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def report(job: Job) -> Path:
    """Write reports/<run>/index.html for job.run.name and refresh reports/index.html; return the page."""
    lake_dir, root, run = Path(job.run.lake), Path(job.run.reports), job.run.name
    env = _env()
    page = root / run / "index.html"
    _write(page, env.get_template("run.html.j2").render(**gather(lake_dir, run)))
    runs = []
    for d in sorted(p.parent for p in root.glob("*/index.html")):
        runs.append({"name": d.name, "href": f"{d.name}/index.html", **_summary(lake_dir, d.name)})
    _write(root / "index.html", env.get_template("index.html.j2").render(runs=runs))
    return page


def _summary(lake_dir: Path, run: str) -> dict[str, Any]:
    con = lake.connect(lake_dir)
    try:
        rounds, games = con.sql("SELECT count(DISTINCT round), coalesce(sum(games), 0) FROM rounds WHERE run = ?",
                                params=[run]).fetchall()[0]
        top = _rows(con, "SELECT model_uid, conservative FROM ratings WHERE run = ? AND env_id = '*' "
                    "ORDER BY conservative DESC, model_uid LIMIT 1", [run])
    finally:
        con.close()
    return {"rounds": rounds, "games": games, "top": top[0] if top else None}
