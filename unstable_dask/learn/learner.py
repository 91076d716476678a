"""The learn job: one SQL query picks a batch, an algorithm updates the LoRA adapter, the lake
gets a new checkpoint.

Every batch of an iteration reads one snapshot of the lake (the Delta table versions taken when
the iteration is planned); learner_steps records those versions, so `learn --preview --at-version
<ckpt>` shows the very batch a checkpoint trained on.

Order of writes (every name carries this attempt's id):
  1. adapter (+ optimizer state, + critic for A2C) to <lake>/adapters/<run>/ckpt-<k>.<attempt>/
     via a temp dir
  2. learner_steps of iteration k, steps.<attempt>.parquet, and the role-advantage EMA's state
     after the window's newest round, baselines.<attempt>.parquet (files no commit names yet)
  3. the commit of iteration k (lake.commit_marker): claim `<run>/iteration=<k>` in the
     checkpoints log, add the steps and baselines files, publish the checkpoints row
A learn job killed before 3 leaves nothing visible and is simply run again (one killed inside 3
is finished by the next `plan`); two racing learners cannot both claim iteration k. A learn job
for a round already trained on (the newest checkpoint lists it) does nothing.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, cast

import pyarrow as pa

from unstable_dask.config import BASE_UID, Job
from unstable_dask.errors import JobError
from unstable_dask.inference.engine import Adapter, adapter_digest, check_adapter
from unstable_dask.lake import Lake
from unstable_dask.lake import storage as st
from unstable_dask.lake.catalog import LEARNER_STEPS
from unstable_dask.lake.commit import now
from unstable_dask.learn import algorithms, distributed
from unstable_dask.learn.ema import find_state
from unstable_dask.learn.guards import (
    check_exact_tokens,
    check_finite_advantages,
    check_finite_update,
    check_quantization,
    check_selection,
    served_weights,
)
from unstable_dask.learn.plan import Plan
from unstable_dask.learn.rewards import batch_query, run_batch_query, state_rows, window_rounds
from unstable_dask.learn.selection import run_selection, selection_query
from unstable_dask.learn.transforms import parse_transforms


@dataclass
class LearnResult:
    run_name: str
    iteration: int
    uid: str
    adapter_path: Optional[str]
    rounds: list[int]
    steps: list[dict] = field(default_factory=list)
    skipped: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of the iteration's phases (TIMINGS' keys; the steps' own time is sum(step_time_s))."""

    def __str__(self) -> str:
        if self.skipped:
            return (f"learn: nothing to do: {self.uid} trained on rounds {self.rounds} and no later committed round "
                    "has turns to train on")
        last = self.steps[-1] if self.steps else {}
        return (f"learn: {self.uid} (rounds {self.rounds}, {len(self.steps)} update(s), loss {last.get('loss', 0):.4f}, "
                f"{last.get('tokens_per_s', 0):.0f} tok/s) -> {self.adapter_path}")


# The phases of a learner iteration besides its optimizer steps (each update's step_time_s), in
# seconds; every one but commit is in each learner_steps row's `metrics` (`metrics['time_save_s']`),
# commit only in LearnResult.timings: the steps file is written as part of that commit.
TIMINGS = ("time_dispatch_s",     # submit to the task starting (a Dask task on a GPU worker; 0 in process)
           "time_model_load_s",   # base model + parent adapter and optimizer state (Trainer)
           "time_batch_query_s",  # the batch queries of all updates
           "time_save_s",         # the adapter written, hashed and moved into the lake
           "time_engine_swap_s",  # resident engines put to sleep and woken (single-GPU mode; 0 on CPU)
           "time_commit_s")       # learner_steps + baselines files and the checkpoint commit


