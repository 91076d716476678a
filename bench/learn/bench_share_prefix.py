"""learn.share_prefix on vs off: seconds an update and token positions its forward passes compute,
on the batches a checkpoint of a real run trained on.

Two learners (same job, one with learn.share_prefix = false) update on the very batches iteration
`--at` of `--run` drew from `--lake` (its recorded table versions and seeds: learner.recorded_plan),
in turn (A B A B) so the machine's drift hits both alike; the first update of each is a warm-up.
Positions are counted from the plan (passes.positions): with sharing, a micro-batch's common prefix
once plus each row's rest; without, every row whole, padded to its micro-batch's longest.

    python bench/learn/bench_share_prefix.py --job jobs/smollm2-tictactoe-dagger-base.toml \
        --lake lake-db-s2 --run smollm2-ttt-dagger-base-s2 --at 7 --updates 6

Writes bench/results/share_prefix.json and prints markdown rows.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
MEASURES = ["unstable_dask/learn/"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.learn import passes
from unstable_dask.learn.learner import build_query, recorded_plan, run_batch
from unstable_dask.learn.trainer import Trainer

from common import row, save


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="jobs/smollm2-tictactoe-dagger-base.toml")
    ap.add_argument("--lake", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--at", default="1", help="the iteration (or checkpoint uid) whose batches to replay")
    ap.add_argument("--updates", type=int, default=6, help="timed updates of each learner (after one warm-up)")
    args = ap.parse_args()

    def job(share: bool):
        return load_job(args.job, {"run.lake": args.lake, "run.name": args.run, "learn.share_prefix": share})
    on, off = job(True), job(False)
    if not on.learn.shares_prefix():
        raise SystemExit(f"{args.job}: learn.gradient_checkpointing is on, so nothing is shared; compare a job without it")
    p = recorded_plan(on, args.at)
    lake = Lake(on.run.lake).at(p.versions)
    batches = []
    with lake.connect() as con:
        for u in range(args.updates + 1):
            update = u % max(len(p.seeds), 1)
            batches.append((run_batch(con, on, build_query(on, p, update, con)), p.seeds.get(update, u)))
    dev = torch.device("cpu")
    learners = {"shared": Trainer(on, None, dev), "whole": Trainer(off, None, dev)}
    seconds: dict[str, list[float]] = {k: [] for k in learners}
    positions: dict[str, list[int]] = {k: [] for k in learners}
    tokens_total = []
    for i, (table, seed) in enumerate(batches):
        for name, trainer in learners.items():
            m = trainer.update(table, seed)
            if i:
                seconds[name].append(m["step_time_s"])
        tok = learners["shared"].selected_batch(table, seed).tokens if on.learn.algorithm == "sft" else \
            learners["shared"].batch(table, seed).tokens
        lengths = tok.attention_mask.sum(-1).tolist()
        mb = on.learn.mini_batch_size
        (shared,), = passes.plan(lengths, None, mb, 1, seed, share=tok)
        (whole,), = passes.plan(lengths, None, mb, 1, seed)
        if i:
            positions["shared"].append(passes.positions(tok, shared))
            positions["whole"].append(sum(len(r) * int(tok.attention_mask[r].sum(-1).max()) for r in whole))
            tokens_total.append(int(tok.attention_mask.sum()))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    pos = {k: statistics.mean(v) for k, v in positions.items()}
    res = dict(job=args.job, run=args.run, at=args.at, model=on.model.base, rows=on.learn.batch_size,
               mini_batch_size=on.learn.mini_batch_size, tokens_mean=statistics.mean(tokens_total),
               step_seconds=seconds, step_seconds_median=med, positions=positions, positions_mean=pos,
               speedup=med["whole"] / med["shared"], positions_ratio=pos["shared"] / pos["whole"],
               peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
               torch_threads=torch.get_num_threads())
    save("share_prefix", res, settings=vars(args))
    print(row("learner", "s an update (median)", "positions an update (mean)", "vs whole rows"))
    for k in learners:
        print(row(k, f"{med[k]:.1f}", f"{pos[k]:.0f}", f"{med['whole'] / med[k]:.2f}x speed, {pos[k] / pos['whole']:.2f}x positions"))


if __name__ == "__main__":
    main()
