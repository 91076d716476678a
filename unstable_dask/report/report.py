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

from unstable_dask.config import LEGAL_RANDOM_UID, Job
from unstable_dask.lake import Lake
from unstable_dask.report import arena
from unstable_dask.report.timeline import timeline

HERE = Path(__file__).resolve().parent
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f"]
MAX_SERIES = 12  # lines per chart; the rest are left out (named in the caption)
SAMPLES_PER_MODEL = 2  # transcript games per checkpoint
TIMELINE_ROUNDS = 50  # rows of the timeline table: the newest rounds (the report stays small as runs grow)
MAX_TURN_CHARS = 4000  # long prompts/observations are cut (the lake keeps them whole)


# The learning curves, one query over every run (`run report --show-sql` prints it, `run sql` runs
# it). One row per round, split and opponent of the checkpoint that played the round (its learner
# seats), plus opponent '*' for all its games of that split. opponent: the other seats' model_uids
# joined by '+' ('self' when the checkpoint held every seat, 'solo' in a single-player game).
# Win rate counts draws half; invalid-move rate is over the learner's turns. Both carry a Wilson
# 95% score interval (z = 1.96; with draws half the successes may be fractional, which the formula
# takes as is). Turns of one game are not independent, so the turn-level interval is narrower
# than the truth. mu/sigma: the checkpoint's overall TrueSkill after the round (`run rate`).
CURVES_SQL = """
WITH subject_ AS (  -- the seats under study: the learner's, and in baseline games legal-random's in its place
    SELECT *, is_learner OR (split = 'baseline' AND model_uid = '""" + LEGAL_RANDOM_UID + """') AS subject FROM seats),
games_ AS (
    SELECT run, round, game_id, avg(num_turns) AS num_turns, max(reward) AS best, min(reward) AS worst,
           CASE WHEN count(*) = 1 THEN 'solo' ELSE coalesce(string_agg(DISTINCT model_uid, '+' ORDER BY model_uid)
               FILTER (WHERE NOT subject), 'self') END AS opponent
    FROM subject_ GROUP BY run, round, game_id),
seats_ AS (  -- a single-player game is won with a reward > 0 (as `run rate` counts it)
    SELECT s.run, s.round, s.split, g.opponent, s.game_id, g.num_turns, s.reward,
           CASE WHEN s.num_players = 1 THEN s.reward > 0 ELSE s.reward = g.best AND g.best > g.worst END::INT AS win,
           CASE WHEN s.num_players = 1 THEN s.reward = 0 ELSE g.best = g.worst END::INT AS draw
    FROM subject_ s JOIN games_ g USING (run, round, game_id) WHERE s.subject),
turns_ AS (
    SELECT t.run, t.round, t.split, g.opponent, t.format_ok, t.invalid_move, t.completion_tokens
    FROM turns t JOIN games_ g USING (run, round, game_id) WHERE t.is_learner AND t.prompt IS NOT NULL),
by_seat AS (
    SELECT run, round, split, CASE WHEN grouping(opponent) = 1 THEN '*' ELSE opponent END AS opponent,
           count(DISTINCT game_id) AS games, count(*) AS seats, sum(win)::BIGINT AS wins,  -- sum() is HUGEINT: Decimal in Python
           sum(draw)::BIGINT AS draws, (count(*) - sum(win) - sum(draw))::BIGINT AS losses, (sum(win) + 0.5 * sum(draw)) / count(*) AS win_rate,
           avg(reward) AS mean_reward, avg(num_turns) AS game_length
    FROM seats_ GROUP BY GROUPING SETS ((run, round, split, opponent), (run, round, split))),
by_turn AS (
    SELECT run, round, split, CASE WHEN grouping(opponent) = 1 THEN '*' ELSE opponent END AS opponent,
           count(*) AS turns, avg(format_ok::DOUBLE) AS format_success, sum(invalid_move::INT) AS invalid_turns,
           sum(invalid_move::INT) / count(*) AS invalid_rate, avg(completion_tokens) AS mean_completion_tokens
    FROM turns_ GROUP BY GROUPING SETS ((run, round, split, opponent), (run, round, split))),
joined AS (
    SELECT s.*, r.checkpoint_uid, t.* EXCLUDE (run, round, split, opponent), 1.959963984540054 AS z
    FROM rounds r JOIN by_seat s USING (run, round) LEFT JOIN by_turn t USING (run, round, split, opponent)),
wilson AS (  -- centre and half-width of the Wilson interval of win_rate (n = seats) and invalid_rate (n = turns)
    SELECT *, (win_rate + z * z / (2 * seats)) / (1 + z * z / seats) AS wc,
           z * sqrt(win_rate * (1 - win_rate) / seats + z * z / (4 * seats * seats)) / (1 + z * z / seats) AS wh,
           (invalid_rate + z * z / (2 * turns)) / (1 + z * z / turns) AS ic,
           z * sqrt(invalid_rate * (1 - invalid_rate) / turns + z * z / (4 * turns * turns)) / (1 + z * z / turns) AS ih
    FROM joined)
SELECT w.run, w.round, w.checkpoint_uid, w.split, w.opponent, w.games, w.wins, w.draws, w.losses,
       w.win_rate, greatest(w.wc - w.wh, 0) AS win_rate_low, least(w.wc + w.wh, 1) AS win_rate_high,
       w.turns, w.format_success, w.invalid_rate,
       greatest(w.ic - w.ih, 0) AS invalid_rate_low, least(w.ic + w.ih, 1) AS invalid_rate_high,
       w.mean_completion_tokens, w.mean_reward, w.game_length, h.mu, h.sigma, h.conservative
FROM wilson w
LEFT JOIN rating_history h ON h.run = w.run AND h.round = w.round AND h.model_uid = w.checkpoint_uid AND h.env_id = '*'
"""


