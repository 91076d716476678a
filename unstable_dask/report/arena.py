"""Chatbot-Arena views of a run's leaderboard: average win rate, battle-count and win-fraction
matrices, games per pair, and each env's rank change against the overall leaderboard.

Definitions follow FastChat's Arena monitor (fastchat/serve/monitor/elo_analysis.py,
`report_elo_analysis_results`): the win-fraction matrix, the battle-count matrix and the average
win rate are computed on decisive games only (its `battles_no_ties`): win fraction of row A
against column B = A's wins / (A's wins + B's wins), a draw counting for neither; the battle count
is A's wins + B's wins; A's average win rate is the unweighted mean of its row over the opponents
it has at least one decisive game with (pandas' mean skips the empty cells). Bradley-Terry keeps
counting a draw as half a win for each side, as Arena's BT does. The games-per-pair table adds
the draws back.

The pair counts are the rate job's `head_to_head` table (one fact in one place): mirror self-play
is not in it, an N-player game counts once for each pair of distinct models in it (a model holding
several seats is one team, its reward their mean), single-player games have no pair, and eval
games are in it unless `[ratings] include_eval = false`. Everything here is SQL over the lake;
model names stay parameters and data.
"""
from __future__ import annotations

from typing import Any, Optional

# One row per ordered pair (A, B) and env ('*' = all envs), both orders present.
PAIRS_SQL = """
SELECT env_id, model_a, model_b, games, wins_a, draws, games - wins_a - draws AS wins_b,
       games - draws AS battles,
       CASE WHEN games > draws THEN wins_a / (games - draws) END AS win_fraction
FROM head_to_head WHERE run = $run"""

# The ratings table plus the Arena columns: average win rate over opponents (decisive games),
# their number, and for env boards rank_change = overall rank - env rank (> 0: ranks higher here).
LEADERBOARD_SQL = f"""
WITH pairs AS ({PAIRS_SQL}),
avg_ AS (SELECT env_id, model_a AS model_uid, avg(win_fraction) AS avg_win_rate,
                count(win_fraction) AS opponents FROM pairs GROUP BY ALL)
SELECT r.* EXCLUDE (run), a.avg_win_rate, coalesce(a.opponents, 0) AS opponents,
       CASE WHEN r.env_id <> '*' THEN o.rank - r.rank END AS rank_change
FROM ratings r
LEFT JOIN avg_ a USING (env_id, model_uid)
LEFT JOIN ratings o ON o.run = r.run AND o.env_id = '*' AND o.model_uid = r.model_uid
WHERE r.run = $run
ORDER BY r.env_id, r.conservative DESC, r.model_uid"""

# What a page shows of a leaderboard, its matrices and maps: the TOP_K best models by conservative
# rating and the run's NEWEST newest checkpoints, so a page stays small as a run grows (a 200-round
# run has 200 checkpoints); the lake keeps every row, and each table's note gives the query.
TOP_K = 10
NEWEST = 5


def _rows(con, sql: str, run_name: str) -> list[dict]:
    return con.sql(sql, params={"run": run_name}).to_arrow_table().to_pylist()


def leaderboard_rows(con, run_name: str) -> list[dict]:
    """LEADERBOARD_SQL rows of one run."""
    return _rows(con, LEADERBOARD_SQL, run_name)


def pair_rows(con, run_name: str) -> list[dict]:
    """PAIRS_SQL rows of one run, by env, A, B."""
    return _rows(con, f"SELECT * FROM ({PAIRS_SQL}) ORDER BY env_id, model_a, model_b", run_name)


def rdbu(w: float) -> str:
    """0 red .. 0.5 white .. 1 blue (the colour scale of the head-to-head map and the Arena monitor)."""
    red, blue = int(255 * min(1, 2 * (1 - w))), int(255 * min(1, 2 * w))
    return f"rgb({red},{min(red, blue)},{blue})"


def _blues(n: int, most: int) -> str:
    shade = int(255 - 175 * n / most) if most else 255
    return f"rgb({shade},{min(255, shade + 20)},255)"


def shown(board: list[dict], newest: list[str]) -> list[str]:
    """The models a page shows of one leaderboard (rows best first): its TOP_K first and the
    `newest` checkpoints on it, in board order."""
    keep = {r["model_uid"] for r in board[:TOP_K]} | set(newest)
    return [r["model_uid"] for r in board if r["model_uid"] in keep]


def matrices(board: list[dict], pairs: list[dict], models: list[str]) -> Optional[dict[str, Any]]:
    """The win-fraction and battle-count matrices of one env between `models`, by BT score.

    board: that env's leaderboard rows; pairs: that env's PAIRS_SQL rows.
    """
    keep = set(models)
    rated = sorted((r for r in board if r["bt_score"] is not None), key=lambda r: (-r["bt_score"], r["model_uid"]))
    models = [r["model_uid"] for r in rated if r["model_uid"] in keep]
    if len(models) < 2:
        return None
    cell = {(p["model_a"], p["model_b"]): p for p in pairs}
    most = max((p["battles"] for p in pairs), default=0)
    rows = []
    for a in models:
        cells = []
        for b in models:
            p = cell.get((a, b))
            w = None if p is None else p["win_fraction"]
            n = 0 if p is None else p["battles"]
            cells.append({"b": b, "diagonal": a == b, "win_fraction": w, "battles": n,
                          "games": 0 if p is None else p["games"], "draws": 0 if p is None else p["draws"],
                          "win_color": None if w is None else rdbu(w), "count_color": _blues(n, most),
                          "dark": w is not None and abs(w - 0.5) > 0.35})  # white text on the deep colours
        rows.append({"model": a, "cells": cells})
    return {"models": models, "rows": rows, "omitted": len(rated) - len(models)}


def games_per_pair(pairs: list[dict]) -> list[dict]:
    """One row per unordered pair (A < B) of one env: games, A's wins, draws, B's wins, A's win fraction."""
    return [p for p in pairs if p["model_a"] < p["model_b"]]


def views(con, run_name: str, newest: list[str]) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """The leaderboards per env ('*' first) with the Arena columns, and per env the models shown
    (`shown`, with `newest` the run's newest checkpoints), their matrices and pairs, and how many
    models and pairs are left out."""
    board_rows, pairs = leaderboard_rows(con, run_name), pair_rows(con, run_name)
    envs = sorted({r["env_id"] for r in board_rows}, key=lambda e: (e != "*", e))
    boards = {e: [r for r in board_rows if r["env_id"] == e] for e in envs}
    arena = {}
    for e in envs:
        models = shown(boards[e], newest)
        keep = set(models)
        every = games_per_pair([p for p in pairs if p["env_id"] == e])
        mine = [p for p in pairs if p["env_id"] == e and p["model_a"] in keep and p["model_b"] in keep]
        arena[e] = {"shown": models, "omitted": len(boards[e]) - len(models), "matrix": matrices(boards[e], mine, models),
                    "pairs": games_per_pair(mine), "pairs_omitted": len(every) - len(games_per_pair(mine))}
    return boards, arena
