"""Where the hardware waits: per round, how busy each worker and the learner were, from the lake's
own timestamps (games.started_at/finished_at per worker, learner_steps.created_at - step_time_s).

A round's window is rounds.started_at .. committed_at; the gap after it runs to the next round's
start (in a lock-step loop the learner trains there and the workers wait; in an overlapped loop,
learn.max_staleness > 0, the learner's updates fall inside the rounds). Busy time is the union of
intervals, so a worker playing 16 games at once for 10 s is busy 10 s, not 160.
"""
from __future__ import annotations

Interval = tuple[float, float]


def union_seconds(intervals: list[Interval], lo: float, hi: float) -> float:
    """Length of the union of `intervals` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= end or b <= a:  # empty after clipping, or inside what is counted already
            continue
        total += b - max(a, end)
        end = b
    return total


def _seconds(column: str) -> str:
    """A TIMESTAMPTZ column as seconds since the epoch, computed by DuckDB: fetching the timestamp
    itself into Python needs pytz under duckdb < 2.0.1, which pandas 3 no longer brings along."""
    return f"epoch_us({column}) / 1e6"


def timeline(con, run_name: str) -> list[dict]:
    """One row per committed round: wall_s, each worker's busy share of the round (workers, sorted
    by name), the learner's busy seconds inside the round and in the gap before the next round."""
    rounds = con.sql(f"SELECT round, {_seconds('started_at')}, {_seconds('committed_at')} FROM rounds WHERE run = ? "
                     "ORDER BY round", params=[run_name]).fetchall()
    games: dict[int, dict[str, list[Interval]]] = {}
    for r, worker, a, b in con.sql(f"SELECT round, worker, {_seconds('started_at')}, {_seconds('finished_at')} "
                                   "FROM games WHERE run = ?", params=[run_name]).fetchall():
        if a is not None and b is not None:
            games.setdefault(r, {}).setdefault(worker or "?", []).append((a, b))
    learner = [(t - (s or 0.0), t) for t, s in con.sql(
        f"SELECT {_seconds('created_at')}, step_time_s FROM learner_steps WHERE run = ?",
        params=[run_name]).fetchall() if t is not None]
    out = []
    for i, (r, start, end) in enumerate(rounds):
        if start is None or end is None or end <= start:
            continue
        wall = end - start
        nxt = rounds[i + 1][1] if i + 1 < len(rounds) else None
        gap = (nxt - end) if nxt is not None and nxt > end else 0.0
        workers = {w: union_seconds(iv, start, end) / wall for w, iv in sorted(games.get(r, {}).items())}
        out.append(dict(round=r, wall_s=wall, workers=workers,
                        worker_busy_mean=sum(workers.values()) / len(workers) if workers else 0.0,
                        learner_in_round_s=union_seconds(learner, start, end),
                        gap_s=gap, learner_in_gap_s=union_seconds(learner, end, end + gap)))
    return out
