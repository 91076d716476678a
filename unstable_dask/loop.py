"""The loop job: round -> learn -> rate -> report, until the run has `rounds` trained rounds.

Everything it needs to know comes from the lake: the last committed round and whether the newest
checkpoint already trained on it. A loop killed anywhere and started again first finishes the
learner iteration of a committed but untrained round, then plays on: nothing is lost (committed
rounds and checkpoints stay) and nothing is duplicated (a round is committed once, a round already
trained on is not trained again, an uncommitted round or checkpoint is redone from scratch).
"""
from __future__ import annotations

from typing import Optional

from rich.console import Console

from . import lake as lk, ratings, report
from .cluster import open_client
from .config import Job, JobError
from .learn import learn, plan


def _rate_and_report(job: Job, console: Console) -> None:
    """Both only read the lake; a failure here never loses a round or a checkpoint."""
    console.print(str(ratings.rate(job)), highlight=False)
    console.print(f"report: {report.report(job)}", highlight=False)


def loop(job: Job, rounds: int, console: Optional[Console] = None, rate: bool = True) -> list:
    """Play and train until run `job.run.name` has `rounds` rounds (0 .. rounds-1), each trained on.

    `rounds` is the run's total, so re-running the same command after a kill finishes the job.
    Returns the LearnResults of the learner iterations this call made.
    """
    from .round import play_round
    if rounds < 1:
        raise JobError(f"{job.source}: --rounds must be >= 1, got {rounds}")
    console = console or Console(stderr=True)
    lake, run = job.run.lake, job.run.name
    results = []
    with open_client(job.cluster) as client:  # one cluster for the whole loop: engines stay resident
        while True:
            last = lk.last_committed_round(lake, run)
            if last is not None and plan(job) is not None:  # committed but not yet trained on
                res = learn(job, client=client)
                console.print(str(res))
                results.append(res)
                if rate:
                    _rate_and_report(job, console)
            played = 0 if last is None else last + 1
            if played >= rounds:
                return results
            summary = play_round(job, client=client, console=console)
            console.print(f"round {summary.round}: {summary.games} games, {summary.turns} turns "
                          f"({summary.checkpoint_uid}, {summary.tokens_per_s:.0f} tok/s)")
