"""SFT warm start: the learner imitates an expert's turns from the lake (minimax against the random
agent, played by a real round), writes a normal checkpoint, and RL continues from it."""
from __future__ import annotations

import shutil

import pytest
import torch

from unstable_dask.errors import JobError
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.learn import passes, selection
from unstable_dask.learn.learner import build_query, learn, plan, run_batch
from unstable_dask.learn.trainer import Trainer
from unstable_dask.play.experts import board_from_obs, optimal_cells
from unstable_dask.play.prompts import extract_action, render_prompt
from unstable_dask.play.round import play_round

pytestmark = pytest.mark.slow
RUN = "sft"
# Baseline games (legal-random in the learner's seat against minimax) 0-7 are trained on, 8-11 held out.
TRAIN = f"SELECT * FROM turns WHERE model_uid = 'minimax' AND split = 'baseline' AND game_id < '{RUN}-r0000-baseline-00008'"
HELD_OUT = TRAIN.replace("game_id <", "game_id >=")
SFT = {"algorithm": "sft", "select": TRAIN, "batch_size": 64, "mini_batch_size": 16, "lr": 1e-2,
       "updates_per_round": 12}


def job_for(root, lake=None, **learn_keys):
    over = {"run.name": RUN, "run.lake": str(lake or root / "lake"), "run.reports": str(root / "reports"),
            "model.max_new_tokens": 8, "round.train_games": 4, "round.eval_games": 12, "round.eval_baseline": True,
            "round.games_per_task": 7, "round.concurrency": 7,
            "round.train_envs": [{"env_id": "TicTacToe-v0-train", "num_actors": 1}],
            "round.eval_envs": [{"env_id": "TicTacToe-v0-train", "num_actors": 1}],
            "round.opponents": {"strategy": "fixed", "fixed": ["minimax"]},
            "learn": {"gradient_checkpointing": False} | learn_keys}
    return load_job("jobs/demo.toml", over)


@pytest.fixture(scope="module")
def played(tmp_path_factory, local_client):
    """Round 0 played and committed; a copy of that lake before any learner ran (`pristine`)."""
    root = tmp_path_factory.mktemp("sft")
    job = job_for(root, **SFT)
    play_round(job, client=local_client)
    shutil.copytree(root / "lake", root / "pristine")
    return job, root


@pytest.fixture(scope="module")
def trained(played):
    job, root = played
    p = plan(job)
    result = learn(job)
    return job, root, p, result


def rows(job, select):
    con = Lake(job.run.lake).connect()
    try:
        return run_batch(con, job, selection.selection_query(RUN, [0], select, 10_000, 0))
    finally:
        con.close()


def nll(trainer, table) -> float:
    """Mean NLL per target token of the rows, under the trainer's policy."""
    batch = trainer.batch(table)
    trainer.policy.eval()
    with torch.no_grad():
        p = passes.forward(trainer.policy, batch.tokens, list(range(batch.size)), batch.temperature, batch.top_p, "cpu")
    return float(-(p.logp * p.mask).sum() / p.mask.sum())


def test_sft_lowers_the_nll_of_held_out_expert_turns(trained):
    job, root, p, result = trained
    held, seen = rows(job, HELD_OUT), rows(job, TRAIN)
    assert held.num_rows >= 8 and seen.num_rows >= 16
    trained_games = set(seen.column("game_id").to_pylist())
    assert not trained_games & set(held.column("game_id").to_pylist())  # other games, never in a batch
    base = nll(Trainer(job, None, torch.device("cpu")), held)
    tuned = nll(Trainer(job, str(root / "lake" / result.adapter_path), torch.device("cpu")), held)
    assert tuned < base - 1.5, (base, tuned)  # nats per target token
    steps = sorted(Lake(job.run.lake).table("learner_steps").read().to_pylist(), key=lambda s: s["update"])
    assert len(steps) == SFT["updates_per_round"] and all(s["algorithm"] == "sft" for s in steps)
    metrics = [dict(s["metrics"]) for s in steps]
    assert all(s["samples"] == seen.num_rows and s["train_tokens"] > 0 for s in steps)  # every selected turn
    assert metrics[-1]["nll"] == steps[-1]["loss"] < metrics[0]["nll"] - 1.5
    assert steps[-1]["staleness_max"] is None and steps[-1]["logp_gap_mean"] is None  # no engine rows


