"""A real league's verdict on a learning run, read from the lake: does the rating rise with training?

For a league job (e.g. jobs/league-smollm2.toml, after `run league`), its latest ratings: per
entrant the anchored Bradley-Terry rating with its bootstrap interval; for the run's curve (the
base model at iteration 0, then each checkpoint at its learner iteration) the Spearman rank
correlation between iteration and rating, and how many consecutive points of the curve are
separated by their intervals (the later one's interval entirely above or below the earlier
one's). Also the league's cost: games played. Writes bench/results/<name>.json and <name>.svg.

    python bench/bench_league_run.py --job jobs/league-smollm2.toml [--set KEY=VALUE ...] [--name league_run]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

from common import RESULTS, row, save  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="job overrides, as `run --set`")
    ap.add_argument("--name", default="league_run")
    args = ap.parse_args()

    from scipy.stats import spearmanr

    from unstable_dask.cli import parse_set
    from unstable_dask.jobfile import load_job
    from unstable_dask.lake import Lake
    from unstable_dask.report import charts
    job = load_job(args.job, parse_set(args.set))
    assert job.league is not None, f"{args.job} has no [league]"
    league = job.league_name
    rows = Lake(job.run.lake).sql("""SELECT * FROM league_ratings WHERE run = ?
        AND passes = (SELECT max(passes) FROM league_ratings WHERE run = ?) ORDER BY rank""",
                                  params=[league, league]).to_pylist()
    if not rows:
        raise SystemExit(f"no ratings of league {league!r} in {job.run.lake}: run `run league --job {args.job}` first")
    curve = sorted((r for r in rows if (r["kind"] == "checkpoint" and r["source_run"] == job.run.name)
                    or (r["kind"] == "base" and r["base_model"] is not None)), key=lambda r: r["iteration"])
    rho = (float(spearmanr([r["iteration"] for r in curve], [r["rating"] for r in curve]).statistic)
           if len(curve) > 1 else None)
    apart = sum(1 for a, b in zip(curve, curve[1:]) if None not in (a["rating_low"], b["rating_low"])
                and (b["rating_low"] > a["rating_high"] or b["rating_high"] < a["rating_low"]))
    games = Lake(job.run.lake).sql("SELECT count(*) AS n FROM games WHERE run = ?", params=[league]).to_pylist()[0]["n"]
    out = {"job": args.job, "overrides": args.set, "league": league, "passes": rows[0]["passes"], "games": games,
           "entrants": [{k: r[k] for k in ("entrant", "kind", "iteration", "rating", "rating_low", "rating_high",
                                           "games", "wins", "draws", "losses", "rank", "separated")} for r in rows],
           "curve_spearman": rho, "curve_points": len(curve), "curve_adjacent_separated": apart}
    chart = charts.line(
        {"rating": [(r["iteration"], r["rating"]) for r in curve]}, "learner iteration (0: the base model)",
        "league rating (Elo scale, random = anchor)", width=480, height=260,
        bands={"rating": [(r["iteration"], r["rating_low"], r["rating_high"]) for r in curve
                          if r["rating_low"] is not None]})
    if chart is not None:
        (RESULTS / f"{args.name}.svg").write_text(charts.svg(chart, f"League {league}: rating vs iteration"),
                                                  encoding="utf-8")
        out["plot"] = f"{args.name}.svg"
    path = save(args.name, out)
    print(row("rank", "entrant", "iteration", "rating [interval]", "games (W-D-L)"))
    print(row(*["---"] * 5))
    for r in rows:
        ci = f" [{r['rating_low']:.0f}, {r['rating_high']:.0f}]" if r["rating_low"] is not None else ""
        print(row(r["rank"], r["entrant"], "" if r["iteration"] is None else r["iteration"], f"{r['rating']:.0f}{ci}",
                  f"{r['games']} ({r['wins']}-{r['draws']}-{r['losses']})"))
    print(f"Spearman(iteration, rating) over {len(curve)} points: {rho if rho is None else round(rho, 3)}; "
          f"{apart} of {max(len(curve) - 1, 0)} consecutive points separated; {games} games; -> {path}")


if __name__ == "__main__":
    main()
