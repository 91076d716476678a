"""What the learner refuses: each check stops the job with one sentence before a batch is trained on
or an update becomes a checkpoint (the learner's order: tokens, device, advantages, served weights,
the update itself)."""
from __future__ import annotations

import importlib.util
from typing import Any

import duckdb
import pyarrow as pa

from unstable_dask.config import BASE_UID, EXPERT_UIDS, Job
from unstable_dask.errors import JobError
from unstable_dask.learn import algorithms
from unstable_dask.learn.ema import find_state
from unstable_dask.learn.plan import Plan
from unstable_dask.learn.rewards import batch_query, run_batch_query
from unstable_dask.learn.selection import run_selection
from unstable_dask.learn.transforms import parse_transforms


def check_exact_tokens(con: duckdb.DuckDBPyConnection, job: Job, p: Plan) -> None:
    """The learner trains on the ids the engine generated, under the round's sampling settings:
    rounds played before the lake recorded them (completion_token_ids, group_id, the commit row's
    temperature / top_p) cannot be trained on exactly, so they are refused, not approximated.
    Selected rows (Spec.rows "selected", SFT) are rendered, not the engine's: nothing to check."""
    if _selected(job):
        return
    rounds = ", ".join(str(int(r)) for r in p.rounds)
    try:
        old = con.execute(f"""SELECT DISTINCT round FROM turns WHERE run = ? AND round IN ({rounds}) AND split = 'train'
            AND is_learner AND prompt_tokens > 0 AND (completion_token_ids IS NULL OR group_id IS NULL)
            UNION SELECT round FROM rounds WHERE run = ? AND round IN ({rounds})
            AND (temperature IS NULL OR top_p IS NULL) ORDER BY 1""", [p.run_name, p.run_name]).fetchall()
    except duckdb.BinderException:  # no file of the lake has the columns yet
        old = [(r,) for r in p.rounds]
    if old:
        raise JobError(f"{job.source}: round(s) {[r for (r,) in old]} of run '{p.run_name}' in lake '{job.run.lake}' were "
                       "played before the lake recorded exact token ids and sampling settings "
                       "(turns.completion_token_ids, rounds.temperature); the learner trains only on those: "
                       "play new rounds (learn.window) or start a new run")



def _selected(job: Job) -> bool:
    """The algorithm trains on rendered turns the job selects (SFT), not on the engine's samples."""
    return algorithms.spec(job.learn.algorithm).rows == "selected"


def check_selection(con: duckdb.DuckDBPyConnection, job: Job, p: Plan, sql: str) -> None:
    """An algorithm of selected rows (SFT) has turns to train on, said before a model is loaded."""
    if not _selected(job) or run_selection(con, sql).num_rows:
        return
    raise JobError(f"{job.source}: key 'learn.select' selects no turns in round(s) {p.rounds} of run '{p.run_name}' "
                   f"in lake '{job.run.lake}'; the default takes the turns of expert seats "
                   f"({', '.join(EXPERT_UIDS)}) outside eval games: seat an expert (round.opponents, or eval "
                   "opponents with round.eval_baseline) or select other turns; nothing was trained")


def check_quantization(job: Job, device: str) -> None:
    """A 4/8-bit learner needs CUDA and bitsandbytes: say so before a round or an update is spent."""
    q = job.learn.quantization
    if q == "none":
        return
    where = f"{job.source}: key 'learn.quantization' has value {q!r}"
    if device != "cuda":
        raise JobError(f"{where}: 4/8-bit learners need a CUDA GPU (bitsandbytes) and this learner runs on {device} "
                       f"(learn.device = {job.learn.device!r}); use 'none' on CPU")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise JobError(f"{where}: the bitsandbytes package is not installed: pip install 'unstable-dask[quantization]'")



