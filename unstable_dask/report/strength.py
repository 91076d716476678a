"""Strength you can see: per-state probes of the eval decisions, and eval figures pooled over rounds.

Probes count, over the subject's turns of the eval games (the learner's seats) and of each
round.eval_baseline agent's replays of them (its seats), how often it made the move a strong player
makes in a state where that move is plain (read from the turn's observation and action), and one
tell of a policy that does not look at the board:

  take-a-win    TicTacToe: the mover had a cell that completes its line, and took one
  forced-block  TicTacToe: no such cell, the opponent had exactly one, and the mover took it
  optimal       TicTacToe, a decision where some move would give away game value under best play
                (not the empty board, where every cell draws): the move kept it, one of minimax's
                optimal moves (play/experts.py). The whole game in one rate: against the random agent
                minimax scores 0.94, and a policy that gives value away less often loses less
  first-free    TicTacToe, any decision with two or more empty cells: it took the lowest-numbered
                one. Not a strong move but a tell: a fixed fill order beats the random agent
                (0.63, play/yardsticks.py) without looking at the board, and a learner near 1.0
                here has learned that order, not the game
  bet-with-K    Kuhn Poker: holding the K with [bet] legal, it bet. A tell of kuhn-best more than a
                measure: with the K a check wins every hand as surely as a bet
  bet-with-J-or-Q  Kuhn Poker: holding the J or Q with [bet] legal, it bet. Where a bet pays under
                TextArena's rules (the pot stays at the antes): against the random agent it wins
                1/2 of the J's hands against a check's 0, 3/4 of the Q's against 1/2
  fold-with-J   Kuhn Poker: holding the J facing a bet ([fold] legal), it folded

Each turn row is a decision, invalid attempts included (an unreadable move took nothing); a state
shown twice (a resubmission) counts twice. The minimax agent scores 1 on optimal (by definition)
and below 1 on take-a-win and forced-block: it draws uniformly among moves of equal game value, so
it may win later instead of now, and in a lost position it need not block. Under TextArena's Kuhn
rules the best reply bets whenever it may and never folds (play/experts.py: kuhn-best scores 1, 1
and 0).

The same probes over the learner's train decisions, with its seat's game reward after making the
probed move and after not (train_probe_rewards), show what the updates were fed: whether the move
paid in those games, and whether it was sampled at all.

Pooled figures add up the eval rows of round_curves (report.py) over the latest round.pool_rounds
rounds: one Wilson 95% interval over all their seats, for the learner and for each baseline agent
on the same rounds' replays of the same games; paired_gaps gives the learner's score minus each
agent's game by game, with one interval for the difference.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Iterator, Optional

from unstable_dask.play.agents import legal_moves
from unstable_dask.play.experts import board_from_obs, empty_cells, game_of, optimal_cells, to_move
from unstable_dask.play.prompts import move_rule
from unstable_dask.play.yardsticks import first_free, winning_cells

Z95 = 1.959963984540054
LEARNER = "learner"  # a pooled row of the eval games: each round's checkpoint in the learner's seats
# Each probe's decision and move in one line (the report's caption; the module docstring says why)
PROBE_TEXT = {
    "take-a-win": "a winning cell existed and it took one",
    "forced-block": "no win of its own, the opponent had one winning cell, and it took it",
    "optimal": "some move would give away game value, and it kept the value (one of minimax's moves)",
    "first-free": "with two or more empty cells it took the lowest-numbered, a fill order that beats random without strategy",
    "bet-with-K": "holding the K with [bet] legal, it bet",
    "bet-with-J-or-Q": "holding the J or Q with [bet] legal, it bet, where a bet pays",
    "fold-with-J": "holding the J facing a bet, it folded",
}
PROBES = tuple(PROBE_TEXT)

# The seats under study, shared by the curves (report.CURVES_SQL) and the probes: the learner's, and
# in a baseline game (round.eval_baseline) the agent's that sat where the eval twin's learner sat
# (same run, round and seed; the agent's seats keep is_learner false).
SUBJECT_CTES = """eval_learners AS (  -- round.eval_baseline: an agent replays each eval game (same run, round, seed) in these seats
    SELECT DISTINCT run, round, seed, pid FROM seats WHERE split = 'eval' AND is_learner),
