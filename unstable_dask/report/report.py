"""The report job: a static, offline HTML site per run (reports/<run>/index.html) plus an index.

Everything is read from the lake with SQL (model text is passed as parameters, never spliced into
SQL) and rendered by jinja2 with autoescape on. Charts are Vega-Lite specs (charts.py) carried as
autoescaped JSON in an HTML attribute and drawn by the page's one script: the Vega bundle followed
by static/report.js (charts, table sorting), inlined and allowed by hash. No model text is ever
placed inside a <script> block, and the page loads nothing from the network.

A page stays small as the run grows: leaderboards, matrices and maps show the best and the newest
models (arena.shown), per-round tables the newest rounds, transcripts the newest and the best
checkpoints; the charts show every round. The lake keeps everything, a query away.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from unstable_dask.config import Job
from unstable_dask.lake import Lake
from unstable_dask.lake.read import sql_str
from unstable_dask.report import arena, charts, league, pages, strength
from unstable_dask.report.timeline import timeline

TABLE_ROUNDS = 20  # rows of the per-round tables (curves, timeline): the newest rounds
SAMPLE_MODELS = arena.NEWEST + 1  # transcripts of the newest learner checkpoints and the best-rated one
SAMPLES_PER_MODEL = 2  # transcript games per checkpoint


def _wilson_terms(p: str, n: str) -> str:
    """The centre and half-width of the Wilson 95% score interval of the rate column p over n trials,
    as SQL columns p_c and p_h (z is a column of the query)."""
    return (f"({p} + z * z / (2 * {n})) / (1 + z * z / {n}) AS {p}_c, "
            f"z * sqrt({p} * (1 - {p}) / {n} + z * z / (4 * {n} * {n})) / (1 + z * z / {n}) AS {p}_h")


def _wilson_bounds(p: str) -> str:
    """p_low and p_high from _wilson_terms' columns, clipped to [0, 1]."""
    return f"greatest({p}_c - {p}_h, 0) AS {p}_low, least({p}_c + {p}_h, 1) AS {p}_high"


# The learning curves, one query over every run (`run report --show-sql` prints it, `run sql` runs
# it). One row per round, split, player and opponent, plus opponent '*' for all the player's games
# of that split. player: the checkpoint that played the round (its learner seats), or in split
# `baseline` the agent of round.eval_baseline that replayed its eval games in those seats. opponent:
# the other seats' model_uids joined by '+' ('self' when the player held every seat, 'solo' in a
# single-player game).
# Win rate counts draws half; invalid-move rate and format success are over the learner's turns.
# Each carries a Wilson 95% score interval (`_wilson_terms`, z = 1.96; with draws half the successes
# may be fractional, which the formula takes as is). Turns of one game are not independent, so the
# turn-level interval is narrower than the truth. mu/sigma: the checkpoint's overall TrueSkill
# after the round (`run rate`).
CURVES_SQL = """
WITH """ + strength.SCORED_CTES + """,
turns_ AS (
    SELECT t.run, t.round, t.split, g.player, g.opponent, t.format_ok, t.invalid_move, t.completion_tokens
    FROM turns t JOIN games_ g USING (run, round, game_id) WHERE t.is_learner AND t.prompt IS NOT NULL),
by_seat AS (
    SELECT run, round, split, player, CASE WHEN grouping(opponent) = 1 THEN '*' ELSE opponent END AS opponent,
           count(DISTINCT game_id) AS games, count(*) AS seats, sum(win)::BIGINT AS wins,  -- sum() is HUGEINT: Decimal in Python
           sum(draw)::BIGINT AS draws, (count(*) - sum(win) - sum(draw))::BIGINT AS losses, (sum(win) + 0.5 * sum(draw)) / count(*) AS win_rate,
           avg(reward) AS mean_reward, avg(num_turns) AS game_length
    FROM seats_ GROUP BY GROUPING SETS ((run, round, split, player, opponent), (run, round, split, player))),
by_turn AS (
    SELECT run, round, split, player, CASE WHEN grouping(opponent) = 1 THEN '*' ELSE opponent END AS opponent,
           count(*) AS turns, avg(format_ok::DOUBLE) AS format_success, sum(invalid_move::INT) AS invalid_turns,
           sum(invalid_move::INT) / count(*) AS invalid_rate, avg(completion_tokens) AS mean_completion_tokens
    FROM turns_ GROUP BY GROUPING SETS ((run, round, split, player, opponent), (run, round, split, player))),
joined AS (
    SELECT s.*, r.checkpoint_uid, t.* EXCLUDE (run, round, split, player, opponent), 1.959963984540054 AS z
    FROM rounds r JOIN by_seat s USING (run, round) LEFT JOIN by_turn t USING (run, round, split, player, opponent)),
wilson AS (  -- win_rate over seats, invalid_rate and format_success over turns
    SELECT *, """ + _wilson_terms("win_rate", "seats") + """,
           """ + _wilson_terms("invalid_rate", "turns") + """,
           """ + _wilson_terms("format_success", "turns") + """
    FROM joined)
SELECT w.run, w.round, w.checkpoint_uid, w.split, w.player, w.opponent, w.games, w.wins, w.draws, w.losses,
       w.win_rate, """ + _wilson_bounds("win_rate") + """,
       w.turns, w.format_success, """ + _wilson_bounds("format_success") + """,
       w.invalid_rate, """ + _wilson_bounds("invalid_rate") + """,
       w.mean_completion_tokens, w.mean_reward, w.game_length, h.mu, h.sigma, h.conservative
FROM wilson w
LEFT JOIN rating_history h ON h.run = w.run AND h.round = w.round AND h.model_uid = w.checkpoint_uid AND h.env_id = '*'
"""