def plan(job: Job, lake: Optional[Lake] = None) -> Optional[Plan]:
    """What the next learn job trains: None when the newest committed round is already trained on,
    or when the rounds after the parent's played no train games (samples algorithms).

    One snapshot of the lake answers everything (taken after finishing an iteration whose learner
    died mid-commit); its versions are the plan's, so every batch of the iteration reads it."""
    lake, run_name = lake or Lake(job.run.lake), job.run.name
    lake.finish_commits("checkpoints", run_name)
    committed = lake.rounds(run_name)
    if not committed:
        raise JobError(f"{job.source}: run '{run_name}' has no committed round in lake '{lake.uri}'; play a round first")
    ckpts = lake.table("checkpoints").rows(run_name, order_by="iteration")
    parent = ckpts[-1] if ckpts else None
    trained = max(parent["rounds_trained"] or [-1]) if parent else -1
    if trained >= committed[-1]:
        return None
    # "latest": every round the parent has not trained on (one in a lock-step loop; those the engines
    # played meanwhile in an overlapped one)
    rounds = window_rounds(committed, job.learn.window, trained)
    if algorithms.spec(job.learn.algorithm).rows != "selected":
        # An eval-only round (round.train_games = 0, e.g. a checkpoint's yardstick round) has no
        # samples: the next round of the newest checkpoint is trained on instead.
        with_train = set(lake.sql("SELECT DISTINCT round FROM games WHERE run = ? AND split = 'train'",
                                  [run_name]).column("round").to_pylist())
        rounds = [r for r in rounds if r in with_train]
        if not rounds:
            return None
    lineage = {BASE_UID: (0, None)} | {c["uid"]: (c["iteration"], c.get("adapter_sha256")) for c in ckpts}
    # Invariant: no update trains on samples more than learn.max_staleness iterations old (selected
    # rows, an expert's turns, were played by no checkpoint: any round of the window serves).
    newest = parent["iteration"] if parent else 0
    played = {r["round"]: r["checkpoint_uid"] for r in lake.table("rounds").rows(run_name)}
    fresh = [r for r in rounds if newest - lineage.get(played[r], (0, None))[0] <= job.learn.max_staleness
             or algorithms.spec(job.learn.algorithm).rows == "selected"]
    if not fresh:
        raise JobError(f"{job.source}: the rounds of learn.window {job.learn.window!r} ({rounds}) were played by "
                       f"checkpoints more than learn.max_staleness = {job.learn.max_staleness} iterations before "
                       f"{parent['uid'] if parent else BASE_UID}; play a round of the newest checkpoint first")
    k = (lake.last_claimed("checkpoints", run_name) or 0) + 1  # after a rollback, numbers are not reused
    adapter = lake.location(parent["adapter_path"]) if parent and parent["adapter_path"] else None
    versions = {t: v for t, v in lake.versions.items() if v is not None}
    return Plan(run_name, k, f"ckpt-{k}", parent["uid"] if parent else BASE_UID, adapter, fresh, versions,
                lineage=lineage)


def recorded_plan(job: Job, at: str) -> Plan:
    """The plan of an iteration already trained (`at`: its checkpoint uid or iteration number),
    from its learner_steps rows: rounds, batch seeds and the table versions it read."""
    lake, run_name = Lake(job.run.lake), job.run.name
    key = "iteration = ?" if at.isdigit() else "checkpoint_uid = ?"
    rows = lake.table("learner_steps").read(f"run = ? AND {key}", [run_name, int(at) if at.isdigit() else at]).to_pylist()
    if not rows:
        raise JobError(f"--at-version {at!r}: run '{run_name}' in lake '{lake.uri}' has no learner iteration with that "
                       "checkpoint uid or number (see: run sql \"SELECT iteration, uid FROM checkpoints\")")
    if any(r["table_versions"] is None for r in rows):
        raise JobError(f"--at-version {at!r}: learner_steps of {rows[0]['checkpoint_uid']} in lake '{lake.uri}' record "
                       "no table versions (trained before the lake kept them); its batch cannot be pinned")
    first = min(rows, key=lambda r: r["update"])
    return Plan(run_name, first["iteration"], first["checkpoint_uid"], "", None, list(first["rounds"]),
                {t: int(v) for t, v in json.loads(first["table_versions"]).items() if v is not None},
                {int(r["update"]): int(r["batch_seed"]) for r in rows})


def batch_seed(job: Job, iteration: int, update: int) -> int:
    blob = f"{job.run.seed}/{job.run.name}/{iteration}/{update}".encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:4], "little") >> 1


