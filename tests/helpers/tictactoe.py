"""TicTacToe recounted from a game's move sequence, independently of the probes' code
(report/strength.py reads the observation text; these rebuild the board from the valid moves)."""
from __future__ import annotations

import re
from functools import lru_cache

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


def boards(turns: list[dict]) -> list[tuple[str, int, str]]:
    """(board before the move, mover pid, action) per turn, rebuilt from the game's valid moves (not
    from the observation text the probes read); the first mover plays 'O'."""
    out, cells, marks = [], ["."] * 9, {}
    for t in sorted(turns, key=lambda t: t["turn"]):
        marks.setdefault(t["pid"], "O" if not marks else "X")
        out.append(("".join(cells), t["pid"], t["action"]))
        if not t["invalid_move"]:
            cells[int(t["action"].split("[", 1)[1].split("]", 1)[0].strip())] = marks[t["pid"]]
    return out


def recount(board: str, action: str) -> dict[str, bool]:
    """The probes of one decision: first-free, optimal where some move gives value away, then
    take-a-win, else forced-block where the opponent has one threat."""
    me = "O" if board.count("O") == board.count("X") else "X"
    other = "X" if me == "O" else "O"

    def wins(mark: str) -> set[int]:
        return {c for ln in LINES for c in ln if board[c] == "." and sum(board[x] == mark for x in ln) == 2}
    mine, theirs = wins(me), wins(other)
    m = re.search(r"\[\s*(\d+)\s*\]", action or "")  # the first bracketed number, as the env reads it
    cell = int(m.group(1)) if m else None
    empty = [c for c in range(9) if board[c] == "."]
    out = {"first-free": cell == empty[0]} if len(empty) >= 2 else {}
    best = optimal_cells(board)
    if len(best) < len(empty):
        out["optimal"] = cell in best
    if mine:
        return out | {"take-a-win": cell in mine}
    return out | ({"forced-block": cell in theirs} if len(theirs) == 1 else {})


def optimal_cells(board: str) -> set[int]:
    """The cells whose move keeps the game's minimax value for the player to move (an independent
    negamax over the 9-cell string, not play/experts.py's)."""
    def mover(b: str) -> str:
        return "O" if b.count("O") == b.count("X") else "X"

    def won(b: str) -> bool:
        return any(b[x] != "." and b[x] == b[y] == b[z] for x, y, z in LINES)

    @lru_cache(maxsize=None)
    def score(b: str) -> int:  # for the player to move in b
        if won(b):
            return -1
        moves = [c for c in range(9) if b[c] == "."]
        return max(-score(b[:c] + mover(b) + b[c + 1:]) for c in moves) if moves else 0
    after = {c: -score(board[:c] + mover(board) + board[c + 1:]) for c in range(9) if board[c] == "."}
    return {c for c, v in after.items() if v == max(after.values())}