def round_curves(con, run_name: str, round_: Optional[int] = None) -> list[dict]:
    """CURVES_SQL rows of one run (of one round when given), eval rows first within a round."""
    where, params = ("run = ? AND round = ?", [run_name, round_]) if round_ is not None else ("run = ?", [run_name])
    return pages.rows(con, f"SELECT * FROM ({CURVES_SQL}) WHERE {where} ORDER BY round, split DESC, player, opponent", params)


def gather(lake: Lake, run_name: str, pool_rounds: int = 3) -> dict[str, Any]:
    """Everything the run page shows, as plain Python values and chart specs (pooled figures over
    the latest `pool_rounds` rounds: round.pool_rounds)."""
    con = lake.connect()
    try:
        ckpts = pages.rows(con, "SELECT uid, parent_uid, iteration FROM checkpoints WHERE run = ? ORDER BY iteration, uid", [run_name])
        newest = [c["uid"] for c in ckpts][-arena.NEWEST:]
        boards, arena_views = arena.views(con, run_name, newest)  # ratings rows + Arena columns, per env
        overall = arena_views.get("*", {}).get("shown", [])
        history = pages.rows(con, "SELECT round, model_uid, mu, sigma FROM rating_history WHERE run = ? AND env_id = '*' "
                        "AND list_contains(?, model_uid) ORDER BY round, model_uid", [run_name, overall])
        h2h = pages.rows(con, "SELECT model_a, model_b, win_rate_a, games FROM head_to_head WHERE run = ? AND env_id = '*' "
                    "AND list_contains(?, model_a) AND list_contains(?, model_b)", [run_name, overall, overall])
        curves = round_curves(con, run_name)
        probes = strength.probe_counts(con, run_name)
        per_env = pages.rows(con, """
            SELECT g.env_id, g.split, count(DISTINCT g.game_id) AS games, avg(g.num_turns) AS game_length,
                   avg((s.reward > 0)::DOUBLE) AS learner_win_rate
            FROM games g LEFT JOIN seats s ON s.game_id = g.game_id AND s.run = g.run AND s.is_learner
            WHERE g.run = ? GROUP BY ALL ORDER BY g.env_id, g.split""", [run_name])
        learner = _learner(con, run_name)
        samples = _samples(con, run_name, newest, overall)
        busy = timeline(con, run_name)
        engine = pages.rows(con, "SELECT round, engine, prefix_cache_hit_rate, in_flight_frac FROM rounds WHERE run = ? "
                            "ORDER BY round DESC LIMIT 1", [run_name])
    finally:
        con.close()
    rated = {r["model_uid"]: r for r in boards.get("*", [])}
    hist_chart = charts.line({m: [(h["round"], h["mu"]) for h in history if h["model_uid"] == m] for m in overall},
                             "round", "mu", bands={m: [(h["round"], h["mu"] - h["sigma"], h["mu"] + h["sigma"])
                                                       for h in history if h["model_uid"] == m] for m in overall},
                             band="mu ± sigma", width=560)
    ck_pts = [(c["iteration"], rated[c["uid"]]) for c in ckpts if c["uid"] in rated]
    ckpt_chart = charts.line({"mu": [(i, r["mu"]) for i, r in ck_pts], "conservative": [(i, r["conservative"]) for i, r in ck_pts]},
                             "checkpoint iteration", "rating", band="mu ± 3 sigma", width=560,
                             bands={"mu": [(i, r["mu"] - 3 * r["sigma"], r["mu"] + 3 * r["sigma"]) for i, r in ck_pts]})
    envs = list(boards)
    tables = {e: [r for r in boards[e] if r["model_uid"] in set(arena_views[e]["shown"])] for e in envs}
    return {"run": run_name, "envs": envs, "boards": tables, "arena": arena_views,
            "bt_charts": {e: bt_chart(rows) for e, rows in tables.items()},
            "hist_chart": hist_chart, "ckpt_chart": ckpt_chart,
            "heatmap": charts.heatmap([{"a": r["model_a"], "b": r["model_b"], "w": r["win_rate_a"], "games": r["games"]}
                                       for r in h2h], overall, "win rate (draws half)"),
            "curves": curves, "curve_rows": _newest(curves), "curve_charts": curve_charts(curves), "per_env": per_env,
            "learner": learner, "samples": samples, "checkpoints": ckpts,
            "timeline": _newest(busy), "timeline_charts": timeline_charts(busy), "table_rounds": TABLE_ROUNDS,
            "engine": engine[0] if engine else None, "strength": strength_view(curves, probes, pool_rounds)}


