"""The project's TextArena variants: KuhnPoker-v0-single is Kuhn Poker dealt for exactly one hand."""
import random
import re

import pytest
import textarena as ta

from unstable_dask.play.agents import random_move
from unstable_dask.play.envs import register_envs


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_envs()
    register_envs()  # idempotent: every worker calls it


def _card(obs: str) -> str:
    return re.findall(r"Your card is: '([JQK])'", obs)[-1]


@pytest.mark.parametrize("env_id", ["KuhnPoker-v0-single", "KuhnPoker-v0-single-train"])
def test_one_hand_then_the_game_is_over(env_id):
    """Whatever is played, the game ends after one hand and its +-1 is that hand's result."""
    rng = random.Random(0)
    rank = {"J": 0, "Q": 1, "K": 2}
    for seed in range(40):
        env = ta.make(env_id)
        env.reset(num_players=2, seed=seed)
        cards, moves, done = {}, [], False
        while not done:
            pid, obs = env.get_observation()
            assert "out of 1 rounds" in obs
            cards[pid] = _card(obs)
            move = random_move("KuhnPoker-v0", obs, rng)
            moves.append((pid, move))
            done, _ = env.step(move)
        assert len(moves) <= 3  # check-check, check-bet-call/fold, bet-call/fold
        rewards, info = env.close()
        assert sorted(rewards.values()) == [-1, 1] and not any(v["invalid_move"] for v in info.values())
        winner = max(rewards, key=rewards.get)
        folder = next((pid for pid, m in moves if m == "[fold]"), None)
        if folder is not None:
            assert winner == 1 - folder
        elif len(cards) == 2:  # a showdown: the higher card wins the hand, so the game
            assert winner == max(cards, key=lambda p: rank[cards[p]])


def test_random_agent_only_plays_legal_moves_on_one_hand():
    rng = random.Random(1)
    env = ta.make("KuhnPoker-v0-single-train")
    for seed in range(20):
        env.reset(num_players=2, seed=seed)
        done = False
        while not done:
            _, obs = env.get_observation()
            done, _ = env.step(random_move("KuhnPoker-v0-single-train", obs, rng))
        _, info = env.close()
        assert not any(v["invalid_move"] for v in info.values())