def build_query(job: Job, p: Plan, update: int = 0, con=None) -> str:
    """The batch query of one update: the job's transforms, the plan's window and seed, and the
    newest stored role-advantage state before the window that `con` (the plan's snapshot) holds."""
    cfg = job.learn
    seed = p.seeds[update] if update in p.seeds else batch_seed(job, p.iteration, update)
    if algorithms.spec(cfg.algorithm).rows == "selected":  # the job's SELECT of turns (SFT), no rewards
        return selection_query(p.run_name, p.rounds, cast(Any, cfg).select, cfg.batch_size, seed)
    final = parse_transforms(cfg.final_transforms, "final", con)
    step = parse_transforms(cfg.step_transforms, "step", con)
    spec = algorithms.spec(cfg.algorithm)
    # Sampling transforms on the rewards here, or by the update on its own advantages (A2C).
    sampling = parse_transforms(cfg.sampling_transforms, "sampling", con) if spec.sampling_on == "rewards" else []
    state = find_state(con, p.run_name, p.rounds, final) if con is not None else None
    return batch_query(p.run_name, p.rounds, cfg.batch_size, seed, final, step, sampling, unit=spec.unit, state=state)


def run_batch(con, job: Job, sql: str) -> pa.Table:
    """The rows of build_query's `sql`: learner turns with their advantages, or (Spec.rows
    "selected") the turns the job's SELECT picks."""
    if algorithms.spec(job.learn.algorithm).rows == "selected":
        return run_selection(con, sql)
    return run_batch_query(con, sql)


def resolve_device(job: Job) -> str:
    if job.learn.device != "auto":
        return job.learn.device
    from unstable_dask.cluster.client import task_resources, visible_gpus
    return "cuda" if task_resources(job.cluster) or visible_gpus() else "cpu"


def learn(job: Job, show_sql: bool = False, preview: bool = False, client=None,
          at_version: Optional[str] = None, update: int = 0) -> Union[LearnResult, str]:
    """Train the next checkpoint of job.run.name on its sampling window (the Python twin of `run learn`).

    show_sql: return the exact batch query of update `update`; preview: return the batch as text.
    at_version (a trained checkpoint's uid or iteration, with show_sql / preview): the batch that
    iteration trained on, read from the table versions it recorded.
    On a GPU cluster the update runs as a Dask task on a GPU=1 worker (`client`, or one opened
    from job.cluster); otherwise in this process.
    """
    if at_version is not None and not (show_sql or preview):
        raise JobError(f"--at-version {at_version!r} shows a batch already trained on: use it with --preview or --show-sql")
    lake = Lake(job.run.lake)
    p = plan(job, lake) if at_version is None else recorded_plan(job, at_version)
    if p is None:
        cks = lake.table("checkpoints").rows(job.run.name, order_by="iteration")
        ck = cks[-1] if cks else {"iteration": 0, "uid": BASE_UID, "adapter_path": None, "rounds_trained": []}
        if show_sql or preview:
            raise JobError(f"{job.source}: {ck['uid']} already trained on every committed round with train games; "
                           "nothing to show")
        return LearnResult(job.run.name, ck["iteration"], ck["uid"], ck["adapter_path"], ck["rounds_trained"] or [],
                           skipped=True)
    lake = lake.at(p.versions) if at_version is not None else lake  # the plan's snapshot either way
    con = lake.connect()
    try:
        sql = build_query(job, p, update, con)
        if show_sql:
            return sql
        check_exact_tokens(con, job, p)
        check_selection(con, job, p, sql)
        if preview:
            table = run_batch(con, job, sql)
            cols = ["round", "game_id", "turn", "pid", "env_id"] + (
                ["model_uid", "action"] if "advantage" not in table.column_names else
                ["env_reward", "final_reward", "step_reward", "advantage"])
            return table.select(cols).to_pandas().to_string(max_rows=40) + f"\n({table.num_rows} rows)"
    finally:
        con.close()
    device = resolve_device(job)
    check_quantization(job, device)
    if job.learn.devices > 1:  # data-parallel over that many workers, rank 0 commits (learn/distributed.py)
        return distributed.run(job, lake, p, device, _train, client)
    from unstable_dask.cluster.client import task_resources
    if device == "cuda" and task_resources(job.cluster, client):
        def submit(c):  # the GPU lives on a worker: run there, beside that worker's resident engine
            return c.submit(_train, job, lake, p, device, time.time(), resources={"GPU": 1}, pure=False,
                            key=f"learn-{p.run_name}-{p.uid}-{time.time_ns()}").result()
        if client is not None:
            return submit(client)
        from unstable_dask.cluster.client import open_client
        with open_client(job.cluster) as own:
            return submit(own)
    result = _train(job, lake, p, device)
    assert result is not None, "one process is rank 0"
    return result


