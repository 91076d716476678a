"""The project's own TextArena envs: WinningNumber, a game where one action wins, and one-hand Kuhn Poker.

The observation lists the legal moves (`Available Moves: [0], [1], ...`); the first legal digit in
the action is the player's pick (lenient on purpose: "[0]", "0" and "I pick 0" all pick 0), and picking the winning number (fixed by the env id, so a policy
can learn it) wins. It exists so a learning test can check that training moves a policy towards
the winning action quickly, even from a random-init model.

  WinningNumber-v0      1 or 2 players, numbers 0..3, the winning number is 0
  WinningNumber-v0-hard 1 or 2 players, numbers 0..9, the winning number is 7
  WinningNumber-v0-coin 1 or 2 players, numbers 0..1, the winning number is 0

Single player: win 1, wrong number 0, no legal digit (after the error allowance) -1. Two players (each picks once, in turn): the one who picks
the winning number while the other does not wins (+1/-1), otherwise a draw. An action without a
legal number is an invalid move (TextArena's error allowance applies: resubmit, then forfeit).
KuhnPoker-v0-single is TextArena's Kuhn Poker dealt for one hand (`max_rounds=1`, the textbook
game; TextArena's own ids play 3 to 25 hands): the game's +-1 is that hand's result, so a move is
credited with its own hand only, not with the later hands' moves and forfeits. Same wrappers as
TextArena's KuhnPoker-v0 (`-train`, `-raw` versions included).

`register_envs()` is idempotent; every worker calls it before `ta.make`.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY, register_with_versions
from textarena.wrappers import ActionFormattingWrapper, GameMessagesObservationWrapper, LLMObservationWrapper

_DIGIT = re.compile(r"\d")


class WinningNumberEnv(ta.Env):
    def __init__(self, numbers: int = 4, winning: int = 0, error_allowance: int = 1):
        super().__init__()
        if not 0 <= winning < numbers:
            raise ValueError(f"winning ({winning}) must be in [0, {numbers})")
        self.numbers, self.winning, self.error_allowance = numbers, winning, error_allowance

    def reset(self, num_players: int, seed: Optional[int] = None) -> None:
        if num_players == 1:
            self.state = ta.SinglePlayerState(num_players=1, seed=seed, error_allowance=self.error_allowance)
        elif num_players == 2:
            self.state = ta.TwoPlayerState(num_players=2, seed=seed, error_allowance=self.error_allowance)
        else:
            raise ValueError(f"WinningNumber is played by 1 or 2 players, got {num_players}")
        self.state.reset(game_state={"picks": {}}, player_prompt_function=self._prompt)

    def _prompt(self, player_id: int, game_state: dict[str, Any]) -> str:
        moves = ", ".join(f"[{i}]" for i in range(self.numbers))
        return (f"You are Player {player_id} in WinningNumber. Pick one number; one of them always wins.\n"
                f"Available Moves: {moves}")

    def step(self, action: str) -> tuple[bool, ta.Info]:
        pid = self.state.current_player_id
        self.state.add_observation(from_id=pid, message=action, observation_type=ta.ObservationType.PLAYER_ACTION)
        pick = next((int(d) for d in _DIGIT.findall(action) if int(d) < self.numbers), None)
        if pick is None:
            if self.state.num_players == 1:
                self.state.set_invalid_move(reason="no legal number in the action", reward=-1.0)
            else:
                self.state.set_invalid_move(reason="no legal number in the action")
            return self.state.step()
        picks = self.state.game_state["picks"]
        picks[pid] = pick
        self.state.add_observation(message=f"Player {pid} picked {pick}.",
                                   observation_type=ta.ObservationType.GAME_ACTION_DESCRIPTION)
        if self.state.num_players == 1:
            won = pick == self.winning
            self.state.set_outcome(1.0 if won else 0.0, f"Picked {pick}; the winning number is {self.winning}.")
        elif len(picks) == 2:
            hit = [p for p in (0, 1) if picks[p] == self.winning]
            if len(hit) == 1:
                self.state.set_winner(hit[0], f"Player {hit[0]} picked the winning number {self.winning}.")
            else:
                self.state.set_draw(f"Both or neither picked the winning number {self.winning}.")
        return self.state.step()


_IDS = {"WinningNumber-v0": dict(numbers=4, winning=0), "WinningNumber-v0-hard": dict(numbers=10, winning=7),
        "WinningNumber-v0-coin": dict(numbers=2, winning=0)}
# Variants of TextArena's own envs: new id -> (the TextArena id whose entry point and wrappers it
# shares, its keyword arguments).
_VARIANTS = {"KuhnPoker-v0-single": ("KuhnPoker-v0", dict(max_rounds=1))}


def register_envs() -> None:
    """Register this project's envs with TextArena (safe to call any number of times)."""
    for env_id, kwargs in _IDS.items():
        if env_id in ENV_REGISTRY:
            continue
        register_with_versions(
            id=env_id, entry_point=WinningNumberEnv,
            wrappers={"default": [LLMObservationWrapper, ActionFormattingWrapper],
                      "-train": [GameMessagesObservationWrapper, ActionFormattingWrapper]},
            **kwargs)
    for env_id, (like, kwargs) in _VARIANTS.items():
        if env_id in ENV_REGISTRY:
            continue
        register_with_versions(
            id=env_id, entry_point=ENV_REGISTRY[like].entry_point,
            wrappers={"default": ENV_REGISTRY[like].default_wrappers,
                      "-train": ENV_REGISTRY[f"{like}-train"].default_wrappers},
            **kwargs)