def test_the_batch_is_the_experts_moves_in_the_learners_template(trained):
    job, root, p, _ = trained
    con = Lake(job.run.lake).connect()
    try:
        batch = run_batch(con, job, build_query(job, p, 0, con))
        learner = con.sql(f"SELECT * FROM turns WHERE run = '{RUN}' AND is_learner AND prompt_tokens > 0 "
                          "ORDER BY game_id, turn LIMIT 1").to_arrow_table()
    finally:
        con.close()
    assert set(batch.column("model_uid").to_pylist()) == {"minimax"}
    row = batch.slice(0, 1).to_pylist()[0]
    assert row["prompt"] is None  # no model played it: the learner renders it
    cell = int(row["action"].strip("[]"))
    assert cell in optimal_cells(board_from_obs(row["observation"]))  # minimax's move
    trainer = Trainer(job, None, torch.device("cpu"))
    tok = trainer.tokenizer
    prompts, targets = selection.texts(job, batch, tok)
    assert job.model.template == "qwen3-zs"
    assert prompts[0] == render_prompt("qwen3-zs", row["observation"])
    assert prompts[0].startswith("<|im_start|>user\nYou are playing") and prompts[0].endswith("<|im_start|>assistant\n")
    assert targets[0] == f"\\boxed{{{cell}}}" and extract_action(targets[0]) == (row["action"], True)
    tokens = trainer.batch(batch).tokens
    ids = tokens.input_ids[0][tokens.attention_mask[0].bool()]
    target = ids[tokens.loss_mask[0][: len(ids)].bool()]
    assert tok.decode(target) == f"\\boxed{{{cell}}}{tok.eos_token}"  # the answer, then EOS
    assert tok.decode(ids[~tokens.loss_mask[0][: len(ids)].bool()]) == prompts[0]  # prompt masked
    # Rendered as the engine renders and tokenizes: a turn the model played gets its own prompt back.
    (engine_prompt,), _ = selection.texts(job, learner, tok)
    assert engine_prompt == learner.column("prompt")[0].as_py()
    (ids_again,), _ = selection.token_ids(job, learner, tok)
    assert len(ids_again) == learner.column("prompt_tokens")[0].as_py()


def test_rl_continues_from_the_sft_checkpoint(trained, local_client):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from unstable_dask.inference.weights import resolve_model
    job, root, _, result = trained
    rl = job_for(root, algorithm="reinforce", batch_size=8, mini_batch_size=4, lr=1e-4)
    play_round(rl, client=local_client)  # round 1, played by the SFT checkpoint
    second = learn(rl)
    lake = Lake(rl.run.lake)
    ckpts = lake.table("checkpoints").rows(RUN, order_by="iteration")
    assert [(c["uid"], c["parent_uid"], c["algorithm"]) for c in ckpts] == [
        ("ckpt-1", "base", "sft"), ("ckpt-2", "ckpt-1", "reinforce")]
    assert lake.sql(f"SELECT checkpoint_uid FROM rounds WHERE run = '{RUN}' AND round = 1").to_pylist() == [
        {"checkpoint_uid": "ckpt-1"}]
    served = lake.sql(f"SELECT DISTINCT adapter_sha256 FROM turns WHERE run = '{RUN}' AND round = 1 "
                      "AND is_learner AND prompt_tokens > 0").to_pylist()
    assert served == [{"adapter_sha256": ckpts[0]["adapter_sha256"]}]

    def lora(path):
        base = AutoModelForCausalLM.from_pretrained(resolve_model(job.model.base), dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(root / "lake" / path))
        return torch.cat([v.flatten() for k, v in sorted(model.state_dict().items()) if "lora_B" in k])
    first, then = lora(result.adapter_path), lora(second.adapter_path)
    assert first.norm() > 0  # SFT moved the adapter off its init (B = 0)
    assert (then - first).norm() < 0.2 * first.norm()  # one RL step from it, not from the base


# DAgger's selection: the learner's own train turns, each action replaced by the solver's move there.
RELABEL = ("SELECT * REPLACE (expert_action('{expert}', env_id, observation) AS action), action AS played "
           "FROM turns WHERE is_learner AND split = 'train'")


def test_expert_action_relabels_the_learners_own_turns_with_the_solvers_move(played):
    job, _ = played
    table = rows(job, RELABEL.format(expert="minimax-first"))
    n = Lake(job.run.lake).sql(f"SELECT count(*) AS n FROM turns WHERE run = '{RUN}' AND round = 0 "
                               "AND is_learner AND split = 'train'").to_pylist()[0]["n"]
    assert table.num_rows == n >= 8  # every learner turn, invalid moves included: the state has a right move
    turns = table.to_pylist()
    for r in turns:
        assert r["action"] == f"[{optimal_cells(board_from_obs(r['observation']))[0]}]"
    assert any(r["played"] != r["action"] for r in turns)  # the model's moves were replaced, not kept
    # minimax (uniform over its ties) relabels with the same single move: a label is a function of the state
    assert rows(job, RELABEL.format(expert="minimax")).column("action") == table.column("action")
    _, targets = selection.texts(job, table, Trainer(job, None, torch.device("cpu")).tokenizer)
    assert targets == [f"\\boxed{{{r['action'].strip('[]')}}}" for r in turns]  # the template's answer form


@pytest.mark.parametrize("expert,message", [("kuhn-best", "'kuhn-best' has no solver for 'TicTacToe-v0-train'"),
                                            ("maximin", "no expert is named 'maximin'")])
def test_expert_action_without_a_solver_is_one_line_naming_the_key(played, expert, message):
    job, _ = played
    with pytest.raises(JobError, match=rf"^learn\.select: the query failed .*{message}") as err:
        rows(job, RELABEL.format(expert=expert))
    assert "\n" not in str(err.value)


def test_a_selection_without_turns_fails_before_training(played):
    _, root = played
    lake = root / "empty-select"
    shutil.copytree(root / "pristine", lake)
    job = job_for(root, lake=lake, **(SFT | {"select": "SELECT * FROM turns WHERE model_uid = 'kuhn-best'"}))
    with pytest.raises(JobError, match=r"key 'learn\.select' selects no turns in round\(s\) \[0\] of run 'sft'") as err:
        learn(job)
    assert "\n" not in str(err.value)
    assert Lake(str(lake)).table("checkpoints").rows(RUN) == [] and not (lake / "adapters").exists()