def strength_view(curves: list[dict], probes: dict, k: int) -> dict[str, Any]:
    """The latest k rounds' eval figures pooled (learner and baseline agents), the probes pooled over
    them, and each probe's curve per player (strength.py)."""
    window = strength.pool_window(curves, max((r["round"] for r in curves), default=-1), k)
    rounds = sorted({r for r, *_ in probes})
    per_round = {r: strength.probe_rows(probes, [r]) for r in rounds}
    players = list(dict.fromkeys((p["split"], p["player"]) for rows in per_round.values() for p in rows))
    charts_ = {}
    for probe in strength.PROBES:
        series = {f"{sp} {pl}": [(r, p) for r in rounds for p in per_round[r]
                                 if (p["split"], p["player"], p["probe"]) == (sp, pl, probe)] for sp, pl in players}
        series = {n: pts for n, pts in series.items() if pts}
        if series:
            charts_[f"{probe} rate per round (Wilson 95% CI)"] = charts.line(
                {n: [(r, p["rate"]) for r, p in pts] for n, pts in series.items()}, "round", "rate", y_range=(0, 1),
                bands={n: [(r, p["low"], p["high"]) for r, p in pts] for n, pts in series.items()})
    return {"span": strength.span(window) if window else None, "pooled": strength.pooled(curves, window) if window else [],
            "probes": strength.probe_rows(probes, window), "charts": charts_, "probe_text": strength.PROBE_TEXT}


def _newest(rows: list[dict]) -> list[dict]:
    """The rows of the newest TABLE_ROUNDS rounds (rows in round order)."""
    keep = sorted({r["round"] for r in rows})[-TABLE_ROUNDS:]
    return [r for r in rows if keep and r["round"] >= keep[0]]


