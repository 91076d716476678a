"""The commands that chain stages: `loop` (round -> learn -> rate -> report, until the run has
`rounds` trained rounds) and `league` (pass -> rate -> pairing, until its ranking is separated).

Everything they need to know comes from the lake: the last committed round and whether the newest
checkpoint already trained on it; a league's committed passes and their ratings. A loop killed
anywhere and started again first finishes the learner iteration of a committed but untrained round,
then plays on: nothing is lost (committed rounds and checkpoints stay) and nothing is duplicated (a
round is committed once, a round already trained on is not trained again, an uncommitted round or
checkpoint is redone from scratch). A killed league plays its uncommitted pass again, the same games.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rich.console import Console

from unstable_dask.cluster.client import open_client, task_resources
from unstable_dask.config import Job
from unstable_dask.errors import JobError
from unstable_dask.lake import Lake
from unstable_dask.learn.guards import check_quantization
from unstable_dask.learn.learner import LearnResult, learn, plan, resolve_device
from unstable_dask.rate import ratings
from unstable_dask.rate.league import LeagueRatings, rate_league
from unstable_dask.report import report, strength, trackers


def _rate_and_report(job: Job, console: Console) -> dict[str, float]:
    """Both only read the lake; a failure here never loses a round or a checkpoint. Returns their seconds."""
    t0 = time.perf_counter()
    console.print(str(ratings.rate(job)), highlight=False)
    t1 = time.perf_counter()
    console.print(f"report: {report.report(job)}", highlight=False)
    return {"rate": t1 - t0, "report": time.perf_counter() - t1}


def breakdown(res: LearnResult, learn_s: float, round_s: Optional[float] = None,
              after: Optional[dict[str, float]] = None) -> str:
    """One line of where an iteration's seconds went: the round it trained on, the learner's phases
    (LearnResult.timings; steps: the updates' own step_time_s), rate and report."""
    t = res.timings
    steps = sum(s.get("step_time_s") or 0.0 for s in res.steps)
    parts = [f"load {t.get('time_model_load_s', 0):.1f}", f"query {t.get('time_batch_query_s', 0):.1f}",
             f"steps {steps:.1f}", f"save {t.get('time_save_s', 0):.1f}", f"commit {t.get('time_commit_s', 0):.1f}"]
    if t.get("time_dispatch_s"):
        parts.insert(0, f"dispatch {t['time_dispatch_s']:.1f}")
    if t.get("time_engine_swap_s"):
        parts.append(f"sleep/wake {t['time_engine_swap_s']:.1f}")
    line = f"iteration {res.iteration}: " + (f"round {round_s:.1f} s, " if round_s is not None else "")
    line += f"learn {learn_s:.1f} s ({', '.join(parts)})"
    return line + "".join(f", {k} {v:.1f} s" for k, v in (after or {}).items())


def _compact(job: Job, console: Console) -> None:
    """Merge the run's per-task files so reads stay one file per round and table. A loop killed
    before this only leaves more files for the next compaction, which takes the whole run."""
    from unstable_dask.lake.maintain import compact
    merged = compact(job.run.lake, run_name=job.run.name)
    console.print(f"compacted run {job.run.name}: {sum(r for r, _ in merged.values())} files into "
                  f"{sum(a for _, a in merged.values())}", highlight=False)


def _track(job: Job, console: Console) -> None:
    """Mirror the lake's new rows to the job's trackers (trackers.py)."""
    if not job.run.trackers:
        return
    try:
        logged = trackers.sync(job)
    except Exception as e:  # noqa: BLE001 -- a tracker outage must not stop training: the lake holds
        # everything, and `run track` (or the next sync) logs what this one missed, once.
        console.print(f"trackers: sync failed ({type(e).__name__}: {e}); the lake is intact, "
                      "run `python -m unstable_dask.run track` later", highlight=False)
        return
    console.print("trackers: " + ", ".join(f"{k} +{n} rows" for k, n in logged.items()), highlight=False)


def round_summary(job: Job, round_: int) -> list[str]:
    """What round `round_` says about learning: per split, player and opponent (the checkpoint that
    played it; in split baseline each agent of round.eval_baseline on the same eval games), win rate
    (draws half) and invalid-move rate with their Wilson 95% intervals (the report's query), and the
    share of drawn games; then, per eval opponent, the score of the learner and of each baseline agent
    pooled over the latest round.pool_rounds rounds, and the probes (report/strength.py) of this round
    and pooled."""
    con = Lake(job.run.lake).connect()
    try:
        curves = report.round_curves(con, job.run.name)
        counts = strength.probe_counts(con, job.run.name)
    finally:
        con.close()
    lines = []
    for r in (r for r in curves if r["round"] == round_):
        if r["opponent"] == "*":  # the sum of the split's opponent rows
            continue
        win = ("" if r["opponent"] == "self" else  # mirror self-play: 0.5 by construction
               f"win rate {r['win_rate']:.2f} [{r['win_rate_low']:.2f}, {r['win_rate_high']:.2f}], "
               # a perfect TicTacToe player draws every game against minimax: its win rate stays at 0.5
               + ("" if r["opponent"] == "solo" else f"draws {r['draws'] / (r['wins'] + r['draws'] + r['losses']):.2f}, "))
        invalid = ("" if r["invalid_rate"] is None else
                   f"invalid moves {r['invalid_rate']:.2f} [{r['invalid_rate_low']:.2f}, {r['invalid_rate_high']:.2f}]"
                   f" of {r['turns']} turns, format {r['format_success']:.2f} [{r['format_success_low']:.2f}, "
                   f"{r['format_success_high']:.2f}], {r['mean_completion_tokens']:.1f} tokens")
        who = f"{r['split']} {r['player']}" if r["split"] == "baseline" else r["split"]
        lines.append(f"  {who} vs {r['opponent']} ({r['games']} games): {win}{invalid}".rstrip(", "))
    window = strength.pool_window(curves, round_, job.round.pool_rounds)
    if round_ not in window:
        return lines
    pooled = strength.pooled(curves, window)
    for ev in (p for p in pooled if p["split"] == "eval" and p["opponent"] not in ("self", "solo")):
        beside = [f"{b['player']} {_score(b)}" for b in pooled if b["split"] == "baseline" and b["opponent"] == ev["opponent"]]
        lines.append(f"  eval vs {ev['opponent']} pooled over {strength.span(window)}: score {_score(ev)}"
                     + "".join(f"; {b}" for b in beside))
    now, pool = strength.probe_rows(counts, [round_]), strength.probe_rows(counts, window)
    for probe in strength.PROBES:
        parts = []
        for p in (p for p in pool if p["probe"] == probe):
            cur = next((c for c in now if (c["split"], c["player"], c["probe"]) == (p["split"], p["player"], probe)), None)
            parts.append(f"{p['player']} " + (f"{cur['rate']:.2f} of {cur['decisions']}, " if cur else "")
                         + f"pooled {p['rate']:.2f} [{p['low']:.2f}, {p['high']:.2f}] of {p['decisions']}")
        if parts:
            lines.append(f"  {probe} (round {round_}; pooled over {strength.span(window)}): " + "; ".join(parts))
    return lines


def _score(p: dict) -> str:
    draws = f", draws {p['draw_rate']:.2f}" if p["draws"] else ""
    return f"{p['score']:.2f} [{p['low']:.2f}, {p['high']:.2f}] ({p['games']} games{draws})"


def loop(job: Job, rounds: int, console: Optional[Console] = None, rate: bool = True) -> list:
    """Play and train until run `job.run.name` has `rounds` rounds (0 .. rounds-1), each trained on.

    `rounds` is the run's total, so re-running the same command after a kill finishes the job.
    With learn.max_staleness = k > 0 the next round plays while the learner trains, never with a
    checkpoint more than k iterations behind the one that will train on it (`_overlapped`).
    Returns the LearnResults of the learner iterations this call made.
    """
    if rounds < 1:
        raise JobError(f"{job.source}: --rounds must be >= 1, got {rounds}")
    console = console or Console(stderr=True)
    device = resolve_device(job)
    check_quantization(job, device)  # before the first round, not at the first update
    with open_client(job.cluster) as client:  # one cluster for the whole loop: engines stay resident
        if job.learn.max_staleness > 0 and device == "cuda" and task_resources(job.cluster, client):
            # The update runs on a GPU worker beside that worker's engine, which sleeps meanwhile.
            console.print(f"learn.max_staleness = {job.learn.max_staleness}: the learner shares a GPU with an engine, "
                          "which sleeps during updates, so nothing can play meanwhile; running lock-step",
                          highlight=False)
        elif job.learn.max_staleness > 0:
            return _overlapped(job, rounds, client, console, rate)
        return _lock_step(job, rounds, client, console, rate)


def _lock_step(job: Job, rounds: int, client, console: Console, rate: bool) -> list:
    """Round, learner iteration, round, ... The iteration's rate, report and tracker sync run in a
    background thread while the next round plays (they only read the lake and write their own
    tables and pages); the loop waits for them before anything after the round (its summary,
    compaction, the next iteration), so their failure stops the loop one round later with every
    committed round and checkpoint kept. A match-quality opponent pool reads the ratings: with it
    the round waits for them first."""
    from unstable_dask.play.round import play_round
    results = []
    round_s: Optional[float] = None
    with ThreadPoolExecutor(1, thread_name_prefix="rate") as background:
        pending: Optional[Future] = None
        while True:
            lake = Lake(job.run.lake)  # the lake as it is now: one snapshot for this step's decisions
            last = lake.last_round(job.run.name)
            if last is not None and plan(job, lake) is not None:  # committed but not yet trained on
                res, learn_s = _train(job, client, console)
                results.append(res)
                pending = background.submit(_after_learn, job, console, rate, res, learn_s, round_s)
                if _league_due(job, res):  # the league's report beside the run's: after the run's own
                    _settle(pending)
                    console.print(str(league(job, client, console)), highlight=False)
            played = 0 if last is None else last + 1
            if played >= rounds:
                _settle(pending)
                return results
            if job.round.opponents.strategy == "match-quality":
                _settle(pending)
            t = time.perf_counter()
            summary = play_round(job, client=client, console=console)
            round_s = time.perf_counter() - t
            _settle(pending)
            pending = None
            _after_round(job, summary, console)


def _overlapped(job: Job, rounds: int, client, console: Console, rate: bool) -> list:
    """Rounds and learner iterations at once, each in its own thread (the round's games run on the
    cluster, the update in this process or on a GPU worker). Every decision reads the lake: a round
    may start while at most k committed rounds are ahead of the newest checkpoint (`_ahead`); the
    learner trains whenever a committed round is untrained. Killed anywhere and restarted, it picks up from what the lake holds."""
    from unstable_dask.play.round import play_round
    k, run_name = job.learn.max_staleness, job.run.name
    results: list = []
    with ThreadPoolExecutor(2, thread_name_prefix="loop") as pool:
        playing: Optional[Future] = None
        training: Optional[Future] = None
        while True:
            lake = Lake(job.run.lake)
            last = lake.last_round(run_name)
            if training is None and last is not None and plan(job, lake) is not None:
                training = pool.submit(_learn, job, client, console, rate)
            upcoming = 0 if last is None else last + 1
            if playing is None and upcoming < rounds and _ahead(lake, run_name) <= k:
                playing = pool.submit(play_round, job, client, console)
            if playing is None and training is None:
                return results
            done, _ = wait([f for f in (playing, training) if f is not None], return_when=FIRST_COMPLETED)
            if playing in done:
                _after_round(job, playing.result(), console)
                playing = None
            if training in done:
                results.append(training.result())
                training = None


def _ahead(lake: Lake, run_name: str) -> int:
    """Committed rounds the newest checkpoint has not trained on. The next round plays the newest
    checkpoint, and a later iteration trains on it; with at most k rounds ahead, that iteration is at
    most k past the one that played it. Counted from the lake, not from round and iteration numbers,
    which drift apart after a rollback (numbers are never reused)."""
    ckpts = lake.table("checkpoints").rows(run_name, order_by="iteration")
    trained = max(ckpts[-1]["rounds_trained"] or [-1]) if ckpts else -1
    return sum(1 for r in lake.rounds(run_name) if r > trained)


def _learn(job: Job, client, console: Console, rate: bool):
    res, learn_s = _train(job, client, console)
    _after_learn(job, console, rate, res, learn_s)
    if _league_due(job, res):
        console.print(str(league(job, client, console)), highlight=False)
    return res


def _train(job: Job, client, console: Console) -> tuple:
    """The learner iteration and its wall seconds (dispatch included)."""
    t = time.perf_counter()
    res = learn(job, client=client)
    console.print(str(res))
    return res, time.perf_counter() - t


def _after_learn(job: Job, console: Console, rate: bool, res, learn_s: float, round_s: Optional[float] = None) -> None:
    """Rate, report, tracker sync, and the iteration's one-line breakdown."""
    after = _rate_and_report(job, console) if rate else {}
    _track(job, console)
    if isinstance(res, LearnResult) and not res.skipped:
        console.print(breakdown(res, learn_s, round_s, after), highlight=False)


def _league_due(job: Job, res) -> bool:
    return bool(job.league.every) and isinstance(res, LearnResult) and not res.skipped and res.iteration % job.league.every == 0


def _settle(pending: Optional[Future]) -> None:
    """Wait for the background rate and report; their error, if any, is raised here."""
    if pending is not None:
        pending.result()


def _after_round(job: Job, summary, console: Console) -> None:
    console.print(f"round {summary.round}: {summary.games} games, {summary.turns} turns "
                  f"({summary.checkpoint_uid}, {summary.tokens_per_s:.0f} tok/s"
                  + (f" on {summary.engine})" if summary.engine else ")"), highlight=False)
    for line in round_summary(job, summary.round):
        console.print(line, highlight=False)
    if job.run.compact_every and (summary.round + 1) % job.run.compact_every == 0:
        _compact(job, console)
    _track(job, console)


# ---------------------------------------------------------------- the league

@dataclass
class LeagueResult:
    league: str
    reason: str  # why it stopped: "separated" (every adjacent pair) or "budget"
    ratings: LeagueRatings  # after the last pass
    total: int  # games of the league in the lake
    passes: list = field(default_factory=list)  # RoundSummary of each pass this call played

    @property
    def games(self) -> int:
        """Games this call played."""
        return sum(p.games for p in self.passes)

    def __str__(self) -> str:
        why = "every adjacent pair is separated" if self.reason == "separated" else "the game budget is spent"
        return (f"league {self.league}: {len(self.passes)} pass(es), {self.games} games played now, {self.total} "
                f"in all; stopped: {why}")


def league(job: Job, client=None, console: Optional[Console] = None) -> LeagueResult:
    """Play the league of `job` ([league]) until every adjacent pair of its ranking is separated at
    league.confidence or its budget is spent; the Python twin of `run league`. Each pass is planned
    from the lake (play/league.py), played and committed like a round, then rated (rate/league.py);
    run again, it goes on from what the lake holds, and plays only games the lake lacks."""
    from unstable_dask.inference.weights import resolve_model
    from unstable_dask.play.league import plan_pass, resolve_entrants
    from unstable_dask.play.round import play_tasks
    from unstable_dask.play.schedule import check_envs
    console = console or Console(stderr=True)
    name = job.league_name
    if not job.ratings.bootstrap:
        raise JobError(f"{job.source}: key 'ratings.bootstrap' has value 0: a league separates its entrants by "
                       f"bootstrap resamples; set it to 100 or more")
    check_envs(job)  # everything a user can get wrong fails here, before a cluster starts or a file is written
    entrants = resolve_entrants(job, Lake(job.run.lake))
    for model in sorted({e.base_model for e in entrants if e.base_model}):
        try:
            resolve_model(model)  # builds a builtin once, not on every worker
        except JobError as e:
            raise JobError(f"{job.source}: key 'league.entrants' names base model {model!r}: "
                           f"{str(e).split(': ', 1)[-1]}") from None
    passes: list = []
    with contextlib.ExitStack() as stack:
        while True:
            lake = Lake(job.run.lake)
            lake.finish_commits("rounds", name)  # a pass whose driver died mid-commit
            rated = rate_league(job)
            step = plan_pass(job, Lake(job.run.lake))
            if not step.games:
                report.report(job)  # writes reports/<league>/ beside the run's page
                console.print(f"league report: {Path(job.run.reports) / name / 'index.html'}", highlight=False)
                return LeagueResult(name, step.reason, rated, step.played, passes)
            if client is None:
                client = stack.enter_context(open_client(job.cluster))
            last = lake.last_round(name)
            round_ = 0 if last is None else last + 1
            console.print(f"league {name} pass {round_} ({step.phase}): {len(step.games)} games of "
                          f"{len(step.pairs)} pairings; {step.played} played before", highlight=False)
            passes.append(play_tasks(job, lake, name, round_, step.tasks(job.round.games_per_task, round_), None,
                                     client, console))
