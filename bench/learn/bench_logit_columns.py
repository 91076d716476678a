"""The learner's LM head at the scored positions only, against the span it covered before: seconds an
update, on the batches a checkpoint of a real run trained on.

A micro-batch's rows end at different positions, so their completion tokens lie at different
positions; the loss needs logits only where some row has a token to score (passes.forward's
columns). Before, the LM head ran over the whole span from the earliest such position to the end of
the longest row: with a seat's turns in one micro-batch (learn.share_prefix orders them so), that
span holds the prompt tails of the shorter rows. Two learners of the same job update on the very
batches iteration `--at` of `--run` drew from `--lake`, in turn (A B A B) so the machine's drift hits
both alike; the first update of each is a warm-up:
  span     passes' columns patched to every position of that span (what the learner computed before)
  columns  what the Trainer runs
Both start from the same adapter and see the same batches, so their losses agree to float error.

    python bench/learn/bench_logit_columns.py --job jobs/smollm2-tictactoe-dagger-base.toml \
        --lake lake-db-s2 --run smollm2-ttt-dagger-base-s2 --at 7 --updates 6

Writes bench/results/logit_columns.json and prints markdown rows.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
from pathlib import Path
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
MEASURES = ["unstable_dask/learn/"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.jobfile import load_job
from unstable_dask.learn import passes
from unstable_dask.learn.trainer import Trainer

from common import recorded_batches, replay_arguments, row, save


@contextlib.contextmanager
def columns(counted: list[int], span: bool) -> Iterator[None]:
    """passes' columns, widened to the span the LM head covered before when `span`; each
    micro-batch's rows x columns appended to `counted`."""
    own = passes._columns

    def cols(tokens, rows, length):
        kept = own(tokens, rows, length)
        if span and len(kept):
            kept = torch.arange(int(kept.min()), length - 1)
        counted.append(len(rows) * len(kept))
        return kept
    passes._columns = cols
    try:
        yield
    finally:
        passes._columns = own


def main() -> None:
    args = replay_arguments().parse_args()

    job = load_job(args.job, {"run.lake": args.lake, "run.name": args.run})
    batches = recorded_batches(job, args.at, args.updates + 1)
    dev = torch.device("cpu")
    torch.manual_seed(0)
    learners = {"span": Trainer(job, None, dev)}
    torch.manual_seed(0)
    learners["columns"] = Trainer(job, None, dev)
    seconds: dict[str, list[float]] = {k: [] for k in learners}
    logits: dict[str, list[int]] = {k: [] for k in learners}
    losses: dict[str, list[float]] = {k: [] for k in learners}
    for i, (table, seed) in enumerate(batches):
        for name, trainer in learners.items():
            counted: list[int] = []
            with columns(counted, span=name == "span"):
                m = trainer.update(table, seed)
            losses[name].append(m["loss"])
            if i:
                seconds[name].append(m["step_time_s"])
                logits[name].append(sum(counted))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    rows_cols = {k: statistics.mean(v) for k, v in logits.items()}
    gap = max(abs(a - b) for a, b in zip(losses["span"], losses["columns"]))
    res = dict(job=args.job, run=args.run, at=args.at, model=job.model.base, rows=job.learn.batch_size,
               mini_batch_size=job.learn.mini_batch_size, share_prefix=job.learn.shares_prefix(),
               step_seconds=seconds, step_seconds_median=med, logit_positions=logits,
               logit_positions_mean=rows_cols, losses=losses, loss_gap_max=gap,
               speedup=med["span"] / med["columns"], logit_positions_ratio=rows_cols["columns"] / rows_cols["span"],
               torch_threads=torch.get_num_threads())
    save("logit_columns", res, settings=vars(args))
    print(row("LM head over", "s an update (median)", "row positions with logits (mean)", "speed vs span"))
    for k in learners:
        print(row(k, f"{med[k]:.1f}", f"{rows_cols[k]:.0f}", f"{med['span'] / med[k]:.2f}x"))
    print(f"largest loss difference between the two: {gap:.2e}")


if __name__ == "__main__":
    main()