def bt_chart(board: list[dict]) -> Optional[dict]:
    """Bradley-Terry scores with their bootstrap 95% CIs, as interval bars in leaderboard order."""
    return charts.intervals([{"model": r["model_uid"], "score": r["bt_score"], "low": r["bt_ci_low"], "high": r["bt_ci_high"]}
                             for r in board], "BT score")


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
    # round.eval_baseline: each agent on the same eval games (legal-random: the bar a learning claim must clear)
    agents = list(dict.fromkeys(r["player"] for r in curves if r["split"] == "baseline"))
    base = {(a, o): [r for r in curves if r["split"] == "baseline" and r["player"] == a and r["opponent"] == o]
            for a in agents for o in opponents}
    rated = [r for r in every["eval"] or every["train"] if r["mu"] is not None]
    wins = {vs_name(o): pts(rows, "win_rate") for o, rows in vs.items()} | \
        {f"{a} {vs_name(o)}": pts(rows, "win_rate") for (a, o), rows in base.items() if rows}
    win_ci = {vs_name(o): ci(rows, "win_rate") for o, rows in vs.items()} | \
        {f"{a} {vs_name(o)}": ci(rows, "win_rate") for (a, o), rows in base.items() if rows}
    # Against minimax a perfect learner draws every game, so its win rate (draws half) stays at 0.5.
    # A baseline expert's draws there are the ceiling (minimax replaying the games draws them all).
    named = {vs_name(o): rows for o, rows in vs.items()} | {f"{a} {vs_name(o)}": rows for (a, o), rows in base.items()}
    draws = {n: [(r["round"], r["draws"] / (r["wins"] + r["draws"] + r["losses"])) for r in rows]
             for n, rows in named.items() if any(r["draws"] for r in rows)}
    return {
        "Eval win rate against each fixed opponent (draws half), Wilson 95% CI":
            charts.line(wins, "round", "win rate", bands=win_ci, y_range=(0, 1)),
        **({"Eval draw rate against each fixed opponent (opponents with a draw)":
            charts.line(draws, "round", "draw rate", y_range=(0, 1))} if draws else {}),
        "Invalid-move rate of the learner's turns, Wilson 95% CI":
            charts.line({sp: pts(rows, "invalid_rate") for sp, rows in every.items()}, "round", "invalid-move rate",
                        bands={sp: ci(rows, "invalid_rate") for sp, rows in every.items()}, y_range=(0, 1)),
        "Format success (a \\boxed{} answer) of the learner's turns":
            charts.line({sp: pts(rows, "format_success") for sp, rows in every.items()}, "round", "format success", y_range=(0, 1)),
        "Mean completion length of the learner's turns (tokens)":
            charts.line({sp: pts(rows, "mean_completion_tokens") for sp, rows in every.items()}, "round", "tokens"),
        "TrueSkill of the checkpoint that played the round (mu ± 3 sigma; conservative = mu − 3 sigma)":
            charts.line({"mu": [(r["round"], r["mu"]) for r in rated], "conservative": [(r["round"], r["conservative"]) for r in rated]},
                        "round", "TrueSkill", band="mu ± 3 sigma",
                        bands={"mu": [(r["round"], r["mu"] - 3 * r["sigma"], r["mu"] + 3 * r["sigma"]) for r in rated]}),
    }


def vs_name(opponent: str) -> str:
    """A curve's name for the opponent column of CURVES_SQL."""
    return "single-player" if opponent == "solo" else f"vs {opponent}"


def timeline_charts(busy: list[dict]) -> dict[str, Optional[dict]]:
    """Where the hardware waits (timeline rows), per round: each worker's busy share, and the seconds
    of the round, of the learner inside it and of the gap after it."""
    workers = sorted({w for t in busy for w in t["workers"]})
    return {
        "Busy share of each worker's round (the union of its games over the round's wall time)":
            charts.line({w: [(t["round"], t["workers"][w]) for t in busy if w in t["workers"]] for w in workers},
                        "round", "busy share", y_range=(0, 1)),
        "Seconds per round: its wall time, the learner's busy time inside it, the gap after it and the learner's time there":
            charts.line({"round wall": [(t["round"], t["wall_s"]) for t in busy],
                         "learner in round": [(t["round"], t["learner_in_round_s"]) for t in busy],
                         "gap": [(t["round"], t["gap_s"]) for t in busy],
                         "learner in gap": [(t["round"], t["learner_in_gap_s"]) for t in busy]}, "round", "seconds"),
    }


# learner_steps columns that number or seed an update: counters and hashes, not curves.
NOT_CURVES = {"iteration", "run", "step", "update", "batch_seed"}


def learner_columns(con) -> dict[str, str]:
    """The learner_steps curves (also what `trackers` mirrors), {name: SQL expression}: the numeric
    columns, then every name of the algorithms' `metrics` maps (lakes written before the map hold
    those as columns: the first part finds them there)."""
    schema = con.sql("SELECT * FROM learner_steps LIMIT 0").to_arrow_table().schema
    out = {f.name: quote_ident(f.name) for f in schema if f.name not in NOT_CURVES
           and (pa.types.is_integer(f.type) or pa.types.is_floating(f.type))}
    keys = con.sql("SELECT DISTINCT unnest(map_keys(metrics)) AS k FROM learner_steps ORDER BY k").fetchall()
    return out | {k: f"metrics[{sql_str(k)}]" for (k,) in keys if k not in out}


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _learner(con, run_name: str) -> Optional[dict]:
    """Small multiples of the numeric learner_steps columns, averaged per iteration."""
    cols = learner_columns(con)
    if not cols:
        return None
    # Names come from the lake's own schema and maps, quoted; values stay parameters.
    avgs = ", ".join(f"avg({expr}) AS {quote_ident(c)}" for c, expr in cols.items())
    rows = pages.rows(con, f"SELECT iteration, {avgs} FROM learner_steps WHERE run = ? GROUP BY iteration ORDER BY iteration", [run_name])
    drawn = [c for c in cols if any(r[c] is not None and math.isfinite(r[c]) for r in rows)]
    return charts.facets(rows, "iteration", drawn)


