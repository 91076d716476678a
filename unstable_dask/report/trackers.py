"""Mirror a run's lake to experiment trackers (W&B, MLflow): `[run] trackers = ["wandb", "mlflow"]`.

The tracker is a copy, never a source: every number is read from the committed lake, so a sync can
run from any machine that sees the lake (`loop` syncs after each commit; `run track` by hand).
Three series, each with its own step, since they grow at different times:

* `round` (step: the round): the `rounds` commit row (games, turns, tokens, wall time) and the
  learning-curve rows of `run report --show-sql` per split and opponent, as
  `round/<split>/<opponent>/<column>` (opponent `all` = every game of the split).
* `rated_round` (step: the round, once `run rate` has rated it): `rating/{mu,sigma,conservative}`
  of the checkpoint that played the round and `trueskill/<model>/mu` of every model, from
  `rating_history` (env `*`).
* `learner_step` (step: the update's ordinal over (iteration, update)): every numeric
  `learner_steps` column as `learner/<column>`.

Idempotent, with the state kept in the tracker itself: the run is found again by name (W&B:
id = the lake run name with resume="allow"; MLflow: the run tagged `unstable_dask.run = <name>`),
and a row is logged only when its step is past the last step the tracker already holds for that
series (W&B: the resumed run's summary, or the earlier offline run files of the same id in offline
mode; MLflow: the series' metric history). Each row is one log call that ends with its step, so a
sync killed halfway is finished by the next one without a duplicate.
W&B reads WANDB_PROJECT / WANDB_ENTITY / WANDB_MODE / WANDB_DIR, MLflow MLFLOW_TRACKING_URI /
MLFLOW_EXPERIMENT_NAME; the project / experiment defaults to "unstable_dask".
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

from unstable_dask.config import LEGAL_RANDOM_UID, Job
from unstable_dask.errors import JobError
from unstable_dask.lake import Lake
from unstable_dask.report import report

PROJECT = "unstable_dask"
TAG = "unstable_dask.run"
SERIES = {"round": "round/", "rated_round": "rating/", "learner_step": "learner/"}  # step key -> key prefix
ROUND_COLUMNS = ("games", "wins", "draws", "losses", "win_rate", "win_rate_low", "win_rate_high", "turns",
                 "format_success", "format_success_low", "format_success_high", "invalid_rate", "invalid_rate_low",
                 "invalid_rate_high", "mean_completion_tokens", "mean_reward", "game_length")


def _key(text: str) -> str:
    """A metric name both trackers accept (MLflow allows letters, digits and _-. /:)."""
    return re.sub(r"[^A-Za-z0-9_\-. /:]", "_", text)


def _clean(row: dict) -> dict:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


def lake_series(lake: Lake, run_name: str) -> dict[str, list[dict]]:
    """The rows a tracker mirrors, per series, in step order; each row holds its step key."""
    con = lake.connect()
    try:
        def rows(sql: str) -> list[dict]:
            return con.sql(sql, params=[run_name]).to_arrow_table().to_pylist()
        commits = rows("""SELECT round, checkpoint_uid, games, turns, tasks, completion_tokens,
                              epoch(committed_at) - epoch(started_at) AS wall_s FROM rounds WHERE run = ? ORDER BY round""")
        curves = report.round_curves(con, run_name)
        history = rows("""SELECT round, model_uid, mu, sigma, conservative FROM rating_history
                          WHERE run = ? AND env_id = '*' ORDER BY round, model_uid""")
        cols = report.learner_columns(con)
        quoted = ", ".join(f"{expr} AS {report.quote_ident(c)}" for c, expr in cols.items())
        steps = rows(f"""SELECT iteration, {quoted} FROM learner_steps WHERE run = ? ORDER BY iteration, "update" """)
    finally:
        con.close()
    by_round: dict[int, dict] = {}
    for c in commits:
        tps = c["completion_tokens"] / c["wall_s"] if c["wall_s"] else None
        by_round[c["round"]] = _clean({"round/games": c["games"], "round/turns": c["turns"], "round/tasks": c["tasks"],
                                       "round/completion_tokens": c["completion_tokens"], "round/wall_s": c["wall_s"],
                                       "round/tokens_per_s": tps}) | {"round": c["round"]}
    for r in curves:
        opponent = "all" if r["opponent"] == "*" else r["opponent"]
        # one baseline split per agent of round.eval_baseline; legal-random's keeps its first name
        split = r["split"] if r["split"] != "baseline" or r["player"] == LEGAL_RANDOM_UID else f"baseline-{r['player']}"
        prefix = _key(f"round/{split}/{opponent}/")
        by_round[r["round"]].update(_clean({prefix + k: r[k] for k in ROUND_COLUMNS}))
    played = {c["round"]: c["checkpoint_uid"] for c in commits}
    rated: dict[int, dict] = {}
    for h in history:
        row = rated.setdefault(h["round"], {})
        row[_key(f"rating/trueskill/{h['model_uid']}/mu")] = h["mu"]
        if h["model_uid"] == played.get(h["round"]):
            row.update({"rating/mu": h["mu"], "rating/sigma": h["sigma"], "rating/conservative": h["conservative"]})
    learner = [_clean({f"learner/{c}": s[c] for c in ["iteration", *cols]}) | {"learner_step": k}
               for k, s in enumerate(steps)]
    return {"round": [by_round[r] for r in sorted(by_round)],
            "rated_round": [_clean(rated[r]) | {"rated_round": r} for r in sorted(rated)],
            "learner_step": learner}


# ---------------------------------------------------------------- W&B

def wandb_records(path: Path) -> Iterator:
    """The protobuf records of a W&B run file (`run-<id>.wandb`), in order.

    wandb (0.31) ships no Python reader for its own run files, which hold what an offline run
    logged: they are a LevelDB-style log (7-byte header, 32 KiB blocks, records split into
    FULL/FIRST/MIDDLE/LAST chunks behind a 7-byte chunk header) of `wandb_internal_pb2.Record`.
    A torn tail (a killed writer) ends the iteration; chunk checksums are not verified.
    """
    from wandb.proto import wandb_internal_pb2 as pb
    data, block, pos, buf = path.read_bytes(), 32768, 7, b""
    if data[:4] != b":W&B":
        raise JobError(f"{path}: not a W&B run file")
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            return
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()  # type: ignore[attr-defined]
            rec.ParseFromString(buf)
            yield rec


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a W&B run file, as {key: value}."""
    return [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
            for rec in wandb_records(path) if rec.WhichOneof("record_type") == "history"]