def _train(job: Job, lake: Lake, p: Plan, device: str, submitted: Optional[float] = None) -> Optional[LearnResult]:
    """`submitted`: the wall-clock time the Dask task was submitted (its dispatch time is measured from it)."""
    import torch

    from unstable_dask.inference.engine import resident_engines
    from unstable_dask.learn.trainer import Trainer
    engines = resident_engines() if device == "cuda" else []
    swap: dict = {}
    timing = dict.fromkeys(TIMINGS, 0.0)
    timing["time_dispatch_s"] = max(time.time() - submitted, 0.0) if submitted is not None else 0.0
    if engines:  # single-GPU mode: free the engine's GPU memory for the update
        t = time.perf_counter()
        for e in engines:
            e.sleep()
        swap.update(engine_sleep_s=time.perf_counter() - t, cuda_free_engine_asleep=torch.cuda.mem_get_info()[0])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # cuda_mem_peak is the update's own, not the engine's generate
    try:
        t_load = time.perf_counter()
        parent = st.local_dir(p.parent_adapter) if p.parent_adapter else None
        if parent is not None:
            check_adapter(Adapter(p.parent_uid, parent))  # one line for a damaged folder, not a loader's traceback
        expected = p.lineage.get(p.parent_uid, (0, None))[1]
        if parent is not None and expected is not None and adapter_digest(parent) != expected:
            raise JobError(f"{p.parent_uid} of run '{p.run_name}': the adapter at {p.parent_adapter} is not the one its "
                           f"commit names (sha256 {adapter_digest(parent)[:12]}, committed {expected[:12]}); the lake's "
                           "adapters folder was changed by hand")
        trainer = Trainer(job, parent, torch.device(device))
        timing["time_model_load_s"] = time.perf_counter() - t_load
        steps = []
        for u in range(job.learn.updates_per_round):
            t_query = time.perf_counter()
            con = lake.connect()
            try:
                sql = build_query(job, p, u, con)
                batch = run_batch(con, job, sql)
                if batch.num_rows == 0:
                    raise JobError(f"{job.source}: no learner turns to train on in rounds {p.rounds} of run "
                                   f"'{p.run_name}' (learn.window, or games without learner seats)")
                seed = p.seeds.get(u, batch_seed(job, p.iteration, u))
                check_finite_advantages(job, p, seed, batch, con)
            finally:
                con.close()
            timing["time_batch_query_s"] += time.perf_counter() - t_query
            served = served_weights(job, p, batch)  # before the update: rows of other weights are never trained on
            # The first update starts from the parent's weights: rows it played must match the engine.
            m = trainer.update(batch, seed, guard_uid=p.parent_uid if u == 0 else None)
            check_finite_update(job, p, m, trainer)
            m.update(update=u, algorithm=job.learn.algorithm, checkpoint_uid=p.uid, batch_seed=seed, **served,
                     rounds=p.rounds, device=device, created_at=now(),
                     table_versions=json.dumps(p.versions, sort_keys=True), **_cuda_memory(device))
            steps.append(m)
        share = job.model.vllm.gpu_memory_utilization if engines else None  # what a waking engine takes again
        if not distributed.finished(trainer):  # every rank done, same weights; rank 0 alone saves and commits
            trainer.release(share)
            return None
        con = lake.connect()
        try:  # the EMA's state after the window, from the same games as its batches (learn/ema.py)
            baselines = state_rows(con, p.run_name, p.rounds, parse_transforms(job.learn.final_transforms, "final", con))
        finally:
            con.close()
        # The rows before the adapter: a metric that cannot be stored fails with nothing written.
        table = steps_table(steps, swap)
        # Attempt-named, like round files: a learner racing on the same iteration can never
        # replace the adapter or steps of the attempt that committed it.
        attempt = uuid.uuid4().hex[:8]
        rel = Lake.adapter_rel(p.run_name, p.uid, attempt)
        t_save = time.perf_counter()
        digest = _save_atomic(trainer, lake.location(rel))
        timing["time_save_s"] = time.perf_counter() - t_save
        trainer.release(share)  # the base stays for the next iteration where learn.resident allows
    finally:
        t = time.perf_counter()
        for e in engines:
            e.wake_up()
        if engines:
            swap["engine_wake_s"] = time.perf_counter() - t
    timing["time_engine_swap_s"] = swap.get("engine_sleep_s", 0.0) + swap.get("engine_wake_s", 0.0)
    for m in steps:  # the phases known only now, beside the steps' own metrics
        m.update({k: v for k, v in timing.items() if k != "time_commit_s"})
    table = steps_table(steps, swap)  # again: with the save time and the engine's wake
    t_commit = time.perf_counter()
    lake.write("learner_steps", p.run_name, p.iteration, f"steps.{attempt}", table)
    if baselines is not None:
        lake.write("baselines", p.run_name, p.iteration, f"baselines.{attempt}", baselines)
    try:
        lake.commit("checkpoints", p.run_name, p.iteration, "checkpoint", dict(
            attempt=attempt, uid=p.uid, parent_uid=p.parent_uid, adapter_path=rel, adapter_sha256=digest,
            base_model=job.model.base,
            rounds_trained=p.rounds, algorithm=job.learn.algorithm, created_at=now()))
    except FileExistsError:
        st.delete(lake.location(rel))
        raise JobError(f"{p.uid} of run '{p.run_name}' was committed by another learner while this one trained; "
                       "nothing of this attempt is visible") from None
    lake.remove_other_attempts("checkpoints", p.run_name, p.iteration, attempt)
    for stale in st.list_dir(lake.adapters_dir(p.run_name)):  # killed attempts' adapters
        if st.name(stale).startswith(f"{p.uid}.") and st.name(stale) != f"{p.uid}.{attempt}" and st.is_dir(stale):
            st.delete(stale)
    timing["time_commit_s"] = time.perf_counter() - t_commit
    return LearnResult(p.run_name, p.iteration, p.uid, rel, p.rounds, steps, timings=timing)