subject_ AS (  -- the seats under study: the learner's, and in baseline games the agent's in its place
    SELECT s.*, s.is_learner OR e.pid IS NOT NULL AS subject FROM seats s LEFT JOIN eval_learners e
        ON s.split = 'baseline' AND e.run = s.run AND e.round = s.round AND e.seed = s.seed AND e.pid = s.pid)"""

# Each subject seat scored as the curves count it (a draw half): SUBJECT_CTES, then per game its
# subject (`player`) and the other seats (`opponent`), then per subject seat `win` and `draw`.
SCORED_CTES = SUBJECT_CTES + """,
games_ AS (
    SELECT run, round, game_id, avg(num_turns) AS num_turns, max(reward) AS best, min(reward) AS worst,
           any_value(model_uid) FILTER (WHERE subject) AS player,
           CASE WHEN count(*) = 1 THEN 'solo' ELSE coalesce(string_agg(DISTINCT model_uid, '+' ORDER BY model_uid)
               FILTER (WHERE NOT subject), 'self') END AS opponent
    FROM subject_ GROUP BY run, round, game_id),
seats_ AS (  -- a single-player game is won with a reward > 0 (as `run rate` counts it)
    SELECT s.run, s.round, s.split, s.seed, s.pid, g.player, g.opponent, s.game_id, g.num_turns, s.reward,
           CASE WHEN s.num_players = 1 THEN s.reward > 0 ELSE s.reward = g.best AND g.best > g.worst END::INT AS win,
           CASE WHEN s.num_players = 1 THEN s.reward = 0 ELSE g.best = g.worst END::INT AS draw
    FROM subject_ s JOIN games_ g USING (run, round, game_id) WHERE s.subject)"""

# Per round, eval opponent and baseline agent: the learner's seat score minus the agent's in the same
# seat of the eval game's replay (a draw half), summed and squared-summed (a paired comparison: the
# same deal, and the opponents draw the same numbers while the two have moved alike).
PAIRED_SQL = "WITH " + SCORED_CTES + """
SELECT e.round, e.opponent, b.player AS agent, count(*) AS pairs,
       sum(e.win + 0.5 * e.draw - b.win - 0.5 * b.draw) AS gap_sum,
       sum((e.win + 0.5 * e.draw - b.win - 0.5 * b.draw) ^ 2) AS gap_sq_sum
FROM seats_ e JOIN seats_ b ON b.run = e.run AND b.round = e.round AND b.seed = e.seed AND b.pid = e.pid
    AND b.opponent = e.opponent
