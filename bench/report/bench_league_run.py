"""A real league's verdict on a learning run, read from the lake: does the rating rise with training?

For a league job (e.g. jobs/league-smollm2.toml, after `run league`), its latest ratings: per
entrant the anchored Bradley-Terry rating with its bootstrap interval; for each run whose
checkpoints entered (one line each in the plot, so two runs compare on one scale), its curve (the
base model at iteration 0, then each checkpoint at its learner iteration): the Spearman rank
correlation between iteration and rating, how many consecutive points of the curve are separated
by their intervals (the later one's interval entirely above or below the earlier one's), and
whether the last checkpoint's interval lies above the base model's. Also the league's cost: games
played. Writes bench/results/<name>.json and <name>.svg.

    python bench/report/bench_league_run.py --job jobs/league-smollm2.toml [--set KEY=VALUE ...] [--name league_run]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/rate/", "unstable_dask/play/", "unstable_dask/inference/", "unstable_dask/lake/"]  # what bench/stale.py checks for changes since a result's commit


from common import RESULTS, row, save  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="job overrides, as `run --set`")
    ap.add_argument("--name", default="league_run")
    args = ap.parse_args()

    from unstable_dask.cli import parse_set
    from unstable_dask.jobfile import load_job
    from unstable_dask.lake import Lake
    from unstable_dask.report import charts
    job = load_job(args.job, parse_set(args.set))
    assert job.league is not None, f"{args.job} has no [league]"
    league = job.league_name
    rows, curves = league_curves(Lake(job.run.lake), league, first=job.run.name)
    if not rows:
        raise SystemExit(f"no ratings of league {league!r} in {job.run.lake}: run `run league --job {args.job}` first")
    games = Lake(job.run.lake).sql("SELECT count(*) AS n FROM games WHERE run = ?", params=[league]).to_pylist()[0]["n"]
    own = curves[job.run.name]
    out = {"job": args.job, "overrides": args.set, "league": league, "passes": rows[0]["passes"], "games": games,
           "entrants": [{k: r[k] for k in ("entrant", "kind", "source_run", "iteration", "rating", "rating_low",
                                           "rating_high", "games", "wins", "draws", "losses", "rank", "separated")}
                        for r in rows],
           "curve_spearman": own["spearman"], "curve_points": own["points"],
           "curve_adjacent_separated": own["adjacent_separated"],
           "curves": {name: {k: v for k, v in c.items() if k != "rows"} for name, c in curves.items()}}
    chart = charts.line(
        {name: [(r["iteration"], r["rating"]) for r in c["rows"]] for name, c in curves.items()},
        "learner iteration (0: the base model)", "league rating (Elo scale, random = anchor)", width=480, height=260,
        bands={name: [(r["iteration"], r["rating_low"], r["rating_high"]) for r in c["rows"] if r["rating_low"] is not None]
               for name, c in curves.items()})
    if chart is not None:
        (RESULTS / f"{args.name}.svg").write_text(charts.svg(chart, f"League {league}: rating vs iteration"),
                                                  encoding="utf-8")
        out["plot"] = f"{args.name}.svg"
    path = save(args.name, out, settings=vars(args))
    print(row("rank", "entrant", "iteration", "rating [interval]", "games (W-D-L)"))
    print(row(*["---"] * 5))
    for r in rows:
        ci = f" [{r['rating_low']:.0f}, {r['rating_high']:.0f}]" if r["rating_low"] is not None else ""
        print(row(r["rank"], r["entrant"], "" if r["iteration"] is None else r["iteration"], f"{r['rating']:.0f}{ci}",
                  f"{r['games']} ({r['wins']}-{r['draws']}-{r['losses']})"))
    for name, c in curves.items():
        rho = c["spearman"]
        print(f"{name}: Spearman(iteration, rating) over {c['points']} points: {rho if rho is None else round(rho, 3)}; "
              f"{c['adjacent_separated']} of {max(c['points'] - 1, 0)} consecutive points separated; last "
              f"checkpoint's interval above the base model's: {c['last_above_base']}")
    print(f"{games} games -> {path}")


def league_curves(lake, league: str, first: str = "") -> tuple[list[dict], dict[str, dict]]:
    """A league's latest ratings (best first) and, per run whose checkpoints entered and run `first`
    (first, even with no checkpoint in the league), its curve (`_curve`: the base model at
    iteration 0, then each checkpoint)."""
    rows = lake.sql("""SELECT * FROM league_ratings WHERE run = ?
        AND passes = (SELECT max(passes) FROM league_ratings WHERE run = ?) ORDER BY rank""",
                    params=[league, league]).to_pylist()
    base = [r for r in rows if r["kind"] == "base" and r["base_model"] is not None]
    runs = sorted({r["source_run"] for r in rows if r["kind"] == "checkpoint"} | ({first} if first and rows else set()),
                  key=lambda n: (n != first, n))
    return rows, {name: _curve(sorted([r for r in rows if r["kind"] == "checkpoint" and r["source_run"] == name] + base,
                                      key=lambda r: r["iteration"])) for name in runs}


def _curve(points: list[dict]) -> dict:
    """A run's strength curve (the base model at iteration 0, then its checkpoints): Spearman correlation of
    iteration and rating, consecutive points whose intervals are apart, and whether the last checkpoint's
    interval lies entirely above the base model's."""
    from scipy.stats import spearmanr
    rho = (float(spearmanr([r["iteration"] for r in points], [r["rating"] for r in points]).statistic)
           if len(points) > 1 else None)
    apart = sum(1 for a, b in zip(points, points[1:]) if None not in (a["rating_low"], b["rating_low"])
                and (b["rating_low"] > a["rating_high"] or b["rating_high"] < a["rating_low"]))
    keys = ("entrant", "rating", "rating_low", "rating_high")
    last = {k: points[-1][k] for k in keys} if points else None
    base = {k: points[0][k] for k in keys} if points and points[0]["iteration"] == 0 else None
    above = (None if len(points) < 2 or base is None or last is None or None in (base["rating_high"], last["rating_low"])
             else bool(last["rating_low"] > base["rating_high"]))
    return {"rows": points, "points": len(points), "spearman": rho, "adjacent_separated": apart,
            "last_above_base": above, "last": last, "base": base}


if __name__ == "__main__":
    main()
