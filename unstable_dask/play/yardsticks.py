"""Yardsticks: what simple strategies score against the uniformly random agent, by exact enumeration.

A strategy's score is P(win) + P(draw)/2 in one seat, averaged over both seats: the report's win
rate (draws half), which `seats.reward` gives as +1 win, 0 draw, -1 loss. Every figure is an exact
fraction over every deal and every move of both players, under the rules TextArena plays:

  TicTacToe   legal-random; first-free (the lowest-numbered empty cell: a fixed fill order, which
              wins along the top row whenever random fails to block it); take-a-win (a winning move
              when there is one, else random); take-a-win-else-first-free;
              win-or-block (else a move that stops the opponent's win, else random);
              win-or-block-else-first-free (the fill order with those two rules first); minimax and
              minimax-first (the expert agents); best-response (the best reply to the random agent: expectimax)
  KuhnPoker   legal-random; kuhn-best (the expert agent) over one hand (KuhnPoker-v0-single) or
              the n hands of TextArena's ids (KuhnPoker-v0: 3), where the pot stays at the two antes
              so a hand moves the chip count by exactly 1, the first hand is opened by player 1
              and the opener alternates; the game is won on chips, drawn when they are level

`python -m unstable_dask.play.yardsticks` prints them.
"""
from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from itertools import permutations
from typing import Callable

from unstable_dask.play.experts import LINES, empty_cells, kuhn_best, optimal_cells, over, play, to_move, winner

Dist = dict  # a move -> its probability (Fraction)
BoardPolicy = Callable[[str], Dist]  # a TicTacToe board (experts.py's form) -> the mover's distribution
EMPTY = "." * 9
HALF = Fraction(1, 2)


def _uniform(moves) -> Dist:
    moves = list(moves)
    return {m: Fraction(1, len(moves)) for m in moves}


# ---------------------------------------------------------------- TicTacToe

def winning_cells(board: str, mark: str) -> list[int]:
    """Empty cells that complete a line of `mark`."""
    return sorted({c for line in LINES for c in line if board[c] == "."
                   and sum(board[x] == mark for x in line) == 2})


def legal_random(board: str) -> Dist:
    return _uniform(empty_cells(board))


def take_a_win(board: str) -> Dist:
    return _uniform(winning_cells(board, to_move(board)) or empty_cells(board))


def win_or_block(board: str) -> Dist:
    me = to_move(board)
    other = "X" if me == "O" else "O"
    return _uniform(winning_cells(board, me) or winning_cells(board, other) or empty_cells(board))


def minimax(board: str) -> Dist:
    return _uniform(optimal_cells(board))


def minimax_first(board: str) -> Dist:
    return {optimal_cells(board)[0]: Fraction(1)}


@lru_cache(maxsize=None)
def _reply_value(board: str, me: str) -> Fraction:
    """The score of `me` when it plays best against the random agent from `board`."""
    if over(board):
        w = winner(board)
        return HALF if w is None else Fraction(int(w == me))
    children = [_reply_value(play(board, c), me) for c in empty_cells(board)]
    return max(children) if to_move(board) == me else sum(children, Fraction(0)) / len(children)


def best_response(board: str) -> Dist:
    me = to_move(board)
    values = {c: _reply_value(play(board, c), me) for c in empty_cells(board)}
    top = max(values.values())
    return _uniform(c for c, v in values.items() if v == top)


def first_free(board: str) -> Dist:
    """A fixed fill order: the lowest-numbered empty cell (what RL against random collapsed to)."""
    return {board.index("."): Fraction(1)}


def take_a_win_else_first_free(board: str) -> Dist:
    wins = winning_cells(board, to_move(board))
    return {wins[0]: Fraction(1)} if wins else first_free(board)


def win_or_block_else_first_free(board: str) -> Dist:
    """The fill order with win-or-block's two rules first: what blocking adds to what RL found."""
    me = to_move(board)
    cells = winning_cells(board, me) or winning_cells(board, "X" if me == "O" else "O")
    return {cells[0]: Fraction(1)} if cells else first_free(board)


TICTACTOE: dict[str, BoardPolicy] = {"legal-random": legal_random, "first-free": first_free,
                                     "take-a-win": take_a_win, "take-a-win-else-first-free": take_a_win_else_first_free,
                                     "win-or-block": win_or_block,
                                     "win-or-block-else-first-free": win_or_block_else_first_free, "minimax": minimax,
                                     "minimax-first": minimax_first, "best-response": best_response}