class _Wandb:
    def __init__(self, job: Job):
        import wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), id=job.run.name, name=job.run.name,
                              resume="allow", config=job.model_dump(mode="json"),
                              # read per sync: wandb keeps the WANDB_DIR of its first init in the process
                              dir=os.environ.get("WANDB_DIR"),
                              # offline folders are named by the second: two syncs in one must not share one
                              settings=wandb.Settings(silent=True, console="off", x_sync_dir_suffix=uuid.uuid4().hex[:8]))
        for step, prefix in SERIES.items():
            self.run.define_metric(step, hidden=True)
            self.run.define_metric(f"{prefix}*", step_metric=step)
        self.next_step = self.run.step
        self.done = {s: int(self.run.summary.get(s)) for s in SERIES if self.run.summary.get(s) is not None}  # restored on resume
        if self.run.settings._offline:
            # Offline runs never resume: each sync writes a new offline-run-*-<id> folder. What the
            # earlier ones logged is read back from them (`wandb sync` uploads them all to this id).
            mine = Path(self.run.settings.sync_file).resolve()
            for f in Path(self.run.settings.sync_dir).parent.glob(f"offline-run-*/run-{job.run.name}.wandb"):
                if f.resolve() == mine:
                    continue
                for row in wandb_history(f):
                    self.next_step = max(self.next_step, int(row.get("_step", -1)) + 1)
                    for s in SERIES:
                        if s in row:
                            self.done[s] = max(self.done.get(s, -1), int(row[s]))

    def logged(self) -> dict[str, int]:
        return dict(self.done)

    def log(self, series: str, row: dict) -> None:
        # explicit, increasing global steps: offline folders synced later must not reuse them
        self.run.log(row, step=self.next_step)
        self.next_step += 1

    def close(self) -> None:
        self.run.finish()


# ---------------------------------------------------------------- MLflow

class _Mlflow:
    def __init__(self, job: Job):
        from mlflow import MlflowClient
        self.client = MlflowClient()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        # The run name matches ^[A-Za-z0-9][A-Za-z0-9_.-]*$ (config.RunConfig): safe inside the quotes.
        found = self.client.search_runs([exp_id], filter_string=f"tags.`{TAG}` = '{job.run.name}'",
                                        order_by=["attributes.start_time ASC"], max_results=1)
        self.run_id = (found[0] if found else self.client.create_run(
            exp_id, run_name=job.run.name, tags={TAG: job.run.name})).info.run_id

    def logged(self) -> dict[str, int]:
        return {s: max((m.step for m in self.client.get_metric_history(self.run_id, s)), default=-1) for s in SERIES}

    def log(self, series: str, row: dict) -> None:
        from mlflow.entities import Metric
        now, step = int(time.time() * 1000), int(row[series])
        # log_batch takes at most 1000 metrics: a larger row goes in several batches, the step key
        # last, so the row counts as logged only once all of it is (a sync killed between two
        # batches of one row logs that row's first batches again; one batch is atomic).
        items = [(k, v) for k, v in row.items() if k != series] + [(series, row[series])]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in items[i:i + 1000]])

    def close(self) -> None:
        pass  # the run stays open for the next sync


TRACKERS: dict[str, Any] = {"wandb": _Wandb, "mlflow": _Mlflow}


def sync(job: Job, trackers: Optional[list[str]] = None) -> dict[str, int]:
    """Log to each tracker (default: job.run.trackers) the lake rows it does not hold yet; rows logged, per tracker."""
    series = lake_series(Lake(job.run.lake), job.run.name)
    out = {}
    for name in trackers if trackers is not None else job.run.trackers:
        tracker = TRACKERS[name](job)
        try:
            done, n = tracker.logged(), 0
            for step, rows in series.items():
                for row in rows:
                    if row[step] > done.get(step, -1):
                        tracker.log(step, row)
                        n += 1
            out[name] = n
        finally:
            tracker.close()
    return out
