"""The round job: schedule a round's games, play them as Dask tasks, commit the round.

The driver alone writes the commit marker, after every task has written its files; until then
readers see nothing of the round. Each driver attempt names its files with an attempt id, and
the marker records the winning attempt: a killed round is simply run again (same game ids and
seeds), and a second driver racing on the same round can neither commit it twice nor change the
files of the attempt that won.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from distributed import Client, as_completed, get_worker
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from unstable_dask.cluster.client import open_client, task_resources
from unstable_dask.config import Job
from unstable_dask.errors import JobError
from unstable_dask.inference.endpoints import require_keys
from unstable_dask.inference.engine import resident_engines
from unstable_dask.inference.weights import resolve_model
from unstable_dask.lake import Lake
from unstable_dask.lake.commit import now
from unstable_dask.play.opponents import list_checkpoints
from unstable_dask.play.schedule import TaskSpec, check_envs, schedule_round
from unstable_dask.play.task import play_task

PROGRESS_TOPIC = "unstable_dask.progress"


@dataclass
class RoundSummary:
    run_name: str
    round: int
    checkpoint_uid: Optional[str]  # None: a league's pass
    games: int
    turns: int
    completion_tokens: int
    wall_s: float
    tasks: list[dict] = field(default_factory=list)
    lake: str = ""

    @property
    def in_flight_frac(self) -> Optional[float]:
        """Games in flight / round.concurrency, time-weighted over the tasks' wall time."""
        room = sum(t["concurrency"] * t["wall_s"] for t in self.tasks if "in_flight_s" in t)
        return sum(t["in_flight_s"] for t in self.tasks if "in_flight_s" in t) / room if room > 0 else None

    @property
    def prefix_cache_hit_rate(self) -> Optional[float]:
        """Prompt tokens the engines took from their prefix caches / prompt tokens (None: no cache)."""
        prompt = sum(t.get("prompt_tokens", 0) for t in self.tasks)
        return sum(t.get("cached_tokens", 0) for t in self.tasks) / prompt if prompt else None

    @property
    def engine(self) -> str:
        """The engines that played the round's model turns, e.g. "vllm 0.32.0 (cpu)" ("" if none)."""
        return ", ".join(sorted({e for t in self.tasks for e in t.get("engines", [])}))

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


@contextlib.contextmanager
def _in_job(job: Job):
    """Prefix a JobError raised below with the job file it came from."""
    try:
        yield
    except JobError as e:
        msg = str(e)
        raise JobError(msg if msg.startswith(job.source) else f"{job.source}: {msg}") from None


def _play_on_worker(task, model_cfg, round_cfg, lake, endpoints):
    """The Dask task: play, and stream progress to the driver as worker events (throttled)."""
    worker = get_worker()
    last = [0.0, 0, 0]  # time sent, games not yet sent, tokens sent

    def progress(games: int, tokens: int) -> None:
        last[1] += games
        now = time.monotonic()
        if now - last[0] > 0.5 or last[1]:
            # The worker's engines (model.backend "auto" picks one when it starts), for the progress line.
            engine = ", ".join(sorted({e.name for e in resident_engines()}))
            worker.log_event(PROGRESS_TOPIC, {"games": last[1], "tokens": tokens - last[2], "engine": engine})
            last[0], last[1], last[2] = now, 0, tokens

    return play_task(task, model_cfg, round_cfg, lake, progress, endpoints)


def play_round(job: Job, client: Optional[Client] = None, console: Optional[Console] = None) -> RoundSummary:
    """Play and commit the next round of `job.run.name`; the Python twin of `run round`."""
    lake, run_name = Lake(job.run.lake), job.run.name
    check_envs(job)
    with _in_job(job):
        resolve_model(job.model.base)  # a missing model fails here, not on every worker; builds builtins once
    lake.finish_commits("rounds", run_name)  # a round whose driver died mid-commit
    last = lake.last_round(run_name)
    round_ = 0 if last is None else last + 1
    checkpoints = list_checkpoints(lake, run_name)
    current = checkpoints[-1]
    tasks = schedule_round(job, lake, round_, current, checkpoints)
    return play_tasks(job, lake, run_name, round_, tasks, current.uid, client, console)


def play_tasks(job: Job, lake: Lake, run_name: str, round_: int, tasks: list[TaskSpec], checkpoint_uid: Optional[str],
               client: Optional[Client] = None, console: Optional[Console] = None) -> RoundSummary:
    """Play scheduled tasks on the cluster and commit them as round `round_` of `run_name` (a round,
    or a league's pass: `checkpoint_uid` None)."""
    console = console or Console(stderr=True)
    # Each attempt writes files of its own; only the attempt named by the commit marker is ever
    # visible, so a concurrent or killed driver can never change a committed round.
    attempt = uuid.uuid4().hex[:8]
    tasks = [dataclasses.replace(t, attempt=attempt) for t in tasks]
    require_keys(job, {s.source or "" for t in tasks for g in t.games for s in g.seats if s.plays == "endpoint"})
    started = now()
    t0 = time.perf_counter()
    n_games = sum(len(t.games) for t in tasks)
    with contextlib.ExitStack() as stack:
        if client is None:
            with _in_job(job):
                client = stack.enter_context(open_client(job.cluster))
        results = _run_tasks(client, job, lake, tasks, n_games, round_, checkpoint_uid or run_name, console)
        wall = time.perf_counter() - t0
        summary = RoundSummary(run_name, round_, checkpoint_uid, sum(r["games"] for r in results),
                               sum(r["turns"] for r in results), sum(r["completion_tokens"] for r in results),
                               wall, results, lake.uri)
        # Committed before the cluster we started is torn down: a shutdown that hangs or fails
        # must not lose a round that is fully played.
        _commit(job, lake, summary, attempt, len(tasks), started)
        teardown = stack.pop_all()
    try:
        teardown.close()
    except Exception as e:  # noqa: BLE001 - any failure to shut down, after the round is safe
        console.print(f"warning: round {round_} of run {run_name!r} is committed, but shutting its cluster down "
                      f"failed ({type(e).__name__}: {e}); check for leftover worker processes", highlight=False)
    return summary