WHERE e.run = $1 AND e.split = 'eval' AND b.split = 'baseline'
GROUP BY ALL ORDER BY ALL"""

PROBED_GAMES = "(t.env_id LIKE 'TicTacToe-%' OR t.env_id LIKE 'KuhnPoker-%')"  # the games _GAMES below reads

# The subject's turns in the games that have probes (observation and action are data: parameters only).
PROBE_TURNS_SQL = "WITH " + SUBJECT_CTES + """
SELECT t.round, t.split, s.model_uid AS player, t.env_id, t.observation, t.action
FROM turns t JOIN subject_ s ON s.run = t.run AND s.game_id = t.game_id AND s.pid = t.pid
WHERE t.run = $1 AND t.split IN ('eval', 'baseline') AND s.subject
  AND """ + PROBED_GAMES

# The learner's turns in its train games with its seat's game reward (what its updates were fed).
TRAIN_PROBE_SQL = """
SELECT t.round, s.reward, t.env_id, t.observation, t.action
FROM turns t JOIN seats s ON s.run = t.run AND s.game_id = t.game_id AND s.pid = t.pid
WHERE t.run = $1 AND t.split = 'train' AND t.is_learner
  AND """ + PROBED_GAMES

_CARD = re.compile(r"Your card is: '([JQK])'")


def _tictactoe(env_id: str, obs: str, action: Optional[str]) -> dict[str, bool]:
    try:
        board = board_from_obs(obs)
    except ValueError:
        return {}
    me = to_move(board)
    wins, threats = winning_cells(board, me), winning_cells(board, "X" if me == "O" else "O")
    m = move_rule(env_id).search(action or "")  # the move the env read
    cell = int(m.group(1)) if m else None
    out = {"first-free": cell in first_free(board)} if board.count(".") >= 2 else {}
    best = optimal_cells(board)
    if len(best) < len(empty_cells(board)):
        out["optimal"] = cell in best
    if wins:
        return out | {"take-a-win": cell in wins}
    if len(threats) == 1:
        return out | {"forced-block": cell == threats[0]}
    return out


def _kuhn(env_id: str, obs: str, action: Optional[str]) -> dict[str, bool]:
    cards = _CARD.findall(obs)
    if not cards:
        return {}
    legal, m = legal_moves(env_id, obs), move_rule(env_id).search(action or "")
    move = m.group(1).lower() if m else None
    if "[bet]" in legal:
        return {"bet-with-K" if cards[-1] == "K" else "bet-with-J-or-Q": move == "bet"}
    if cards[-1] == "J" and "[fold]" in legal:
        return {"fold-with-J": move == "fold"}
    return {}


_GAMES: dict[str, Callable[[str, str, Optional[str]], dict[str, bool]]] = {"TicTacToe": _tictactoe, "KuhnPoker": _kuhn}


def classify(env_id: str, observation: str, action: Optional[str]) -> dict[str, bool]:
    """The probes this decision belongs to ({} for none) and whether it made the probed move."""
    fn = _GAMES.get(game_of(env_id))
    return fn(env_id, observation, action) if fn else {}


def wilson(successes: float, n: int) -> tuple[float, float]:
    """The Wilson 95% score interval (report.CURVES_SQL's, in Python), clipped to [0, 1]."""
    p = successes / n
    centre = (p + Z95 * Z95 / (2 * n)) / (1 + Z95 * Z95 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 * Z95 / (4 * n * n)) / (1 + Z95 * Z95 / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def _probed(con, sql: str, run_name: str) -> Iterator[tuple[tuple, str, bool]]:
    """(row, probe, made the probed move) for each probe of each decision the query returns; the
    query's columns end in env_id, observation, action."""
    cur = con.execute(sql, [run_name])
    while batch := cur.fetchmany(4096):
        for row in batch:
            for probe, hit in classify(*row[-3:]).items():
                yield row, probe, hit


def probe_counts(con, run_name: str) -> dict[tuple[int, str, str, str], list[int]]:
    """(round, split, player, probe) -> [decisions, probed moves made], over the run's eval and baseline turns."""
    out: dict[tuple[int, str, str, str], list[int]] = {}
    for (round_, split, player, *_), probe, hit in _probed(con, PROBE_TURNS_SQL, run_name):
        c = out.setdefault((round_, split, player, probe), [0, 0])
        c[0] += 1
        c[1] += int(hit)
    return out


def train_probe_rewards(con, run_name: str) -> dict[tuple[int, str], dict]:
    """(round, probe) -> the learner's decisions of that kind in the round's train games (`decisions`),
    how many made the probed move (`made`), and the mean game reward of its seat after making it
    (`reward_made`) and after not (`reward_missed`; None where there were none): what its updates
    were fed for that move, and whether the move was sampled at all."""
    sums: dict[tuple[int, str], list[float]] = {}
    for (round_, reward, *_), probe, hit in _probed(con, TRAIN_PROBE_SQL, run_name):
        s = sums.setdefault((round_, probe), [0, 0, 0.0, 0.0])  # made, missed, their reward sums
        s[0 if hit else 1] += 1
        s[2 if hit else 3] += reward
    return {k: {"decisions": int(made + missed), "made": int(made), "reward_made": rm / made if made else None,
                "reward_missed": rx / missed if missed else None} for k, (made, missed, rm, rx) in sums.items()}


def who(split: str, player: str) -> str:
    """A pooled row's player: `learner` for the eval games (each round's checkpoint), else the baseline agent."""
    return LEARNER if split == "eval" else player


def probe_rows(counts: dict[tuple[int, str, str, str], list[int]], rounds: list[int]) -> list[dict]:
    """The probes pooled over `rounds`, one row per split, player (`who`) and probe, with Wilson 95% intervals."""
    sums: dict[tuple[str, str, str], list[int]] = {}
    for (r, split, player, probe), (n, hits) in counts.items():
        if r in rounds:
            s = sums.setdefault((split, who(split, player), probe), [0, 0])
            s[0], s[1] = s[0] + n, s[1] + hits
    rows = []
    for (split, player, probe), (n, hits) in sorted(sums.items(), key=lambda kv: (kv[0][0] != "eval", kv[0][1], PROBES.index(kv[0][2]))):
        low, high = wilson(hits, n)
        rows.append({"split": split, "player": player, "probe": probe, "decisions": n, "hits": hits,
                     "rate": hits / n, "low": low, "high": high})
    return rows


def pool_window(curves: list[dict], upto: int, k: int) -> list[int]:
    """The latest k rounds up to `upto` that played eval games (rows of round_curves)."""
    return sorted({r["round"] for r in curves if r["split"] == "eval" and r["round"] <= upto})[-k:]


def pooled(curves: list[dict], rounds: list[int]) -> list[dict]:
    """round_curves' eval and baseline rows summed over `rounds`, per split, player (`who`) and opponent:
    games, seats, wins, draws, losses, score (win rate, draws half) with one Wilson 95% interval, and
    the checkpoints that played them."""
    sums: dict[tuple[str, str, str], dict] = {}
    played: dict[tuple[str, str, str], list[str]] = {}
    for r in curves:
        if r["round"] in rounds and r["split"] in ("eval", "baseline") and r["opponent"] != "*":
            key = (r["split"], who(r["split"], r["player"]), r["opponent"])
            s = sums.setdefault(key, dict.fromkeys(("games", "wins", "draws", "losses"), 0))
            for col in s:
                s[col] += r[col]
            played.setdefault(key, []).append(r["checkpoint_uid"])
    rows = []
    for (split, player, opponent), s in sums.items():
        seats = s["wins"] + s["draws"] + s["losses"]
        score = (s["wins"] + s["draws"] / 2) / seats
        low, high = wilson(s["wins"] + s["draws"] / 2, seats)
        rows.append({"split": split, "player": player, "opponent": opponent, "rounds": rounds,
                     "checkpoints": list(dict.fromkeys(played[(split, player, opponent)])), **s, "seats": seats,
                     "score": score, "low": low, "high": high, "draw_rate": s["draws"] / seats})
    return rows


def paired_gaps(con, run_name: str, rounds: list[int]) -> dict[tuple[str, str], dict]:
    """Per (eval opponent, baseline agent): the learner's score minus the agent's on the same eval games
    of `rounds` (PAIRED_SQL), pooled: `gap`, its normal 95% interval (`low`, `high`; the pairs' sample
    standard deviation) and `pairs`. Narrower than the two scores' own intervals side by side: the
    luck of the deal and of the opponent's draws is common to both."""
    sums: dict[tuple[str, str], list[float]] = {}
    for round_, opponent, agent, n, s, sq in con.sql(PAIRED_SQL, params=[run_name]).fetchall():
        if round_ in rounds:
            acc = sums.setdefault((opponent, agent), [0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + float(s), acc[2] + float(sq)
    out = {}
    for key, (n, s, sq) in sums.items():
        mean = s / n
        var = max(sq - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
        half = Z95 * math.sqrt(var / n)
        out[key] = {"gap": mean, "low": mean - half, "high": mean + half, "pairs": n}
    return out


def span(rounds: list[int]) -> str:
    """'rounds 11-14' or 'round 3'."""
    return f"round {rounds[0]}" if len(rounds) == 1 else f"rounds {rounds[0]}-{rounds[-1]}"