def check_finite_advantages(job: Job, p: Plan, seed: int, batch: pa.Table, con: duckdb.DuckDBPyConnection) -> None:
    """A non-finite or NULL advantage (a transform dividing by zero, a NULL it produced) never
    reaches the optimizer: one line naming the first transform whose output has one (the batch
    drawn again with `seed`, the pipelines cut after each transform in turn). Selected rows have none."""
    import math
    if _selected(job):
        return
    bad = [(a, r) for a, r in zip(batch.column("advantage").to_pylist(), batch.to_pylist())
           if a is None or not math.isfinite(a)]
    if not bad:
        return
    value, row = bad[0]
    where = f"turn {row['turn']} of game {row['game_id']} (round {row['round']})"
    cfg, spec = job.learn, algorithms.spec(job.learn.algorithm)
    stages = {"final": cfg.final_transforms, "step": cfg.step_transforms,
              "sampling": cfg.sampling_transforms if spec.sampling_on == "rewards" else []}
    parsed = {s: parse_transforms(t, s, con) for s, t in stages.items()}
    upto: dict[str, list] = {s: [] for s in stages}
    for stage, transforms in parsed.items():  # the pipelines up to each transform in turn
        for i, t in enumerate(transforms):
            upto[stage].append(t)
            sql = batch_query(p.run_name, p.rounds, cfg.batch_size, seed, upto["final"], upto["step"], upto["sampling"],
                              unit=spec.unit, state=find_state(con, p.run_name, p.rounds, upto["final"]))
            values = run_batch_query(con, sql).column("advantage").to_pylist()
            if any(v is None or not math.isfinite(v) for v in values):
                raise JobError(f"{job.source}: key 'learn.{stage}_transforms[{i}]' has value {stages[stage][i]!r}: it "
                               f"gives a {'NULL' if value is None else value} reward (first at {where}); nothing "
                               "was trained or committed")
    raise JobError(f"{job.source}: the reward transforms give a {'NULL' if value is None else value} advantage at "
                   f"{where}; nothing was trained or committed")



def check_finite_update(job: Job, p: Plan, metrics: dict, trainer: Any) -> None:
    """A non-finite loss, gradient or weight, the policy's or the critic's (A2C), never becomes a
    checkpoint."""
    import math

    import torch
    bad = [k for k in ("loss", "grad_norm", "critic_grad_norm", "value_loss")
           if metrics.get(k) is not None and not math.isfinite(metrics[k])]
    models = {"": trainer.policy} | ({"critic.": trainer.critic} if getattr(trainer, "critic", None) is not None else {})
    weights = [prefix + n for prefix, model in models.items() for n, w in model.named_parameters()
               if w.requires_grad and not bool(torch.isfinite(w).all())]
    if bad or weights:
        what = ", ".join(f"{k} {metrics[k]}" for k in bad) or f"non-finite weights ({weights[0]}...)"
        raise JobError(f"{job.source}: the update of {p.uid} of run '{p.run_name}' gave {what}; nothing is committed "
                       f"(learn.lr = {job.learn.lr:g}, learn.grad_clip = {job.learn.grad_clip:g}: lower them, or check "
                       "the reward transforms)")



def served_weights(job: Job, p: Plan, batch: pa.Table) -> dict:
    """Check that every row was played by the weights its checkpoint names (turns.adapter_sha256 vs
    checkpoints.adapter_sha256: an engine that kept serving an old adapter is an error, never trained
    on) and measure how stale the rows are (learner_steps.staleness_*). Selected rows (SFT) were
    played by no checkpoint: neither applies."""
    if _selected(job):
        return {}
    parent = p.lineage.get(p.parent_uid, (0, None))[0]
    ages = []
    for r, g, t, uid, sha in zip(*(batch.column(c).to_pylist() for c in
                                   ("round", "game_id", "turn", "model_uid", "adapter_sha256"))):
        iteration, committed = p.lineage.get(uid, (None, None))
        if iteration is None:
            raise JobError(f"turn {t} of game {g} (round {r}) of run '{p.run_name}' was played by {uid!r}, which is "
                           "not a checkpoint of the run")
        if uid == BASE_UID and sha is not None:  # the base model is served without an adapter
            raise JobError(f"turn {t} of game {g} (round {r}) of run '{p.run_name}' was played by adapter weights "
                           f"{sha[:12]}, but its checkpoint is {BASE_UID!r}, the base model without an adapter: the "
                           "engine served other weights than the checkpoint the round names; nothing of it is "
                           "trained on")
        if committed is not None and sha != committed:
            served = f"adapter weights {sha[:12]}" if sha else "the base model"
            raise JobError(f"turn {t} of game {g} (round {r}) of run '{p.run_name}' was played by {served}, but its "
                           f"checkpoint {uid} committed {committed[:12]}: the engine served other weights than the "
                           "checkpoint the round names; nothing of it is trained on")
        ages.append(parent - iteration)
    if ages and max(ages) > job.learn.max_staleness:
        raise JobError(f"{job.source}: the batch holds samples {max(ages)} learner iterations old, more than "
                       f"learn.max_staleness = {job.learn.max_staleness}")
    return dict(staleness_max=max(ages, default=0), staleness_mean=sum(ages) / len(ages) if ages else None)
