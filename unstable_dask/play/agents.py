"""The agents a seat can be played by without a model: the builtin `random` opponent, which plays
a legal move parsed from the observation, and the experts of experts.py (`agent(name)`).

Most TextArena games print the legal moves ("Available Moves: [0], [1]", "Your available actions
are: '[check]', '[bet]'", "Valid moves: '[2, 3]'"); the last such line is the current one. Games
that only describe the move format get a small parser here (ConnectFour, Nim). Elsewhere the agent
falls back to the bracketed examples in the rules, which may be illegal.
"""
from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import Callable, Optional

from unstable_dask.config import RANDOM_UID, expert_parts
from unstable_dask.play.experts import EXPERTS, solves
from unstable_dask.play.prompts import BRACKETED_MOVE, move_rule

_LIST_LINE = re.compile(r"(available|valid|legal)\s+(moves|actions)[^\n]*", re.IGNORECASE)


def _connect_four(obs: str) -> list[str]:
    # The board's first row of cells after the "0 1 2 ..." header; '.' marks an open column.
    lines = obs.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if re.fullmatch(r"\s*0( \d+)+\s*", lines[i]) and i + 2 < len(lines):
            top = lines[i + 2].split()
            return [f"[col {c}]" for c, cell in enumerate(top) if cell == "."]
    return []


def _nim(obs: str) -> list[str]:
    piles = {}
    for m in re.finditer(r"pile (\d+): (\d+)", obs):
        piles[int(m.group(1))] = int(m.group(2))  # later lines are the current state
    return [f"[{p} {q}]" for p, n in sorted(piles.items()) for q in range(1, n + 1)]


_PARSERS: dict[str, Callable[[str], list[str]]] = {"ConnectFour": _connect_four, "Nim": _nim}


def legal_moves(env_id: str, obs: str) -> list[str]:
    """Legal moves listed in (or derived from) the latest observation, in order of appearance."""
    base = env_id.split("-v")[0]
    if base in _PARSERS:
        moves = _PARSERS[base](obs)
        if moves:
            return moves
    lines = [m.group(0) for m in _LIST_LINE.finditer(obs)]
    for line in reversed(lines):
        moves = BRACKETED_MOVE.findall(line)
        if moves:
            return moves
    return list(dict.fromkeys(BRACKETED_MOVE.findall(obs)))


def random_move(env_id: str, obs: str, rng: random.Random) -> Optional[str]:
    moves = legal_moves(env_id, obs)
    return rng.choice(moves) if moves else None


def _read_move(env_id: str, text: Optional[str]) -> Optional[str]:
    """The move `env_id`'s step reads from `text` (its own rule, the first match), normalised."""
    rule = move_rule(env_id)
    m = rule.search(text or "")
    return None if m is None else (m.group(1) if rule.groups else m.group(0)).strip().lower()


def expert_agrees(expert: str, env_id: str, obs: str, action: Optional[str]) -> bool:
    """Whether `action` makes one of `expert`'s best moves in the state `obs` shows. Both sides are
    read by the env's own rule, so '[ 4 ]' and '[4]' are one TicTacToe move; no move is no agreement."""
    move = _read_move(env_id, action)
    if move is None:
        return False
    return any(_read_move(env_id, best) == move for best in EXPERTS[expert](obs, legal_moves(env_id, obs)))


def expert_move(expert: str, env_id: str, obs: str) -> str:
    """`expert`'s move in the state `obs` shows, one per state: the first of its best moves (for
    'minimax', the lowest optimal cell: the move 'minimax-first' plays). Relabelling a turn with it
    (learn.select's expert_action) makes SFT data from any state, the learner's own included."""
    if expert not in EXPERTS:
        raise ValueError(f"expert_action: no expert is named {expert!r} (one of {', '.join(EXPERTS)})")
    if not solves(expert, env_id):
        raise ValueError(f"expert_action: {expert!r} has no solver for {env_id!r}")
    return EXPERTS[expert](obs, legal_moves(env_id, obs))[0]


Agent = Callable[[str, str, random.Random], Optional[str]]  # (env_id, observation, the seat's rng) -> move


@lru_cache(maxsize=None)
def agent(name: str) -> Agent:
    """The move function of an agent a seat is played by (opponents.py: Seat.plays == "agent",
    Seat.source = the name): 'random', an expert of experts.py, or its epsilon form '<expert>@<eps>'.
    Every draw comes from the rng passed in (one per seat of a game), never from the global `random`."""
    if name == RANDOM_UID:
        return random_move
    parts = expert_parts(name)
    if parts is None:
        raise ValueError(f"no agent is named {name!r}")
    best, eps = EXPERTS[parts[0]], parts[1]

    def move(env_id: str, obs: str, rng: random.Random) -> Optional[str]:
        if eps and rng.random() < eps:
            return random_move(env_id, obs, rng)
        moves = best(obs, legal_moves(env_id, obs))
        return rng.choice(moves) if moves else None
    return move
