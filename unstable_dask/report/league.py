"""A league's pages: reports/<league>/index.html (the leaderboard with interval bars, the pairwise
score matrix, strength against training iteration with a line per run, and every pair's games)
and reports/<league>/games/<pair>.html (the transcripts of one pair's games, both seat orders of
each deal side by side), from the league's tables (league_ratings, league_pairs) and its games
(split `league` under the league's run). The pair pages carry no script.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

from unstable_dask.lake import Lake
from unstable_dask.report import charts, pages

MAX_MAP = 40  # entrants in the score matrix, by rank (a reader cannot see more cells)


def leagues(con) -> list[str]:
    """The leagues rated in the lake."""
    return [r["run"] for r in pages.rows(con, "SELECT DISTINCT run FROM league_ratings ORDER BY run", [])]


def pair_file(a: str, b: str) -> str:
    """The page of the games between entrants a and b (either order), relative to the league's page.
    Named by a digest: entrant uids hold ':' and '/' (adapter folders)."""
    key = "\0".join(sorted((a, b))).encode("utf-8")
    return f"games/{hashlib.sha256(key).hexdigest()[:16]}.html"


def strength_curves(board: list[dict]) -> Optional[dict]:
    """Rating against training iteration, one line per run: its checkpoints, from its base model
    (an entrant at iteration 0) when the league has it, with the rating intervals as bands."""
    runs = list(dict.fromkeys(r["source_run"] for r in board if r["kind"] == "checkpoint"))
    base = {r["base_model"]: r for r in board if r["kind"] == "base"}
    series: dict[str, list[tuple[float, float]]] = {}
    bands: dict[str, list[tuple[float, float, float]]] = {}
    for run in runs:
        mine = sorted((r for r in board if r["kind"] == "checkpoint" and r["source_run"] == run), key=lambda r: r["iteration"])
        start = base.get(mine[0]["base_model"])
        if start is not None and mine[0]["iteration"] > 0:
            mine = [{**start, "iteration": 0}, *mine]
        series[run] = [(r["iteration"], r["rating"]) for r in mine]
        bands[run] = [(r["iteration"], r["rating_low"], r["rating_high"]) for r in mine if r["rating_low"] is not None]
    return charts.line(series, "training iteration", "league rating", bands=bands, band="interval", width=560, height=260)


def gather(lake: Lake, league: str) -> dict[str, Any]:
    """Everything the league page and its pair pages show."""
    con = lake.connect()
    try:
        board = pages.rows(con, "SELECT * EXCLUDE (run) FROM league_ratings WHERE run = ? ORDER BY rank, entrant", [league])
        pairs = pages.rows(con, "SELECT * EXCLUDE (run) FROM league_pairs WHERE run = ? AND games > 0 "
                                "ORDER BY entrant, opponent", [league])
        games = pages.rows(con, "SELECT game_id, round, env_id, split, seed, group_id, seats FROM games "
                                "WHERE run = ? AND split = 'league' ORDER BY group_id, game_id", [league])
        by_game = pages.turns(con, league, [g["game_id"] for g in games])
    finally:
        con.close()
    rank = {r["entrant"]: k for k, r in enumerate(board)}
    mapped = [r["entrant"] for r in board][:MAX_MAP]
    anchor = next((r for r in board if r["anchor"]), None)
    scale = f"{anchor['entrant']} = {anchor['rating']:g}" if anchor else "BT's own scale, mean 1000: no anchor yet"
    matches: dict[tuple[str, str], list[dict]] = {}
    for g in games:
        g["turns"] = by_game[g["game_id"]]
        sides = sorted({s["model_uid"] for s in g["seats"]}, key=lambda m: (rank.get(m, len(rank)), m))
        if len(sides) == 2:
            matches.setdefault((sides[0], sides[1]), []).append(g)
    listed = [p | {"href": pair_file(p["entrant"], p["opponent"])} for p in pairs
              if rank.get(p["entrant"], 0) < rank.get(p["opponent"], 0)]
    return {
        "league": league, "board": board, "scale": scale, "pairs": listed, "matches": matches,
        "separated": sum(1 for r in board if r["separated"]), "adjacent": max(len(board) - 1, 0),
        "passes": max((r["passes"] or 0 for r in board), default=0), "games": len(games),
        "bars": charts.intervals([{"model": r["entrant"], "score": r["rating"], "low": r["rating_low"],
                                   "high": r["rating_high"]} for r in board], f"rating ({scale})",
                                 low="interval low", high="interval high"),
        "matrix": charts.heatmap([{"a": p["entrant"], "b": p["opponent"], "w": p["score"], "games": p["games"]}
                                  for p in pairs], mapped, "score (draws half)"),
        "map_omitted": max(len(board) - MAX_MAP, 0), "strength": strength_curves(board),
    }


def write(lake: Lake, league: str, root: Path) -> Path:
    """Write reports/<league>/index.html and its pair pages; return the league page."""
    data = gather(lake, league)
    env = pages.env()
    page = root / league / "index.html"
    for (a, b), games in data["matches"].items():
        pages.write(page.parent / pair_file(a, b), env.get_template("pair.html.j2").render(league=league, a=a, b=b, games=games))
    pages.write(page, env.get_template("league.html.j2").render(**data))
    return page