def steps_table(steps: list[dict], swap: dict) -> pa.Table:
    """learner_steps rows of an iteration's updates: a metric named like a column fills it, every
    other one (an algorithm's own) goes into the `metrics` map, so an algorithm adds metrics without
    touching the shared schema. `swap`: the engine's sleep/wake figures, shared by the updates."""
    columns = set(LEARNER_STEPS.names) - {"metrics"}
    rows = []
    for s in steps:
        own = {k: v for k, v in s.items() if k not in columns}
        bad = {k: v for k, v in own.items() if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))}
        if bad:  # a bug in the algorithm file, found before anything is written
            raise TypeError(f"learner_steps metrics must be numbers (or None); got {bad}")
        rows.append({k: s.get(k, swap.get(k)) for k in columns}
                    | {"metrics": [(k, None if v is None else float(v)) for k, v in sorted(own.items())]})
    return pa.Table.from_pylist(rows, schema=LEARNER_STEPS)


def _save_atomic(trainer, final: str) -> str:
    """Adapter dir saved under a temp name, then moved (renamed, or uploaded to an object store)
    to `final`, this attempt's own name: no reader sees half an adapter, since only the checkpoint
    commit after it names it. Returns the digest of its weights (inference.engine.adapter_digest)."""
    parent = Path(final).parent if not st.is_remote(final) else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{st.name(final)}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        trainer.save(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps({"updates": trainer.updates}))
        digest = adapter_digest(str(tmp))
        st.put_dir(tmp, final)
        return digest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cuda_memory(device: str) -> dict:
    if device != "cuda":
        return {}
    import torch
    return dict(cuda_mem_allocated=torch.cuda.memory_allocated(), cuda_mem_reserved=torch.cuda.memory_reserved(),
                cuda_mem_peak=torch.cuda.max_memory_allocated())
