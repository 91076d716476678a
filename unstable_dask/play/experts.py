"""Expert agents: exact solvers for games small enough to solve, as opponents and yardsticks.

  minimax     TicTacToe: a move of the exact game tree's optimal set (win > draw > loss for the
              mover), uniform over that set. It never loses.
  minimax-first
              TicTacToe: the lowest-numbered cell of that optimal set. It never loses either, and it
              is a function of the board: a student imitating it has one right answer per state
              (minimax's uniform draw gives up to nine), so its NLL can reach 0.
  kuhn-best   Kuhn Poker under TextArena's rules: bet whenever betting is legal, call a bet, never
              fold. TextArena keeps the pot at the two antes (a bet or call adds nothing), so a hand
              is worth +-1 whatever was bet: folding only loses, and a bet only gives the other
              player a chance to fold. That makes it a best reply to the random agent (the one that
              bets most; with the K, checking does as well) and an equilibrium strategy: it never
              folds, so no opponent wins more than half its hands. The textbook equilibrium (bluff
              J at 1/3, ...) assumes bets enter the pot and does not apply. The same move is best
              in every hand of TextArena's multi-hand ids: hands are dealt independently and each
              one moves the chip count by exactly 1.

Each expert is a function from the observation to its set of best moves (a list, in the env's
notation); `agents.py` draws one with the game's own rng and mixes in random legal moves for the
epsilon form `<name>@<eps>`. `SOLVES` says which games an expert has a solver for (checked when a
job loads). The TicTacToe board model here (cells, lines, who moves) is the env's: the tests play
it against TextArena's own win checks.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Callable, Optional

# A board: 9 cells, row by row, each 'X', 'O' or '.'. Player 0 is 'O' and moves first (TextArena).
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
_BOARD = re.compile(r"Current Board:\s*\n(.*?)(?:\n\s*\n|\Z)", re.DOTALL)


def winner(board: str) -> Optional[str]:
    """The mark with three in a row, if any."""
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


def to_move(board: str) -> str:
    return "O" if board.count("O") == board.count("X") else "X"


def play(board: str, cell: int) -> str:
    return board[:cell] + to_move(board) + board[cell + 1:]


def empty_cells(board: str) -> list[int]:
    return [i for i, c in enumerate(board) if c == "."]


def over(board: str) -> bool:
    return winner(board) is not None or "." not in board


@lru_cache(maxsize=None)
def value(board: str) -> int:
    """The game's value for the player to move with best play by both: 1 win, 0 draw, -1 loss."""
    if winner(board) is not None:
        return -1  # the last move won
    if "." not in board:
        return 0
    return max(-value(play(board, c)) for c in empty_cells(board))


@lru_cache(maxsize=None)
def optimal_cells(board: str) -> tuple[int, ...]:
    """The cells whose move keeps the game's value for the mover (the minimax agent's choices)."""
    best = value(board)
    return tuple(c for c in empty_cells(board) if -value(play(board, c)) == best)


def board_from_obs(obs: str) -> str:
    """The latest board an observation shows (TextArena's TicTacToe render: ' X | 1 | O ' rows)."""
    blocks = _BOARD.findall(obs)
    if not blocks:
        raise ValueError("no 'Current Board:' in the observation")
    rows = [line for line in blocks[-1].splitlines() if "|" in line]
    cells = [cell.strip() for row in rows for cell in row.split("|")]
    if len(cells) != 9:
        raise ValueError(f"a TicTacToe board has 9 cells, the observation shows {len(cells)}")
    return "".join(c if c in ("X", "O") else "." for c in cells)


def minimax(obs: str, legal: list[str]) -> list[str]:
    return [f"[{c}]" for c in optimal_cells(board_from_obs(obs))]


def minimax_first(obs: str, legal: list[str]) -> list[str]:
    return [f"[{optimal_cells(board_from_obs(obs))[0]}]"]


def kuhn_best(obs: str, legal: list[str]) -> list[str]:
    for move in ("[bet]", "[call]"):
        if move in legal:
            return [move]
    return legal


# An expert: (observation, legal moves in it) -> its best moves, drawn uniformly.
EXPERTS: dict[str, Callable[[str, list[str]], list[str]]] = {"minimax": minimax, "minimax-first": minimax_first,
                                                              "kuhn-best": kuhn_best}
# The games (TextArena ids up to '-v') each expert solves: any version and wrapper of them.
SOLVES: dict[str, tuple[str, ...]] = {"minimax": ("TicTacToe",), "minimax-first": ("TicTacToe",),
                                      "kuhn-best": ("KuhnPoker",)}


def game_of(env_id: str) -> str:
    return env_id.split("-v")[0]


def solves(expert: str, env_id: str) -> bool:
    return game_of(env_id) in SOLVES[expert]
