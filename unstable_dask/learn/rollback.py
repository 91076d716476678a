"""`run rollback`: a run goes on from an earlier checkpoint."""
from __future__ import annotations

from dataclasses import dataclass

from unstable_dask.config import BASE_UID, Job
from unstable_dask.errors import JobError
from unstable_dask.lake import Lake


@dataclass
class Rollback:
    run_name: str
    to: str
    checkpoints: list[str]
    rounds: list[int]
    next_round: int  # retired numbers stay claimed: `loop --rounds N` plays up to round N-1 from here

    def __str__(self) -> str:
        return (f"rollback: run '{self.run_name}' goes on from {self.to}; retired {', '.join(self.checkpoints)} and the "
                f"round(s) they played {self.rounds} (the rounds {self.to} played stay); its next round is "
                f"{self.next_round} (numbers are not reused: `loop --rounds` counts them, so play on with "
                f"--rounds {self.next_round + 1} or more)")


def rollback(job: Job, to: str) -> Rollback:
    """Retire every checkpoint of the run newer than `to` (a checkpoint uid, or "base") and every round
    those checkpoints played, so the run goes on from `to`: the next learn trains `to` again on the
    rounds it played and the next round plays it. Numbers are not reused (ckpt-k and round r of the
    retired ones stay claimed in the log); `run vacuum` removes their adapter folders once older than its
    retention."""
    lake, run_name = Lake(job.run.lake), job.run.name
    ckpts = lake.table("checkpoints").rows(run_name, order_by="iteration")
    by_uid = {BASE_UID: 0} | {c["uid"]: c["iteration"] for c in ckpts}
    if to not in by_uid:
        raise JobError(f"--to {to!r}: run '{run_name}' in lake '{lake.uri}' has no such checkpoint "
                       f"(its checkpoints: {', '.join(by_uid)})")
    retired = [c["uid"] for c in ckpts if c["iteration"] > by_uid[to]]
    if not retired:
        raise JobError(f"--to {to!r}: it is the newest checkpoint of run '{run_name}'; nothing to roll back")
    rounds = [r["round"] for r in lake.table("rounds").rows(run_name) if r["checkpoint_uid"] in retired]
    lake.retire("rounds", run_name, rounds)  # the rounds first: no learner may train on them meanwhile
    lake.retire("checkpoints", run_name, [by_uid[u] for u in retired])
    last = Lake(job.run.lake).last_round(run_name)
    return Rollback(run_name, to, retired, sorted(rounds), 0 if last is None else last + 1)