def round_curves(con, run_name: str, round_: Optional[int] = None) -> list[dict]:
    """CURVES_SQL rows of one run (of one round when given), eval rows first within a round."""
    where, params = ("run = ? AND round = ?", [run_name, round_]) if round_ is not None else ("run = ?", [run_name])
    return _rows(con, f"SELECT * FROM ({CURVES_SQL}) WHERE {where} ORDER BY round, split DESC, opponent", params)


def _rows(con, sql: str, params: list) -> list[dict]:
    return con.sql(sql, params=params).to_arrow_table().to_pylist()


def _nice(v: float) -> str:
    return f"{v:.6g}" if abs(v) < 1e6 else f"{v:.3e}"


def _ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    if hi <= lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    step *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= n)
    if integer:  # rounds and iterations: no tick at 0.5
        step = max(step, 1)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def line_chart(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
               bands: Optional[dict[str, list[tuple[float, float, float]]]] = None,
               width: int = 640, height: int = 260, y_range: Optional[tuple[float, float]] = None) -> Optional[dict]:
    """A line chart as coordinates for the `line_chart` template macro (None without data).

    bands: a shaded (x, low, high) interval per series, shown in each point's tooltip too;
    y_range: fixed y limits (rates use 0..1, so a flat curve looks flat).
    """
    names = [k for k, pts in series.items() if pts][:MAX_SERIES]
    pts_all = [p for k in names for p in series[k]] + [(x, y) for k in names for x, lo, hi in (bands or {}).get(k, [])
                                                       for y in (lo, hi)]
    if not pts_all:
        return None
    x0, x1 = min(p[0] for p in pts_all), max(p[0] for p in pts_all)
    integer_x = all(float(p[0]).is_integer() for p in pts_all)
    y0, y1 = y_range or (min(p[1] for p in pts_all), max(p[1] for p in pts_all))
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
        poly = " ".join(f"{sx(x)},{sy(hi)}" for x, _, hi in band) + " " +\
            " ".join(f"{sx(x)},{sy(lo)}" for x, lo, _ in reversed(band))
        ci = {x: f" (95% CI {_nice(lo)} .. {_nice(hi)})" for x, lo, hi in band}
        lines.append({"name": name, "color": PALETTE[k % len(PALETTE)], "path": " ".join(f"{sx(x)},{sy(y)}" for x, y in pts),
                      "dots": [(sx(x), sy(y), _nice(x), _nice(y) + ci.get(x, "")) for x, y in pts], "band": poly.strip(),
                      "legend_y": T + 14 * k + 8})
    return {"width": width, "height": height, "lines": lines, "xlabel": xlabel, "ylabel": ylabel,
            "left": L, "right": width - R, "top": T, "bottom": height - B,
            "xticks": [(sx(t), _nice(t)) for t in _ticks(x0, x1, integer=integer_x)],
            "yticks": [(sy(t), _nice(t)) for t in _ticks(y0, y1)],
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
        cells.append({"x": left + ix[r["model_b"]] * cell, "y": top + ix[r["model_a"]] * cell, "color": arena.rdbu(w),
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


def gather(lake: Lake, run_name: str) -> dict[str, Any]:
    """Everything the run page shows, as plain Python values."""
    con = lake.connect()
    try:
        boards, arena_views = arena.views(con, run_name)  # ratings rows + Arena columns, per env
        history = _rows(con, "SELECT * EXCLUDE (run) FROM rating_history WHERE run = ? ORDER BY round, model_uid", [run_name])
        h2h = _rows(con, "SELECT * EXCLUDE (run) FROM head_to_head WHERE run = ? AND env_id = '*' "
                    "ORDER BY model_a, model_b", [run_name])
        ckpts = _rows(con, "SELECT uid, parent_uid, iteration FROM checkpoints WHERE run = ? ORDER BY iteration, uid", [run_name])
        curves = round_curves(con, run_name)
        per_env = _rows(con, """
            SELECT g.env_id, g.split, count(DISTINCT g.game_id) AS games, avg(g.num_turns) AS game_length,
                   avg((s.reward > 0)::DOUBLE) AS learner_win_rate
            FROM games g LEFT JOIN seats s ON s.game_id = g.game_id AND s.run = g.run AND s.is_learner
            WHERE g.run = ? GROUP BY ALL ORDER BY g.env_id, g.split""", [run_name])
        learner = _learner(con, run_name)
        samples = _samples(con, run_name)
        busy = timeline(con, run_name)
        engine = _rows(con, "SELECT round, engine, prefix_cache_hit_rate, in_flight_frac FROM rounds WHERE run = ? "
                            "ORDER BY round DESC LIMIT 1", [run_name])
    finally:
        con.close()
    envs = list(boards)
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
    return {"run": run_name, "envs": envs, "boards": boards, "hist_chart": hist_chart, "ckpt_chart": ckpt_chart,
            "heatmap": heatmap(h2h), "arena": arena_views, "curves": curves, "curve_charts": curve_charts(curves), "per_env": per_env,
            "learner": learner, "samples": samples, "checkpoints": ckpts, "timeline": busy[-TIMELINE_ROUNDS:],
            "engine": engine[0] if engine else None}


def curve_charts(curves: list[dict]) -> dict[str, Optional[dict]]:
    """The learning curves (rows of CURVES_SQL for one run), titled; x is the round."""
    def pts(rows: list[dict], key: str) -> list[tuple[float, float]]:
        return [(r["round"], r[key]) for r in rows if r[key] is not None]

    def ci(rows: list[dict], key: str) -> list[tuple[float, float, float]]:
        return [(r["round"], r[f"{key}_low"], r[f"{key}_high"]) for r in rows if r[f"{key}_low"] is not None]

    every = {sp: [r for r in curves if r["split"] == sp and r["opponent"] == "*"] for sp in ("train", "eval")}
    # Win rate is shown against each fixed opponent of the eval games (mirror games: 0.5 by construction).
    opponents = list(dict.fromkeys(r["opponent"] for r in curves if r["split"] == "eval" and r["opponent"] not in ("*", "self")))
    vs = {o: [r for r in curves if r["split"] == "eval" and r["opponent"] == o] for o in opponents}
    # round.eval_baseline: legal-random on the same eval games, the bar a learning claim must clear
    base = {o: [r for r in curves if r["split"] == "baseline" and r["opponent"] == o] for o in opponents}

    def name(opponent: str) -> str:
        return "single-player" if opponent == "solo" else f"vs {opponent}"

    rated = [r for r in every["eval"] or every["train"] if r["mu"] is not None]
    def chart(series: dict, ylabel: str, **kw) -> Optional[dict]:  # two charts side by side on a page
        return line_chart(series, "round", ylabel, width=560, height=240, **kw)

    return {
        "Eval win rate against each fixed opponent (draws half), Wilson 95% CI":
            chart({name(o): pts(rows, "win_rate") for o, rows in vs.items()}
                  | {f"{LEGAL_RANDOM_UID} {name(o)}": pts(rows, "win_rate") for o, rows in base.items() if rows},
                  "win rate", bands={name(o): ci(rows, "win_rate") for o, rows in vs.items()}
                  | {f"{LEGAL_RANDOM_UID} {name(o)}": ci(rows, "win_rate") for o, rows in base.items() if rows},
                  y_range=(0, 1)),
        "Invalid-move rate of the learner's turns, Wilson 95% CI":
            chart({sp: pts(rows, "invalid_rate") for sp, rows in every.items()}, "invalid-move rate",
                  bands={sp: ci(rows, "invalid_rate") for sp, rows in every.items()}, y_range=(0, 1)),
        "Format success (a \\boxed{} answer) of the learner's turns":
            chart({sp: pts(rows, "format_success") for sp, rows in every.items()}, "format success", y_range=(0, 1)),
        "Mean completion length of the learner's turns (tokens)":
            chart({sp: pts(rows, "mean_completion_tokens") for sp, rows in every.items()}, "tokens"),
        "TrueSkill of the checkpoint that played the round (mu ± 3 sigma; conservative = mu − 3 sigma)":
            chart({"mu": [(r["round"], r["mu"]) for r in rated], "conservative": [(r["round"], r["conservative"]) for r in rated]},
                  "TrueSkill", bands={"mu": [(r["round"], r["mu"] - 3 * r["sigma"], r["mu"] + 3 * r["sigma"]) for r in rated]}),
    }


# learner_steps columns that number or seed an update: counters and hashes, not curves.
NOT_CURVES = {"iteration", "run", "step", "update", "batch_seed"}


def learner_columns(con) -> list[str]:
    """The numeric learner_steps columns that are curves (also what `trackers` mirrors)."""
    schema = con.sql("SELECT * FROM learner_steps LIMIT 0").to_arrow_table().schema
    return [f.name for f in schema if f.name not in NOT_CURVES
            and (pa.types.is_integer(f.type) or pa.types.is_floating(f.type))]


def _learner(con, run_name: str) -> dict[str, dict]:
    """One chart per numeric learner_steps column, averaged per iteration."""
    cols = learner_columns(con)
    if not cols:
        return {}
    # Column names come from the lake's own schema, quoted as identifiers; values stay parameters.
    avgs = ", ".join(f'avg("{c}") AS "{c}"' for c in (c.replace('"', '""') for c in cols))
    rows = _rows(con, f"SELECT iteration, {avgs} FROM learner_steps WHERE run = ? GROUP BY iteration ORDER BY iteration", [run_name])
    charts = {}
    for c in cols:
        pts = [(r["iteration"], r[c]) for r in rows if r[c] is not None and math.isfinite(r[c])]
        chart = line_chart({c: pts}, "iteration", c, width=420, height=200) if pts else None
        if chart is not None:
            charts[c] = chart
    return charts


def _samples(con, run_name: str) -> list[dict]:
    """A few games per learner model (first by round, game_id), with their turns."""
    models = [r["model_uid"] for r in _rows(con, "SELECT DISTINCT model_uid FROM turns WHERE run = ? AND is_learner "
                                           "ORDER BY model_uid", [run_name])]
    out = []
    for m in models:
        games = _rows(con, """SELECT game_id, round, env_id, split, seats FROM games WHERE run = ? AND game_id IN
                                  (SELECT game_id FROM turns WHERE run = ? AND model_uid = ? AND is_learner)
                              ORDER BY round, game_id LIMIT ?""", [run_name, run_name, m, SAMPLES_PER_MODEL])
        for g in games:
            g["turns"] = _rows(con, """SELECT turn, pid, model_uid, observation, prompt, completion, action, format_ok,
                                              invalid_move FROM turns WHERE run = ? AND game_id = ? ORDER BY turn""",
                               [run_name, g["game_id"]])
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


def svg_document(chart: dict, title: str) -> str:
    """A `line_chart` as a standalone SVG file (for README / BENCHMARKS), styled like the report."""
    css = "\n".join(line for line in (HERE / "static" / "report.css").read_text(encoding="utf-8").splitlines()
                    if line.startswith("svg "))
    macros: Any = _env().get_template("macros.j2").module
    return str(macros.line_svg(chart, title, "svg { font-family: system-ui, sans-serif; }\n" + css)).strip() + "\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def report(job: Job) -> Path:
    """Write reports/<run>/index.html for job.run.name and refresh reports/index.html; return the page."""
    lake, root, run_name = Lake(job.run.lake), Path(job.run.reports), job.run.name
    env = _env()
    page = root / run_name / "index.html"
    _write(page, env.get_template("run.html.j2").render(**gather(lake, run_name)))
    runs = []
    for d in sorted(p.parent for p in root.glob("*/index.html")):
        runs.append({"name": d.name, "href": f"{d.name}/index.html", **_summary(lake, d.name)})
    _write(root / "index.html", env.get_template("index.html.j2").render(runs=runs))
    return page


def _summary(lake: Lake, run_name: str) -> dict[str, Any]:
    con = lake.connect()
    try:
        rounds, games = con.sql("SELECT count(DISTINCT round), coalesce(sum(games), 0) FROM rounds WHERE run = ?",
                                params=[run_name]).fetchall()[0]
        top = _rows(con, "SELECT model_uid, conservative FROM ratings WHERE run = ? AND env_id = '*' "
                    "ORDER BY conservative DESC, model_uid LIMIT 1", [run_name])
    finally:
        con.close()
    return {"rounds": rounds, "games": games, "top": top[0] if top else None}
