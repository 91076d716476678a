"""A learning test that cannot pass by luck: self-play rounds on WinningNumber-v0-coin (one of two
numbers wins) with builtin:tiny; the win rate must rise by a wide margin within 16 rounds.

The random-init tiny model has near-uniform logits over 4k tokens (tied embeddings of std 0.02),
so LoRA on attention/MLP alone cannot move them much; this job also puts LoRA on lm_head, a
standard peft target. On-policy batches (window = "latest") keep REINFORCE stable; sampling from
all past rounds at a higher lr made the curve swing.

REINFORCE (z-scored rewards, 2 updates a round, both on the round's 64 rows) takes lr 5e-3 and 16
rounds. At lr 1e-2 and 12 rounds it failed 3 of 16 runs (seeds 0-15, 2026-11-26: gains -0.13,
+0.05, +0.20; the other 13 +0.53..+0.95) and one CI run: a policy winning 0.83-0.98 fell to
0.00-0.06 in one round. The cause is the step, not the rewards: the second update's mean token
log-prob on the same 64 rows minus the first's (one AdamW step apart) moved by more than 0.5 nats
in 8 of 192 iterations, by up to 6.5, at gradient norms of 0.5-3.2 (clipped at 1.0). Mean-centred
rewards without the std (NormalizeRewards()) failed 0 of 11 runs but kept such steps (2 of 142
iterations, up to 7.8 nats; one run fell 0.80 -> 0.08 and recovered). At lr 5e-3 (seeds 20-31): no iteration of
192 moved more than 0.18 nats, 12 of 12 passed at +0.86..+0.92, the win rate first reached 0.90 in
rounds 8-11 and stayed >= 0.98 in rounds 13-15 (at 12 rounds the gains would have been
+0.74..+0.90).

GRPO and GSPO play each start state 8 times (round.group_size; with 4, a 10% win rate leaves two
groups in three without a win) and take PPO-style updates over the whole round: 2 epochs of 2
mini-batches of 64 rows, 4 optimizer steps a round, the first on-policy. Their clip ranges are
widened to suit a high lr (1e-2, so that a dozen updates suffice): at GRPO's 0.2 a round's later
steps could raise a token's probability by 20% at most and the curve crawled (0.09 -> 0.34-0.67);
GSPO's paper range (3e-4 / 4e-4, for lr ~1e-6) clipped nearly every sequence after the first
step. GSPO (clip 0.1) passed 4 of 4 runs (2026-11-22), then failed 1 of 6 at lr 1e-2 and 12 rounds
(2026-11-26, seeds 0-5: seed 2 rose to 0.48, then a round whose steps moved the policy 1.17 nats
(ppo_kl) left 0.03-0.19 for the last six rounds). At lr 5e-3 and 16 rounds (seeds 20-31) a
round's move halved (ppo_kl median 0.067 -> 0.025, 90th percentile 0.14 -> 0.06) and 12 of 12
passed at +0.80..+0.93, the win rate first reaching 0.90 in rounds 8-14; such a round still came
once in 192 (1.11 nats: seed 24 fell 0.52 -> 0.03 and was back at 0.61 the next round, 0.97 at the
end), which the later rounds absorb. GRPO (clip 0.5) also keeps a KL penalty to
the base model (kl_coef 0.01, k3 as in the GRPO paper). Without it GRPO can fall into a trap: once
no attempt in any group makes a valid move, every group's rewards are equal and its advantages are
0, so nothing moves the policy back. The KL term still pulls the policy towards the base, which
does make valid moves. Measured on run seeds 1-5 (2026-11-22): with kl_coef 0, 4 of 5 passed; seed
2 fell into the trap (0.28 in round 3, then 0.00 for rounds 4-11). Too strong a penalty fails the
other way: with every group won, the KL term alone pulls the policy back towards the base. With
kl_coef 0.05, 5 of 5 passed but runs peaked at 0.95 and fell back (seed 1: 0.95 -> 0.48), and one
CI run with seed 0 went 0.97 -> 0.20 and failed. With kl_coef 0.01 (2026-11-23), seeds 0, 1, 2
rose by +0.88, +0.88, +0.92 and stayed at 0.92-0.98 to round 11. Runs are not bit-reproducible
(the same seed gave two trajectories), so these are samples, not replays.

The trap again (2026-11-24): once the trainer dropped groups whose advantages are all 0, a run
that lost its valid moves (seed 0 in CI: 0.33 in round 2, then 0.01-0.04) had nothing left to
step on, KL term included: updates with 0 rows. With kl_coef > 0 such groups now stay in the batch
(LearnConfig.silent_rows_have_gradient). Measured with the same job, seeds 0-4 (2026-11-25): gains
+0.62, +0.90, +0.94, +0.64, +0.83 (without the change, seeds 0-5 passed at +0.85..+0.94 and the CI
run failed at -0.09: the trap is rare but final). The KL pull at saturation costs dips (seed 0's
round 11: 1.00 -> 0.30; seed 3 recovered from 0.50 to 0.97), which the three-round mean absorbs.

The trap, still (2026-11-25): with that job, 2 of seeds 0-4 and 10-14 fell to 0.00 (seed 11:
-0.10; seed 13: +0.17, climbing back to 0.44 by round 11), and at lr 5e-3 one of 5 (seed 25:
0.56 in round 6, then a round whose steps moved the policy 3.07 nats (ppo_kl), 0.00 after). The
rewards say why: WinningNumber-v0-coin pays -1 for no legal number, 0 for the wrong one, 1 for the
right one, and with each group scaled by its own std, a group's best attempt gets the same push
(+2.47 when it alone differs from the other 7) whether it won or merely named the wrong legal
number among illegal answers; a run that picks up "[1]" first drifts into a legal, losing policy.
Scaled by the batch's std instead (GroupRelativeAdvantage(scale="batch"), TRL's
scale_rewards="batch"), a win stays worth twice a wrong legal number in every group: clip 0.5,
seeds 50-59, 9 of 10 rose by +0.73..+0.91; seed 59 had a round that moved 0.76 nats and ended at
0.02. The clip bounds that: at 0.3 no round of 18 runs moved more than 0.36 nats (max ppo_kl),
but learning is slower (per-group std, seeds 40-49: +0.30..+0.80 by round 11, 2 drifted to
0.02-0.09), hence 16 rounds. Batch std, clip 0.3, 16 rounds, seeds 60-63, 65-68: 7 of 8 rose by
+0.75..+0.92 (by round 11 already +0.60..+0.83); seed 63 reached 1.00 in round 12 and then fell
to 0.25: with every group won, the batch had no signal and its update was the KL term's alone,
which AdamW scales to a full step towards the base. Such a batch now makes no step
(trainer.drop_silent_groups): seeds 63 and 70-74 then rose by +0.70..+0.89, 6 of 6; in 5 of them
a round with every game won made no step, and the next rounds stayed at 0.80-1.00.

GRPO at lr 1e-2 then failed one CI run (2026-11-26, seed 0, the machine loaded by a league): 0.86
in round 10, then a round whose steps moved the policy 1.93 nats (ppo_kl; the other 15 rounds
0.02-0.15) left 0.05, and +0.08 at the end. Like REINFORCE and GSPO before it, it now takes lr 5e-3
(seeds 20-31, 2026-11-26): 12 of 12 passed at +0.72..+0.89, the win rate first reaching 0.90 in
rounds 9-15 (seed 25: 0.88 at best, 0.78-0.88 at the end); a round's move: median 0.028 nats,
90th percentile 0.073, largest 0.26 of 192.
"""
from __future__ import annotations

