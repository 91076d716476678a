"""The learn job: adapters round-trip through peft, training resumes exactly, commits are ordered."""
from __future__ import annotations

import pytest
import torch

from unstable_dask.errors import JobError
from unstable_dask.jobfile import validate_job
from unstable_dask.lake import Lake
from unstable_dask.learn.learner import build_query, learn, plan
from unstable_dask.learn.rewards import run_batch_query

from helpers.lakes import RUN, tiny_lake


def job_for(lake, **learn):
    cfg = dict(batch_size=8, mini_batch_size=4, lr=1e-3, gradient_checkpointing=False) | learn
    return validate_job({"run": {"name": RUN, "lake": str(lake)}, "learn": cfg,
                         "round": {"group_size": 2, "train_games": 16},  # groups, for grpo and gspo
                         "model": {"lora": {"rank": 4, "alpha": 8}, "max_new_tokens": 8}})


make_lake = tiny_lake


def lora_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_learn_resumes_exactly_and_adapter_round_trips(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from unstable_dask.inference.weights import resolve_model
    from unstable_dask.learn.trainer import Trainer

    lake = make_lake(tmp_path / "lake", rounds=1, games=12)
    job = job_for(lake)
    with pytest.raises(JobError):
        learn(job_for(tmp_path / "empty"))
    sql = learn(job, show_sql=True)
    assert sql.startswith("WITH") and "hash(" in sql
    assert "rows)" in learn(job, preview=True)
    p1 = plan(job)
    r1 = learn(job)
    assert (r1.iteration, r1.uid, r1.rounds) == (1, "ckpt-1", [1])
    assert learn(job).skipped  # the round is trained on: no second checkpoint
    make_lake(lake, rounds=1, games=12, seed=1, first=2, uid="ckpt-1")
    p2 = plan(job)
    r2 = learn(job)  # a fresh Trainer: loads ckpt-1's adapter and AdamW state from disk
    assert (r2.iteration, r2.rounds, p2.parent_uid) == (2, [2], "ckpt-1")

    # Reference: the same two updates in one process, never saved and reloaded.
    ref = Trainer(job, None, torch.device("cpu"))
    for p in (p1, p2):
        ref.update(run_batch_query(Lake(lake).connect(), build_query(job, p)))
    base = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny"), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(lake / r2.adapter_path))
    got, want = lora_state(loaded), lora_state(ref.policy)
    assert got.keys() == want.keys() and got
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
    ids = torch.tensor([[5, 17, 300, 42, 7]])
    ref.policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref.policy(input_ids=ids).logits, rtol=0, atol=1e-5)

    ckpts = Lake(lake).table("checkpoints").rows(RUN, order_by="iteration")
    assert [c["uid"] for c in ckpts] == ["ckpt-1", "ckpt-2"] and ckpts[1]["parent_uid"] == "ckpt-1"
    steps = Lake(lake).table("learner_steps").read().to_pylist()
    assert [s["iteration"] for s in steps] == [1, 2]
    assert all(s["samples"] == 8 and s["tokens"] > 0 and s["grad_norm"] > 0 for s in steps)


