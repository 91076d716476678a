"""GRPO on a lake written by REAL rounds (the demo job, builtin:tiny, round.group_size = 4, mirror
self-play on 2-player WinningNumber-coin, whose outcomes vary for a random model: a forfeit after
two moves without a number, a win, a loss or a draw): every batch holds whole (group_id, pid)
groups, the advantages are group-relative, the learner's batch reproduces the engine's behaviour
log-probs, and a PPO-style update runs on it."""
from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.learn.learner import build_query, learn, plan
from unstable_dask.learn.rewards import run_batch_query
from unstable_dask.play.round import play_round

from helpers import logprob_check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory, local_client):
    tmp = tmp_path_factory.mktemp("grpo")
    job = load_job("jobs/demo.toml", {
        "run.lake": str(tmp / "lake"), "run.reports": str(tmp / "reports"),
        "round.group_size": 4, "round.train_games": 32, "round.eval_games": 0, "round.games_per_task": 16,
        "round.concurrency": 16, "model.max_new_tokens": 12, "model.temperature": 0.7, "model.top_p": 0.95,
        "round.train_envs": [{"env_id": "WinningNumber-v0-coin-train", "num_players": 2, "num_actors": 2}],
        # outcome rewards only: a group's advantages then come from its outcomes alone
        "learn.algorithm": "grpo", "learn.step_transforms": [], "learn.batch_size": 24, "learn.mini_batch_size": 4,
        "learn.ppo_epochs": 2, "learn.ppo_mini_batch_size": 8, "learn.lr": 1e-2, "learn.gradient_checkpointing": False})
    play_round(job, client=local_client)
    return job


def _outcomes(con) -> dict:
    """(group_id, pid) -> {game_id: final reward} of the round's train games."""
    out = defaultdict(dict)
    for g, pid, game, r in con.sql("SELECT group_id, pid, game_id, reward FROM seats WHERE split = 'train'").fetchall():
        out[(g, pid)][game] = r
    return out


def test_batches_hold_whole_groups_with_group_relative_advantages(job):
    con = Lake(job.run.lake).connect()
    outcomes = _outcomes(con)
    assert len(outcomes) == 16 and all(len(games) == 4 for games in outcomes.values())  # 8 start states x 2 seats
    turns = defaultdict(set)
    for g, pid, game, turn in con.sql("SELECT group_id, pid, game_id, turn FROM turns WHERE split = 'train' "
                                      "AND is_learner AND prompt_tokens > 0").fetchall():
        turns[(g, pid)].add((game, turn))
    p = plan(job)
    seen, differing = set(), 0
    for update in range(6):  # batches of different seeds
        rows = run_batch_query(con, build_query(job, p, update, con)).to_pylist()
        assert rows and all(r["temperature"] == 0.7 and r["top_p"] == 0.95 for r in rows)
        groups = defaultdict(list)
        for r in rows:
            groups[(r["group_id"], r["pid"])].append(r)
        for key, members in groups.items():
            seen.add(key)
            assert {(r["game_id"], r["turn"]) for r in members} == turns[key]  # the whole group
            # GRPO over the outcomes of the seat's attempts, each game once however many turns it
            # took (pid 1 has no turn in a game pid 0 forfeited: that attempt holds nothing to train)
            rewards = {g: v for g, v in outcomes[key].items() if g in {r["game_id"] for r in members}}
            assert len(rewards) == 4 or key[1] == 1
            mu = sum(rewards.values()) / len(rewards)
            # the unbiased std over the attempts, as verl and TRL take it (torch.std); one attempt: no baseline
            sd = math.sqrt(sum((v - mu) ** 2 for v in rewards.values()) / (len(rewards) - 1)) if len(rewards) > 1 else 0
            for r in members:
                want = (rewards[r["game_id"]] - mu) / (sd + 1e-8) if len(rewards) > 1 else 0.0
                assert r["advantage"] == pytest.approx(want, abs=1e-6)
            if len(set(rewards.values())) > 1:
                differing += 1
                assert any(abs(r["advantage"]) > 0.5 for r in members)
            else:
                assert all(abs(r["advantage"]) < 1e-6 for r in members)
    assert differing >= 2 and len(seen) >= 8, (differing, seen)
    multi = [k for k, v in turns.items() if len(v) > len({g for g, _ in v})]
    assert multi  # some attempts took two turns (a move without a number, then a resubmission)


def test_the_learner_batch_reproduces_the_behaviour_logprobs(job):
    """Prompt ids re-encoded with the engines' budget rule, the stored completion ids and the
    round's temperature / top_p: a fresh LoRA (the base model) gives the engine's log-probs back."""
    from unstable_dask.learn import passes
    from unstable_dask.learn.tokens import LOGP_FLOOR
    from unstable_dask.learn.trainer import Trainer
    con = Lake(job.run.lake).connect()
    table = run_batch_query(con, build_query(job, plan(job), 0, con))
    trainer = Trainer(job, None, torch.device("cpu"))
    batch = trainer.batch(table)
    assert bool(batch.known.all())
    with torch.no_grad():  # the learner's own pass: rows trimmed, logits from the first completion position on
        p = passes.forward(trainer.policy, batch.tokens, list(range(batch.size)), batch.temperature, batch.top_p, "cpu")
    mask = p.mask.bool()
    assert int(mask.sum()) == sum(table.column("completion_tokens").to_pylist())
    # on-policy ratio 1: every token within fp32 noise, or a nucleus-boundary flip (logprob_check)
    verdict = logprob_check.check(p.logits[mask], p.window_ids[:, 1:][mask], p.take(batch.behaviour)[mask], 0.7, 0.95)
    assert torch.equal(verdict.recomputed.clamp(min=LOGP_FLOOR), p.logp[mask])  # the learner's own computation is the one checked


def test_a_ppo_style_update_on_real_groups(job):
    r = learn(job)
    (step,) = r.steps
    assert step["optimizer_steps"] == 2 * math.ceil(step["samples"] / 8)
    assert math.isfinite(step["loss"]) and step["grad_norm"] > 0
    # lr 1e-2: the policy moves in epoch 1, so epoch 2 meets ratios the clip acts on
    assert step["clip_frac"] > 0
    row = Lake(job.run.lake).table("learner_steps").read().to_pylist()[0]
    # the algorithm's own metrics live in the `metrics` map, the shared ones in columns
    assert row["optimizer_steps"] == step["optimizer_steps"] and dict(row["metrics"])["clip_frac"] == step["clip_frac"]