import pytest

from unstable_dask.jobfile import validate_job
from unstable_dask.lake import Lake
from unstable_dask.loop import loop

# (rounds, round settings, learn settings) per algorithm; each takes lr 5e-3, gspo keeps its default
# transform (GroupRelativeAdvantage()), grpo scales its group-relative advantages by the batch's std
# (see the module docstring).
PPO = {"batch_size": 256, "updates_per_round": 1, "ppo_epochs": 2, "ppo_mini_batch_size": 64}  # the whole round
ALGORITHMS = {"reinforce": (16, {}, {"sampling_transforms": ["NormalizeRewards(z_score=True)"]}),
              "grpo": (16, {"group_size": 8}, PPO | {"clip_ratio": 0.3, "kl_coef": 0.01,
                                                     "sampling_transforms": ['GroupRelativeAdvantage(scale="batch")']}),
              "gspo": (16, {"group_size": 8}, PPO | {"gspo_clip_low": 0.1, "gspo_clip_high": 0.1})}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_win_rate_rises_clearly(tmp_path, algorithm):
    lake = tmp_path / "lake"
    rounds, round_extra, learn_extra = ALGORITHMS[algorithm]
    job = validate_job({
        "run": {"name": "learn", "lake": str(lake), "reports": str(tmp_path / "reports")},
        "model": {"max_new_tokens": 16, "hf_max_batch": 64,
                  "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]}},
        "cluster": {"n_workers": 1, "dashboard": False},
        "round": {"train_games": 64, "eval_games": 0, "games_per_task": 64, "concurrency": 64,
                  "train_envs": [{"env_id": "WinningNumber-v0-coin-train", "num_players": 1}]} | round_extra,
        "learn": {"algorithm": algorithm, "batch_size": 64, "mini_batch_size": 32, "lr": 5e-3, "grad_clip": 1.0,
                  "window": "latest", "gradient_checkpointing": False, "updates_per_round": 2,
                  "max_generation_len": 16, "final_transforms": [], "step_transforms": []} | learn_extra})
    loop(job, rounds, rate=False)
    win = {r["round"]: r["win"] for r in Lake(lake).sql("SELECT round, avg((reward > 0)::DOUBLE) AS win FROM seats GROUP BY round").to_pylist()}
    first, last = (win[0] + win[1]) / 2, sum(win[r] for r in range(rounds - 3, rounds)) / 3
    # Base rate is ~0.1 (a digit is rare in random text). The margin is about the sign and size of
    # learning, not its speed: the two means' standard error is <= 0.045 (128 and 192 games), so
    # +0.35 is a >7 sigma gap.
    assert last >= first + 0.35, win
