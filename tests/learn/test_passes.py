"""pi_old from the learner, the engine's log-probs as importance weights, and the mismatch on record
(learn/passes.py), on lakes written by REAL rounds of the builtin tiny model: on the fp32 path the
weights are 1 within the measured fp32 bound and the loss is the one without them; a bf16 learner
on an fp32 lake still starts every update at ratio 1 while its columns show the mismatch; rows an
engine served with other weights than their checkpoint stop the job; groups without signal never
reach an optimizer step; an entropy bonus joins the loss as learner_steps records it."""
from __future__ import annotations

import dataclasses
import math

import pyarrow as pa
import pytest
import torch

from unstable_dask.errors import JobError
from unstable_dask.inference.weights import resolve_model
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.learn.learner import build_query, learn, plan
from unstable_dask.learn.rewards import run_batch_query
from unstable_dask.play.opponents import list_checkpoints
from unstable_dask.play.round import play_round
from unstable_dask.play.schedule import schedule_round
from unstable_dask.play.task import play_task

from helpers.adapters import random_adapters

pytestmark = pytest.mark.slow

# The weights' bound on the fp32 path, from bench/inference/bench_logprob_noise.py's measurement (see
# tests/logprob_check.py): tokens agree to 9.5e-7, and a nucleus-boundary flip (1 in ~6,000 tokens)
# moves one token's log-prob by at most 2.1e-4. So: |w - 1| <= exp(3e-4) - 1, mean gap <= 1e-5.
FLIP = 3e-4


def make_job(tmp, **learn_over):
    return load_job("jobs/demo.toml", {
        "run.lake": str(tmp / "lake"), "run.reports": str(tmp / "reports"),
        "round.group_size": 4, "round.train_games": 32, "round.eval_games": 0, "round.games_per_task": 16,
        "round.concurrency": 16, "model.max_new_tokens": 12, "model.temperature": 0.7, "model.top_p": 0.95,
        "round.train_envs": [{"env_id": "WinningNumber-v0-coin-train", "num_players": 2, "num_actors": 2}],
        "learn.algorithm": "grpo", "learn.step_transforms": [], "learn.batch_size": 24, "learn.mini_batch_size": 4,
        "learn.lr": 1e-2, "learn.gradient_checkpointing": False,
        **{f"learn.{k}": v for k, v in learn_over.items()}})


@pytest.fixture(scope="module")
def lake_dir(tmp_path_factory, local_client):
    tmp = tmp_path_factory.mktemp("passes")
    play_round(make_job(tmp), client=local_client)
    return tmp


def copy_of(lake_dir, tmp_path):
    import shutil
    shutil.copytree(lake_dir / "lake", tmp_path / "lake")
    return tmp_path


def test_on_the_fp32_path_the_weights_are_one_and_the_loss_is_unchanged(lake_dir, tmp_path_factory):
    """Two learners on the same lake, importance weights on ("truncate") and off: same update."""
    out = {}
    for mode in ("truncate", "off"):
        tmp = copy_of(lake_dir, tmp_path_factory.mktemp(mode))
        (step,) = learn(make_job(tmp, is_mode=mode, dtype="float32", ppo_epochs=2, ppo_mini_batch_size=8)).steps
        out[mode] = step
    on = out["truncate"]
    assert on["dtype"] == "float32" and on["samples"] > 0
    assert on["logp_gap_mean"] < 1e-5 and on["logp_gap_max"] < FLIP
    assert abs(on["is_weight_max"] - 1) < math.exp(FLIP) - 1 and abs(on["is_weight_mean"] - 1) < 1e-5
    assert on["is_bounded_frac"] == 0 and on["is_ess"] == pytest.approx(1.0, abs=1e-6)
    assert on["outside_nucleus_frac"] == 0 and on["clip_frac_first"] == 0 and on["entropy"] > 0
    assert on["loss"] == pytest.approx(out["off"]["loss"], rel=1e-4, abs=1e-7)
    assert on["clip_frac"] > 0  # lr 1e-2: the second epoch's ratios move, and the clip acts


