"""The algorithm registry: one list of algorithms, each file declaring what it needs, and the job
checks that follow from those declarations (at load, without importing torch)."""
from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from unstable_dask.errors import JobError
from unstable_dask.jobfile import load_job
from unstable_dask.learn import algorithms


@pytest.mark.parametrize("name", list(algorithms.ALGORITHMS))
def test_every_algorithm_file_declares_spec_config_update_and_math(name):
    mod = algorithms.module(name)
    assert isinstance(mod.SPEC, algorithms.Spec) and mod.SPEC.unit in ("turn", "seat", "group")
    assert list(inspect.signature(mod.update).parameters)[:4] == ["models", "batch", "args", "device"]
    assert "loss" in mod.__doc__ or "obj" in mod.__doc__  # its math, in its own docstring
    job = load_job(None, {"learn.algorithm": name, "round.group_size": 2, "round.train_games": 16})
    args = job.learn
    assert isinstance(args, mod.Config) and args.algorithm == name
    # sft has no "constant" normalization, so no max_generation_len
    assert getattr(args, "max_generation_len", job.model.max_new_tokens) == job.model.max_new_tokens and args.mini_batch_size == job.learn.mini_batch_size


def test_loading_a_job_does_not_import_torch():
    code = ("import sys\nfrom unstable_dask.jobfile import load_job\n"
            "for a in ('reinforce', 'a2c', 'grpo', 'gspo'):\n"
            "    load_job(None, {'learn.algorithm': a, 'round.group_size': 4, 'round.train_games': 16})\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_transforms_are_the_algorithm_s_and_listed_ones_are_kept():
    reinforce = load_job(None).learn
    assert reinforce.final_transforms == ["RoleAdvantageByEnvFormatter()"]
    assert reinforce.sampling_transforms == ["NormalizeRewardsByEnv(z_score=True)"]
    grpo = load_job(None, {"learn.algorithm": "grpo", "round.group_size": 4, "round.train_games": 16}).learn
    assert grpo.final_transforms == [] and grpo.sampling_transforms == ["GroupRelativeAdvantage()"]
    assert load_job(None, {"learn.algorithm": "a2c"}).learn.sampling_transforms == []
    both = ["GroupRelativeAdvantage()", "NormalizeRewardsByEnv(z_score=True)"]
    listed = load_job(None, {"learn.algorithm": "gspo", "round.group_size": 2, "round.train_games": 16,
                             "learn.sampling_transforms": both, "learn.final_transforms": []}).learn
    assert listed.sampling_transforms == both and listed.final_transforms == []


@pytest.mark.parametrize("over,message", [
    ({"learn.algorithm": "grpo"}, "key 'learn.algorithm' has value 'grpo': its advantages compare G attempts"),
    ({"learn.algorithm": "gspo", "round.group_size": 1}, "set round.group_size >= 2 (it is 1)"),
    ({"learn.ppo_epochs": 2}, "key 'learn.ppo_epochs' is a setting of grpo and gspo, and learn.algorithm 'reinforce' "
                              "has no such setting"),
    ({"learn.algorithm": "a2c", "learn.ppo_mini_batch_size": 8}, "learn.algorithm 'a2c' has no such setting"),
    ({"learn.gspo_clip_low": 0.1}, "key 'learn.gspo_clip_low' is a setting of gspo, and learn.algorithm 'reinforce'"),
    ({"learn.algorithm": "grpo", "round.group_size": 2, "learn.ppo_mini_batch_size": 64},
     "key 'learn.ppo_mini_batch_size' has value 64: it must lie between learn.mini_batch_size (8) and learn.batch_size (32)"),
    ({"learn.algorithm": "ppo"}, "unknown algorithm 'ppo'; expected one of reinforce, a2c, grpo, gspo, sft"),
])
def test_what_an_algorithm_needs_is_checked_at_load(over, message):
    with pytest.raises(JobError) as e:
        load_job(None, over)
    assert message in str(e.value) and str(e.value).startswith("<default>")