def tictactoe_seat_score(policy: BoardPolicy, mark: str) -> Fraction:
    """The score of `policy` playing `mark` ('O' moves first: player 0) against the random agent."""
    memo: dict[str, Fraction] = {}

    def go(board: str) -> Fraction:
        if board not in memo:
            if over(board):
                w = winner(board)
                memo[board] = HALF if w is None else Fraction(int(w == mark))
            else:
                dist = policy(board) if to_move(board) == mark else legal_random(board)
                memo[board] = sum((p * go(play(board, c)) for c, p in dist.items()), Fraction(0))
        return memo[board]
    return go(EMPTY)


def tictactoe_score(policy: BoardPolicy) -> Fraction:
    """Both seats averaged."""
    return (tictactoe_seat_score(policy, "O") + tictactoe_seat_score(policy, "X")) / 2


# ---------------------------------------------------------------- Kuhn Poker (TextArena's rules)

HandPolicy = Callable[[int, list[str]], Dist]  # (my card: 0=J 1=Q 2=K, legal moves) -> distribution
# TextArena's legal-action tree: a history of moves -> the next legal moves, or how the hand ends.
_TREE = {(): ["[check]", "[bet]"], ("[check]",): ["[check]", "[bet]"], ("[check]", "[bet]"): ["[fold]", "[call]"],
         ("[bet]",): ["[fold]", "[call]"]}


def kuhn_random(card: int, legal: list[str]) -> Dist:
    return _uniform(legal)


def kuhn_expert(card: int, legal: list[str]) -> Dist:
    return _uniform(kuhn_best("", legal))


KUHN: dict[str, HandPolicy] = {"legal-random": kuhn_random, "kuhn-best": kuhn_expert}


def kuhn_hand_win(policy: HandPolicy, opens: bool) -> Fraction:
    """P(`policy` wins one hand) against the random agent, over the 6 deals; `opens`: it acts first."""
    def go(history: tuple, cards: tuple[int, int]) -> Fraction:  # cards: (mine, theirs)
        if history and history[-1] == "[fold]":
            folder_is_me = (len(history) % 2 == 1) == opens  # odd length: the opener moved last
            return Fraction(int(not folder_is_me))
        if history in (("[check]", "[check]"), ("[bet]", "[call]"), ("[check]", "[bet]", "[call]")):
            return Fraction(int(cards[0] > cards[1]))
        legal = _TREE[history]
        mine = (len(history) % 2 == 0) == opens
        dist = policy(cards[0], legal) if mine else kuhn_random(cards[1], legal)
        return sum((p * go(history + (m,), cards) for m, p in dist.items()), Fraction(0))
    deals = list(permutations(range(3), 2))
    return sum((go((), d) for d in deals), Fraction(0)) / len(deals)


def kuhn_score(policy: HandPolicy, hands: int = 1) -> Fraction:
    """The game's score against the random agent over `hands` hands, both seats averaged."""
    seats = []
    for seat in (0, 1):
        diff = {0: Fraction(1)}  # chip difference (mine - theirs) / 1 -> probability
        for k in range(1, hands + 1):
            opener = 1 if k % 2 == 1 else 0  # TextArena: the opener flips before every hand, from 0
            p = kuhn_hand_win(policy, opens=opener == seat)
            nxt: dict[int, Fraction] = {}
            for d, q in diff.items():
                nxt[d + 1] = nxt.get(d + 1, Fraction(0)) + q * p
                nxt[d - 1] = nxt.get(d - 1, Fraction(0)) + q * (1 - p)
            diff = nxt
        seats.append(sum((q for d, q in diff.items() if d > 0), Fraction(0)) + HALF * diff.get(0, Fraction(0)))
    return sum(seats, Fraction(0)) / 2


def table() -> dict[str, Fraction]:
    """Every yardstick, by name."""
    out = {f"TicTacToe {name}": tictactoe_score(p) for name, p in TICTACTOE.items()}
    for hands, ids in ((1, "KuhnPoker-v0-single"), (3, "KuhnPoker-v0")):
        out |= {f"{ids} {name}": kuhn_score(p, hands) for name, p in KUHN.items()}
    return out


if __name__ == "__main__":
    for name, score in table().items():
        print(f"{name:<40} {float(score):.4f}  ({score})")