def test_a_bf16_learner_on_an_fp32_lake_starts_at_ratio_one_and_shows_the_mismatch(lake_dir, tmp_path):
    """The production case: the engine and the learner compute differently. GSPO's sequence clip
    (3e-4 wide) would reject most sequences on the first step if pi_old were the engine's; with
    pi_old the learner's own, the first step clips nothing and the gap lands in learner_steps."""
    tmp = copy_of(lake_dir, tmp_path)
    job = make_job(tmp, algorithm="gspo", dtype="bfloat16", ppo_epochs=2, ppo_mini_batch_size=8,
                   sampling_transforms=["GroupRelativeAdvantage()"])
    (step,) = learn(job).steps
    assert step["dtype"] == "bfloat16" and step["clip_frac_first"] == 0
    assert 1e-4 < step["logp_gap_mean"] < 0.1  # bf16 vs fp32: ~1e-3 per token (measured 1.5e-3 median)
    assert step["is_weight_max"] > 1 + 1e-4  # the weights carry the mismatch instead of the clip
    # The second optimizer step's forward sees the first step's weights: with autocast's weight cache
    # on across steps it saw the old bf16 copies, and ppo_kl was exactly 0 (the policy never moved).
    assert abs(step["ppo_kl"]) > 1e-6
    row = Lake(job.run.lake).sql("SELECT metrics['clip_frac_first'] AS clip_frac_first, logp_gap_mean, dtype FROM learner_steps").to_pylist()[0]
    assert row["dtype"] == "bfloat16" and row["logp_gap_mean"] == pytest.approx(step["logp_gap_mean"])


def test_rows_served_with_other_weights_than_their_checkpoint_stop_the_job(lake_dir, tmp_path):
    """ckpt-1 is committed; the next round's engine is handed another adapter folder under ckpt-1's
    name (a stale hot-swap, a wrong path): its turns record that adapter's digest, and the learner
    refuses them with one line naming the checkpoint."""
    tmp = copy_of(lake_dir, tmp_path)
    job = make_job(tmp)
    learn(job)
    lake = Lake(job.run.lake)
    cks = list_checkpoints(lake, job.run.name)
    (other,) = random_adapters(resolve_model(job.model.base), _factory(tmp_path), n=1)
    wrong = dataclasses.replace(cks[-1], adapter=other.path)  # the name says ckpt-1, the weights are not
    tasks = [dataclasses.replace(t, attempt="a1") for t in schedule_round(job, lake, 1, wrong, cks[:-1] + [wrong])]
    for t in tasks:
        play_task(t, job.model, job.round, lake)
    lake.commit_round(job.run.name, 1, dict(attempt="a1", checkpoint_uid="ckpt-1", games=32, temperature=0.7,
                                            top_p=0.95, max_new_tokens=12))
    with pytest.raises(JobError, match=r"ckpt-1 committed [0-9a-f]{12}: the engine served other weights"):
        learn(job)
    assert [c["uid"] for c in Lake(job.run.lake).table("checkpoints").rows(job.run.name)] == ["ckpt-1"]


def _factory(tmp_path):
    class Factory:
        def mktemp(self, name):
            path = tmp_path / name
            path.mkdir(exist_ok=True)
            return path
    return Factory()


def test_groups_without_signal_never_reach_an_optimizer_step(lake_dir, tmp_path):
    """Outcome rewards on a real lake: groups whose attempts all scored alike are dropped before the
    optimizer steps are cut, counted in learner_steps; a batch of nothing but such groups moves
    nothing at all (AdamW's momentum included)."""
    tmp = copy_of(lake_dir, tmp_path)
    job = make_job(tmp)
    con = Lake(job.run.lake).connect()
    table = run_batch_query(con, build_query(job, plan(job), 0, con))
    silent = {}
    for g, pid, a in zip(*(table.column(c).to_pylist() for c in ("group_id", "pid", "advantage"))):
        silent[(g, pid)] = silent.get((g, pid), True) and a == 0.0
    rows_silent = sum(1 for g, pid in zip(table.column("group_id").to_pylist(), table.column("pid").to_pylist())
                      if silent[(g, pid)])
    assert 0 < rows_silent < table.num_rows  # the lake has both kinds (WinningNumber-coin, a random model)
    (step,) = learn(job).steps
    assert step["rows_dropped"] == rows_silent and step["samples"] == table.num_rows - rows_silent
    assert step["zero_std_group_frac"] == pytest.approx(sum(silent.values()) / len(silent))
    # Every group silent (advantages all 0): no optimizer step, the adapter is the parent's.
    tmp2 = copy_of(lake_dir, tmp_path / "again")
    silent_job = make_job(tmp2, sampling_transforms=["SELECT * REPLACE (0.0 AS reward) FROM batch"])
    result = learn(silent_job)
    (step,) = result.steps
    assert step["optimizer_steps"] == 0 and step["samples"] == 0 and step["zero_std_group_frac"] == 1.0
    from safetensors.torch import load_file
    weights = load_file(str(Lake(silent_job.run.lake).location(result.adapter_path) + "/adapter_model.safetensors"))
    assert all(not torch.any(v) for k, v in weights.items() if "lora_B" in k)  # B = 0: the fresh LoRA, unmoved


