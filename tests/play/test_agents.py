"""The builtin random agent plays only legal moves, on real TextArena games."""
import random

import pytest
import textarena as ta

from unstable_dask.play.agents import legal_moves, random_move


def _state(env):
    while not hasattr(env, "state"):
        env = env.env
    return env.state


@pytest.mark.parametrize("env_id", ["SimpleTak-v0-train", "TicTacToe-v0-train", "KuhnPoker-v0-train",
                                    "ConnectFour-v0-train", "Nim-v0-train", "Othello-v0-train"])
def test_random_agent_only_plays_legal_moves(env_id):
    rng = random.Random(0)
    moves = 0
    for seed in range(4):
        env = ta.make(env_id)
        env.reset(num_players=2, seed=seed)
        _state(env).error_allowance = 0  # any illegal move would end the game as an invalid move
        done = False
        while not done:
            pid, obs = env.get_observation()
            move = random_move(env_id, obs, rng)
            assert move is not None
            errors = _state(env).error_count
            done, _ = env.step(move)
            moves += 1
            assert _state(env).error_count == errors, f"{env_id}: illegal move {move}"
        _, info = env.close()
        assert not any(v["invalid_move"] for v in info.values()), f"{env_id}: {info}"
    assert moves > 8


def test_latest_move_list_wins():
    obs = "Available Moves: [0], [1], [2]\n...later...\nAvailable Moves: [2]"
    assert legal_moves("SimpleTak-v0", obs) == ["[2]"]