@pytest.mark.parametrize("algorithm", ["a2c", "grpo", "gspo"])
def test_other_algorithms_train_and_resume(tmp_path, algorithm):
    lake = make_lake(tmp_path / "lake", rounds=1, games=12)
    ppo = dict(kl_coef=0.1, ppo_epochs=2, ppo_mini_batch_size=4) if algorithm != "a2c" else {}
    job = job_for(lake, algorithm=algorithm, updates_per_round=2, **ppo)
    r1 = learn(job)
    assert len(r1.steps) == 2 and all(torch.isfinite(torch.tensor(s["loss"])) for s in r1.steps)
    if algorithm == "a2c":
        assert (lake / r1.adapter_path / "critic" / "value_head.pt").is_file()
        assert r1.steps[0]["value_loss"] > 0 and r1.steps[0]["optimizer_steps"] == 1
    else:  # 2 epochs over mini-batches of 4 rows
        assert all(s["optimizer_steps"] == 2 * -(-s["samples"] // 4) and s["clip_frac"] is not None for s in r1.steps)
    make_lake(lake, rounds=1, games=12, seed=1, first=2, uid="ckpt-1")
    assert learn(job).iteration == 2


def test_uncommitted_learner_output_is_invisible(tmp_path):
    lake = make_lake(tmp_path / "lake", rounds=1, games=12)
    # Steps written but no checkpoint row (a learn job killed before its commit): nothing visible.
    Lake(lake).write("learner_steps", RUN, 1, "steps", [{"update": 0, "loss": 1.0}])
    assert Lake(lake).table("learner_steps").files() == []
    assert plan(job_for(lake)).iteration == 1


def test_rounds_played_before_exact_tokens_are_refused(tmp_path):
    """Rounds whose files predate completion_token_ids / group_id / the commit's sampling settings
    cannot be trained on exactly: a clear error naming them, alone or beside newer rounds."""
    import pyarrow.parquet as pq

    from unstable_dask.lake.migrate import migrate
    # The lake of the time: the same rounds, its files without those columns (nor the commit's
    # file list), no Delta log; it gets its log the way an upgraded lake does, through migrate.
    src, lake = make_lake(tmp_path / "src", rounds=1, games=12), tmp_path / "lake"
    drop = {"turns": ["completion_token_ids", "group_id"],
            "rounds": ["temperature", "top_p", "max_new_tokens", "files"]}
    for f in src.rglob("*.parquet"):
        rel = f.relative_to(src)
        if "_delta_log" in rel.parts:
            continue
        (lake / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pq.ParquetFile(f).read().drop_columns(drop.get(rel.parts[0], [])), lake / rel)
    migrate(lake)
    message = r"round\(s\) \[1\] of run 't' in lake '.*' were played before the lake recorded exact token ids"
    with pytest.raises(JobError, match=message):
        learn(job_for(lake))
    make_lake(lake, rounds=1, games=12, seed=1, first=2)
    with pytest.raises(JobError, match=message):
        learn(job_for(lake, window="all"))
    assert learn(job_for(lake, window=1)).rounds == [2]  # "latest" holds the untrained old round too


def test_preview_at_version_reproduces_the_batch_a_checkpoint_trained_on(tmp_path):
    """learner_steps records the table versions its batch read; `--preview --at-version` reads
    the same rows after the lake has moved on (a new round that the current window includes)."""
    import json

    lake = make_lake(tmp_path / "lake", rounds=1, games=12)
    job = job_for(lake, window="all")
    sql_then, preview_then = learn(job, show_sql=True), learn(job, preview=True)
    learn(job)
    step = Lake(lake).sql("SELECT table_versions, samples FROM learner_steps WHERE update = 0").to_pylist()[0]
    versions = json.loads(step["table_versions"])
    assert set(versions) >= {"games", "turns", "rounds"}
    make_lake(lake, rounds=1, games=12, seed=1, first=2, uid="ckpt-1")
    assert learn(job, preview=True) != preview_then  # the lake moved on: today's batch differs
    for at in ("ckpt-1", "1"):
        assert learn(job, preview=True, at_version=at) == preview_then
        assert learn(job, show_sql=True, at_version=at) == sql_then
    assert preview_then.endswith(f"({step['samples']} rows)")
    assert Lake(lake).at(versions).connect().sql("SELECT DISTINCT round FROM turns").fetchall() == [(1,)]
    with pytest.raises(JobError, match="ckpt-9"):
        learn(job, preview=True, at_version="ckpt-9")
    with pytest.raises(JobError, match="--preview or --show-sql"):
        learn(job, at_version="ckpt-1")


@pytest.mark.parametrize("transform,shows", [
    ("SELECT * REPLACE (reward / (completion_tokens - completion_tokens) AS reward) FROM steps", "inf"),
    ("SELECT * REPLACE (CAST(NULL AS DOUBLE) AS reward) FROM steps", "NULL"),
])
def test_a_transform_giving_non_finite_rewards_stops_learn_with_one_line_and_commits_nothing(
        tmp_path, capsys, transform, shows):
    from unstable_dask.cli import main
    lake = make_lake(tmp_path / "lake", rounds=1, games=12)
    code = main(["learn", "--set", f'run.name="{RUN}"', "--set", f'run.lake="{lake}"', "--set", "learn.batch_size=8",
                 "--set", "learn.mini_batch_size=4", "--set", "learn.step_transforms=[" + repr(transform).replace("'", '"') + "]"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "learn.step_transforms[0]" in err and f"gives a {shows}" in err.replace("-inf", "inf").replace("nan", "inf")
    assert not Lake(lake).table("checkpoints").files() and not (lake / "adapters").exists()


def test_an_update_to_non_finite_weights_is_never_committed(tmp_path):
    """Advantages finite in the lake's float64 but past float32: the loss overflows; nothing commits."""
    lake = make_lake(tmp_path / "lake", rounds=1, games=12)
    huge = ["SELECT * REPLACE (reward * 1e300 AS reward) FROM steps"]
    with pytest.raises(JobError, match=r"the update of ckpt-1 of run 't' gave loss (nan|-?inf).*; nothing is committed"):
        learn(job_for(lake, step_transforms=huge, sampling_transforms=[]))
    assert not Lake(lake).table("checkpoints").files() and not (lake / "adapters").exists()


def test_settings_changed_after_the_first_checkpoint_apply_or_are_refused(tmp_path):
    """A resumed trainer loads the parent's AdamW state, but learn.lr and learn.weight_decay are the
    job's (learner_steps shows what ran); a LoRA shape other than the parent's is refused."""
    lake = make_lake(tmp_path / "lake", rounds=1, games=12)
    learn(job_for(lake, lr=1e-3))
    make_lake(lake, rounds=1, games=12, seed=1, first=2, uid="ckpt-1")
    bigger = validate_job({"run": {"name": RUN, "lake": str(lake)},
                           "learn": dict(batch_size=8, mini_batch_size=4, gradient_checkpointing=False),
                           "model": {"lora": {"rank": 8, "alpha": 8}, "max_new_tokens": 8}})
    with pytest.raises(JobError, match=r"model.lora.rank' has value 8 but the run's newest checkpoint was trained with 4"):
        learn(bigger)
    r = learn(job_for(lake, lr=3e-3, weight_decay=0.05))
    assert r.steps[0]["lr"] == 3e-3
    lrs = Lake(lake).sql("SELECT iteration, lr FROM learner_steps ORDER BY iteration").to_pylist()
    assert [(x["iteration"], x["lr"]) for x in lrs] == [(1, 1e-3), (2, 3e-3)]


def test_a_decaying_lr_schedule_continues_across_iterations(tmp_path):
    """learn.lr_schedule counts the run's updates along the lineage: the second iteration's first
    step takes the lr of update 3, not the schedule's start, and lr_end holds after the horizon."""
    import math
    lake = make_lake(tmp_path / "lake", rounds=1, games=12)
    sched = dict(lr=1e-3, lr_end=1e-4, lr_schedule="cosine", lr_decay_updates=4, updates_per_round=3)
    learn(job_for(lake, **sched))
    make_lake(lake, rounds=1, games=12, seed=1, first=2, uid="ckpt-1")
    learn(job_for(lake, **sched))
    rows = Lake(lake).sql("SELECT iteration, lr FROM learner_steps ORDER BY iteration, \"update\"").to_pylist()
    want = [1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * min(u / 4, 1))) for u in range(6)]
    assert [x["iteration"] for x in rows] == [1, 1, 1, 2, 2, 2]
    assert [x["lr"] for x in rows] == pytest.approx(want, rel=1e-12)
    assert rows[0]["lr"] == 1e-3 and rows[4]["lr"] == rows[5]["lr"] == pytest.approx(1e-4)
    linear = validate_job({"run": {"name": RUN}, "learn": dict(lr=1e-3, lr_schedule="linear", lr_decay_updates=10)})
    assert [linear.learn.lr_at(u) for u in (0, 5, 10, 50)] == pytest.approx([1e-3, 5e-4, 0.0, 0.0])
    with pytest.raises(JobError, match=r"key .learn.: lr_end \(0.01\) must be <= lr \(0.001\)"):
        validate_job({"run": {"name": RUN}, "learn": dict(lr=1e-3, lr_end=1e-2, lr_schedule="cosine")})


def test_an_algorithm_s_own_metric_reaches_the_lake_without_a_schema_edit(tmp_path, monkeypatch):
    """A metric no learner_steps column names lands in the `metrics` map (SQL: metrics['name']);
    one that cannot be stored (not a number) stops the job before any adapter is written."""
    from unstable_dask.learn.algorithms import reinforce
    lake = make_lake(tmp_path / "lake", rounds=1, games=12)
    real = reinforce.update
    monkeypatch.setattr(reinforce, "update", lambda *a: real(*a) | {"rank": "first"})
    with pytest.raises(TypeError, match="rank"):
        learn(job_for(lake))
    assert not Lake(lake).table("checkpoints").files() and not (lake / "adapters").exists()
    monkeypatch.setattr(reinforce, "update", lambda *a: real(*a) | {"surprise": 0.25})
    (step,) = learn(job_for(lake)).steps
    row = Lake(lake).sql("SELECT loss, metrics['surprise'] AS surprise FROM learner_steps").to_pylist()
    assert row == [{"loss": step["loss"], "surprise": 0.25}]


def test_a_critic_with_non_finite_weights_is_never_committed():
    """A2C: the critic's update is checked like the policy's."""
    from types import SimpleNamespace

    from unstable_dask.learn.guards import check_finite_update
    from unstable_dask.learn.plan import Plan
    critic = torch.nn.Linear(2, 1)
    with torch.no_grad():
        critic.weight[0, 1] = float("nan")
    trainer = SimpleNamespace(policy=torch.nn.Linear(2, 2), critic=critic)
    with pytest.raises(JobError, match=r"the update of ckpt-1 of run 't' gave non-finite weights \(critic.weight"):
        check_finite_update(job_for("unused"), Plan(RUN, 1, "ckpt-1", "base", None, [0]),
                            {"loss": 0.5, "grad_norm": 1.0}, trainer)


def test_rows_played_as_the_base_model_must_have_been_served_without_an_adapter():
    """The served-weights check covers rows of `base` too: an adapter's digest on them is an error."""
    import pyarrow as pa

    from unstable_dask.learn.guards import served_weights
    from unstable_dask.learn.plan import Plan
    p = Plan(RUN, 1, "ckpt-1", "base", None, [0], lineage={"base": (0, None)})
    rows = dict(round=[0, 0], game_id=["g", "g"], turn=[0, 2], model_uid=["base", "base"])
    job = job_for("unused")
    assert served_weights(job, p, pa.table(rows | {"adapter_sha256": [None, None]}))["staleness_max"] == 0
    with pytest.raises(JobError, match=r"turn 2 of game g \(round 0\) of run 't' was played by adapter weights "
                                       r"0123456789ab, but its checkpoint is 'base'"):
        served_weights(job, p, pa.table(rows | {"adapter_sha256": [None, "0123456789abcdef"]}))


@pytest.mark.parametrize("algorithm", ["reinforce", "a2c"])
def test_a_resident_model_trains_the_same_adapters_as_loading_it_every_iteration(tmp_path, algorithm):
    """learn.resident: two iterations in one process, the second on the model the first handed back
    (policy and, for A2C, critic), give the adapter files that loading the base each time gives."""
    from unstable_dask.learn import resident

    got = {}
    for setting in ("never", "always"):
        resident.clear()
        lake = make_lake(tmp_path / setting, rounds=1, games=12)
        job = job_for(lake, algorithm=algorithm, resident=setting, gradient_checkpointing=True)
        learn(job)
        assert len(resident.kept()) == (2 if algorithm == "a2c" and setting == "always" else int(setting == "always"))
        make_lake(lake, rounds=1, games=12, seed=1, first=2, uid="ckpt-1")
        r2 = learn(job)
        folder = lake / r2.adapter_path
        got[setting] = {f.relative_to(folder).as_posix(): f.read_bytes() for f in sorted(folder.rglob("*"))
                        if f.suffix in (".safetensors", ".pt")}  # adapters, value head, AdamW states
    resident.clear()
    assert got["never"].keys() == got["always"].keys() and len(got["never"]) == (5 if algorithm == "a2c" else 2)
    assert got["never"] == got["always"]


def test_a_kept_model_takes_another_adapter_s_weights_exactly(tmp_path):
    """The kept model holds the weights it trained; a Trainer on another adapter replaces all of them."""
    import shutil

    from peft.utils import load_peft_weights
    from safetensors.torch import save_file

    from unstable_dask.learn import resident
    from unstable_dask.learn.trainer import Trainer
    resident.clear()
    lake = make_lake(tmp_path / "lake", rounds=1, games=12)
    job = job_for(lake, resident="always")
    ck = lake / learn(job).adapter_path
    assert len(resident.kept()) == 1
    other = tmp_path / "other"
    shutil.copytree(ck, other)
    weights = load_peft_weights(str(ck))
    save_file({k: torch.randn_like(v) for k, v in weights.items()}, str(other / "adapter_model.safetensors"))
    want = load_peft_weights(str(other))
    trainer = Trainer(job, str(other), torch.device("cpu"))
    assert not resident.kept()  # taken: one Trainer holds it
    state = {k.replace(".default", ""): v for k, v in lora_state(trainer.policy).items()}
    assert state.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(state[k], want[k], rtol=0, atol=0)
    resident.clear()
