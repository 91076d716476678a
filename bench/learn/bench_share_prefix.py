"""The CPU learner's update before and after prefix sharing and float32 attention: seconds an update
and token positions its forward passes compute, on the batches a checkpoint of a real run trained on.

Three learners of the same job update on the very batches iteration `--at` of `--run` drew from
`--lake` (its recorded table versions and seeds: learner.recorded_plan), in turn (A B C A B C) so the
machine's drift hits all alike; the first update of each is a warm-up:
  before   learn.share_prefix = false and transformers' own SDPA attention (bf16 under autocast);
  shared   learn.share_prefix = true, the same attention;
  now      what the Trainer runs: shared, and attention in float32 (trainer.fp32_attention) when the
           update is bf16 on a CPU.
Positions are counted from the plan (passes.positions): with sharing, a micro-batch's common prefix
once plus each row's rest; without, every row whole, padded to its micro-batch's longest.

    python bench/learn/bench_share_prefix.py --job jobs/smollm2-tictactoe-dagger-base.toml \
        --lake lake-db-s2 --run smollm2-ttt-dagger-base-s2 --at 7 --updates 6

Writes bench/results/share_prefix.json and prints markdown rows.
"""
from __future__ import annotations

import resource
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
MEASURES = ["unstable_dask/learn/"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.jobfile import load_job
from unstable_dask.learn import passes
from unstable_dask.learn.trainer import Trainer

from common import recorded_batches, replay_arguments, row, save


def main() -> None:
    args = replay_arguments().parse_args()

    def job(share: bool):
        return load_job(args.job, {"run.lake": args.lake, "run.name": args.run, "learn.share_prefix": share})
    on, off = job(True), job(False)
    if not on.learn.shares_prefix():
        raise SystemExit(f"{args.job}: learn.gradient_checkpointing is on, so nothing is shared; compare a job without it")
    batches = recorded_batches(on, args.at, args.updates + 1)
    dev = torch.device("cpu")
    learners = {"before": Trainer(off, None, dev), "shared": Trainer(on, None, dev), "now": Trainer(on, None, dev)}
    for name in ("before", "shared"):  # transformers' own attention, as the learner had it
        learners[name].policy.get_base_model().set_attn_implementation("sdpa")
    seconds: dict[str, list[float]] = {k: [] for k in learners}
    positions: dict[str, list[int]] = {"before": [], "shared": []}
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
            positions["before"].append(sum(len(r) * int(tok.attention_mask[r].sum(-1).max()) for r in whole))
            tokens_total.append(int(tok.attention_mask.sum()))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    pos = {k: statistics.mean(v) for k, v in positions.items()}
    res = dict(job=args.job, run=args.run, at=args.at, model=on.model.base, rows=on.learn.batch_size,
               mini_batch_size=on.learn.mini_batch_size, tokens_mean=statistics.mean(tokens_total),
               step_seconds=seconds, step_seconds_median=med, positions=positions, positions_mean=pos,
               speedup_shared=med["before"] / med["shared"], speedup_now=med["before"] / med["now"],
               positions_ratio=pos["shared"] / pos["before"],
               peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
               torch_threads=torch.get_num_threads())
    save("share_prefix", res, settings=vars(args))
    print(row("learner", "s an update (median)", "positions an update (mean)", "speed vs before"))
    for k in learners:
        shown = pos.get(k, pos["shared"])
        print(row(k, f"{med[k]:.1f}", f"{shown:.0f}", f"{med['before'] / med[k]:.2f}x"))


if __name__ == "__main__":
    main()