def test_a_batch_without_signal_makes_no_step_even_with_a_kl_penalty(lake_dir, tmp_path, local_client):
    """When every attempt of every group scores alike, the advantages are all 0 and an update would
    be the KL term's alone, which AdamW scales to a full step towards the base: at saturation
    (every group won) that pulled a solved policy from 1.00 to 0.25 in one round. Such a batch
    makes no step, KL penalty or not."""
    tmp = copy_of(lake_dir, tmp_path)
    job = make_job(tmp, kl_coef=0.05)
    learn(job)  # ckpt-1: an adapter that differs from the base (a fresh one equals it: no KL gradient)
    play_round(job, client=local_client)  # round 1, played by ckpt-1
    silent = make_job(tmp, kl_coef=0.05, sampling_transforms=["SELECT * REPLACE (0.0 AS reward) FROM batch"])
    (step,) = learn(silent).steps
    assert step["zero_std_group_frac"] == 1.0 and step["rows_dropped"] > 0 and step["samples"] == 0
    assert step["optimizer_steps"] == 0


def test_an_entropy_bonus_joins_the_loss_and_keeps_the_silent_groups(lake_dir, tmp_path):
    """learn.entropy_coef through the whole learner on a real lake: with "token-mean" the bonus is
    exactly entropy_coef times the mean per-token entropy learner_steps records, and groups whose
    attempts scored alike stay in the step (the bonus gives their rows a gradient)."""
    tmp = copy_of(lake_dir, tmp_path)
    (step,) = learn(make_job(tmp, entropy_coef=0.1, normalization="token-mean", dtype="float32")).steps
    assert step["entropy"] > 0 and step["optimizer_steps"] == 1
    # float32 micro-batch sums (eps 1.2e-7); measured 3.4e-8 relative at loss -0.74, entropy 8.2 nats
    assert step["loss"] - step["pg_loss"] == pytest.approx(-0.1 * step["entropy"], rel=1e-6)
    assert step["zero_std_group_frac"] > 0 and step["rows_dropped"] == 0


def test_with_a_kl_penalty_silent_groups_join_a_step_that_has_signal():
    """Beside groups with signal, a silent group's rows stay when a KL penalty gives them a
    gradient (drop=False), and go when nothing but the advantage weighs them."""
    from unstable_dask.learn.trainer import drop_silent_groups
    table = pa.table({"group_id": ["a", "a", "b", "b", "c", "c"], "pid": [0, 0, 0, 0, 0, 0],
                      "advantage": [0.0, 0.0, 1.0, -1.0, None, 0.0]})
    kept, m = drop_silent_groups(table, drop=False)
    assert kept.num_rows == 6 and m == {"zero_std_group_frac": 2 / 3, "rows_dropped": 0}
    dropped, m = drop_silent_groups(table, drop=True)
    assert dropped.column("group_id").to_pylist() == ["b", "b"] and m["rows_dropped"] == 4
    none, m = drop_silent_groups(table.filter(pa.array([True, True, False, False, True, True])), drop=False)
    assert none.num_rows == 0 and m == {"zero_std_group_frac": 1.0, "rows_dropped": 4}


def test_the_gap_guard_judges_only_rows_of_the_weights_the_learner_holds(lake_dir):
    """learn.max_logp_gap: rows the parent played, on the iteration's first update, can differ from
    the engine's log-probs only by numerics (or other weights: the job stops). The same gap on rows
    of an update after the policy moved (guard_uid None), or of older checkpoints, is recorded only:
    REINFORCE with updates_per_round = 2 at lr 1e-2 drifted 0.55 nats a token by its second update."""
    from unstable_dask.learn.trainer import Trainer
    job = make_job(lake_dir)
    con = Lake(job.run.lake).connect()
    table = run_batch_query(con, build_query(job, plan(job), 0, con))
    shifted = table.set_column(table.schema.get_field_index("logprobs"), "logprobs",
                               pa.array([[x - 1.0 for x in lp] for lp in table.column("logprobs").to_pylist()],
                                        table.schema.field("logprobs").type))
    fresh = lambda: Trainer(job, None, torch.device("cpu"))  # noqa: E731 - each update moves its trainer
    (uid,) = set(table.column("model_uid").to_pylist())
    with pytest.raises(JobError, match=f"max_logp_gap: the engine's log-probs differ from the learner's by 1.* on the "
                                       f"rows {uid} played"):  # the checkpoint named
        fresh().update(shifted, 0, guard_uid=uid)
    assert fresh().update(shifted, 0, guard_uid="ckpt-7")["logp_gap_mean"] == pytest.approx(1.0, abs=1e-3)
    assert fresh().update(shifted, 0)["logp_gap_mean"] == pytest.approx(1.0, abs=1e-3)  # recorded, not judged