def _samples(con, run_name: str, newest: list[str], best: list[str]) -> list[dict]:
    """A few games (first by round, game_id) of the newest learner checkpoints and the best-rated
    learner models, SAMPLE_MODELS in all, with their turns."""
    learners = {r["model_uid"] for r in pages.rows(con, "SELECT DISTINCT model_uid FROM turns WHERE run = ? AND is_learner", [run_name])}
    models = [m for m in dict.fromkeys([*reversed(newest), *best]) if m in learners][:SAMPLE_MODELS]
    out = []
    for m in models:
        games = pages.rows(con, """SELECT game_id, round, env_id, split, seats FROM games WHERE run = ? AND game_id IN
                                  (SELECT game_id FROM turns WHERE run = ? AND model_uid = ? AND is_learner)
                              ORDER BY round, game_id LIMIT ?""", [run_name, run_name, m, SAMPLES_PER_MODEL])
        by_game = pages.turns(con, run_name, [g["game_id"] for g in games])
        for g in games:
            g["turns"] = by_game[g["game_id"]]
        out.append({"model": m, "games": games})
    return out


def report(job: Job) -> Path:
    """Write reports/<run>/index.html for job.run.name, the job's league's pages when the lake has
    its ratings (reports/<league>/), and refresh reports/index.html; return the run's page."""
    lake, root, run_name = Lake(job.run.lake), Path(job.run.reports), job.run.name
    env = pages.env()
    page = root / run_name / "index.html"
    pages.write(page, env.get_template("run.html.j2").render(**gather(lake, run_name, job.round.pool_rounds)))
    con = lake.connect()
    try:
        rated = set(league.leagues(con))
    finally:
        con.close()
    if job.league_name in rated:
        league.write(lake, job.league_name, root)
    names = [p.parent.name for p in sorted(root.glob("*/index.html"))]
    pages.write(root / "index.html", env.get_template("index.html.j2").render(
        **runs_index(lake, [n for n in names if n not in rated]), leagues=[n for n in names if n in rated]))
    return page


def runs_index(lake: Lake, names: list[str]) -> dict[str, Any]:
    """The index page: per run its rounds, games, best model and best checkpoint in any league of
    the lake, and the runs' eval curves overlaid."""
    con = lake.connect()
    try:
        runs = pages.rows(con, """
            WITH r AS (SELECT run, count(DISTINCT round) AS rounds, coalesce(sum(games), 0) AS games FROM rounds GROUP BY run),
            t AS (SELECT run, model_uid AS top, conservative AS top_conservative FROM ratings WHERE env_id = '*'
                  QUALIFY row_number() OVER (PARTITION BY run ORDER BY conservative DESC, model_uid) = 1),
            l AS (SELECT source_run AS run, run AS league, checkpoint AS league_best, rating AS league_rating,
                         rating_low AS league_low, rating_high AS league_high FROM league_ratings WHERE kind = 'checkpoint'
                  QUALIFY row_number() OVER (PARTITION BY source_run ORDER BY rating DESC, run, checkpoint) = 1)
            SELECT n.run AS name, coalesce(r.rounds, 0) AS rounds, coalesce(r.games, 0) AS games, t.top, t.top_conservative,
                   l.league, l.league_best, l.league_rating, l.league_low, l.league_high
            FROM unnest(?::VARCHAR[]) n(run) LEFT JOIN r USING (run) LEFT JOIN t USING (run) LEFT JOIN l USING (run)
            ORDER BY n.run""", [names])
        evals = pages.rows(con, f"""SELECT run, round, opponent, win_rate, win_rate_low, win_rate_high FROM ({CURVES_SQL})
                               WHERE split = 'eval' AND opponent NOT IN ('*', 'self') AND list_contains(?, run)
                               ORDER BY run, opponent, round""", [names])
    finally:
        con.close()
    series = {(e["run"], e["opponent"]): f"{e['run']} {vs_name(e['opponent'])}" for e in evals}
    chart = charts.line({s: [(e["round"], e["win_rate"]) for e in evals if (e["run"], e["opponent"]) == k] for k, s in series.items()},
                        "round", "eval win rate", y_range=(0, 1), width=640,
                        bands={s: [(e["round"], e["win_rate_low"], e["win_rate_high"]) for e in evals
                                   if (e["run"], e["opponent"]) == k] for k, s in series.items()})
    return {"runs": runs, "compare": chart}