def _commit(job: Job, lake: Lake, s: RoundSummary, attempt: str, tasks: int, started) -> None:
    try:
        lake.commit_round(s.run_name, s.round, dict(
            attempt=attempt, checkpoint_uid=s.checkpoint_uid, games=s.games, turns=s.turns, tasks=tasks,
            engine=s.engine or None, in_flight_frac=s.in_flight_frac, prefix_cache_hit_rate=s.prefix_cache_hit_rate,
            completion_tokens=s.completion_tokens, temperature=job.model.temperature, top_p=job.model.top_p,
            max_new_tokens=job.model.max_new_tokens, job_fingerprint=job.fingerprint(),
            job=json.dumps(job.model_dump(mode="json"), sort_keys=True), started_at=started, committed_at=now()))
    except FileExistsError:
        raise JobError(f"round {s.round} of run {s.run_name!r} was committed by another driver while this one played; "
                       f"nothing of this attempt is visible; run the command again for round {s.round + 1}") from None
    lake.remove_other_attempts("rounds", s.run_name, s.round, attempt)


def _run_tasks(client: Client, job: Job, lake: Lake, tasks, n_games: int, round_: int, label: str,
               console: Console) -> list[dict]:
    lock = threading.Lock()
    counts = {"games": 0, "tokens": 0}
    t0 = time.perf_counter()
    with Progress(TextColumn("[bold]round {task.fields[round]}[/bold] {task.fields[ckpt]}"), BarColumn(),
                  MofNCompleteColumn(), TextColumn("games  {task.fields[tps]:.0f} tok/s  {task.fields[engine]}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        tid = bar.add_task("play", total=n_games, round=round_, ckpt=label, tps=0.0, engine="")
        engines: set[str] = set()

        def on_event(event) -> None:
            _, msg = event
            with lock:
                counts["games"] += msg["games"]
                counts["tokens"] += msg["tokens"]
                engines.update(e for e in msg.get("engine", "").split(", ") if e)
                bar.update(tid, completed=min(counts["games"], n_games), engine=", ".join(sorted(engines)),
                           tps=counts["tokens"] / max(time.perf_counter() - t0, 1e-9))

        resources = task_resources(job.cluster, client)
        client.subscribe_topic(PROGRESS_TOPIC, on_event)
        try:
            futures = [client.submit(_play_on_worker, t, job.model, job.round, lake, job.endpoints, pure=False,
                                     key=f"play-{t.run_name}-r{t.round}-{t.key}-{time.time_ns()}",
                                     resources=resources, retries=2)
                       for t in tasks]
            # Take each result as soon as its task ends and release it: a worker retiring at its
            # --lifetime then holds no results, so its retirement stays graceful even when no
            # other worker is up (results left on it would be lost and recomputed).
            index = {f.key: i for i, f in enumerate(futures)}
            results: list[dict] = [{}] * len(futures)
            for fut in as_completed(futures):
                results[index[fut.key]] = fut.result()
                fut.release()
        finally:
            client.unsubscribe_topic(PROGRESS_TOPIC)
        bar.update(tid, completed=n_games,
                   tps=sum(r["completion_tokens"] for r in results) / max(time.perf_counter() - t0, 1e-9))
    return results


def round_stats(lake: Lake, run_name: str, round_: int) -> list[dict]:
    """Per model and split: games, W/D/L, format success, invalid-move rate (from the lake)."""
    return lake.sql("""
        WITH s AS (
            SELECT split, model_uid, game_id, reward,
                   max(reward) OVER (PARTITION BY game_id) AS best,
                   min(reward) OVER (PARTITION BY game_id) AS worst
            FROM seats WHERE run = ? AND round = ?),
        t AS (
            SELECT split, model_uid, avg(format_ok::INT) AS format_ok, avg(invalid_move::INT) AS invalid_move,
                   avg(completion_tokens) AS completion_tokens
            FROM turns WHERE run = ? AND round = ? GROUP BY ALL)
        SELECT s.split, s.model_uid, count(DISTINCT s.game_id) AS games,
               sum((s.reward = s.best AND s.best > s.worst)::INT) AS wins,
               sum((s.best = s.worst)::INT) AS draws,
               sum((s.reward < s.best)::INT) AS losses,
               any_value(t.format_ok) AS format_ok, any_value(t.invalid_move) AS invalid_rate,
               any_value(t.completion_tokens) AS mean_tokens
        FROM s LEFT JOIN t USING (split, model_uid)
        GROUP BY ALL ORDER BY s.split DESC, s.model_uid""", [run_name, round_, run_name, round_]).to_pylist()
