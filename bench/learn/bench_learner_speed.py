"""Learner tokens/s on a SmolLM2-shaped batch, and the share of the machine's matmul peak it uses.

Three learners on the same batch (rows like the learning job's: ~300 prompt tokens, 4-40
completion tokens), in turn (A B C A B C) so machine load hits all alike:
  before  the learner as it was: logits over the whole vocabulary at every position of prompt +
          completion, micro-batches in batch order padded to their longest row, fp32;
  fp32    Trainer.update: logits only from the first completion position (logits_to_keep),
          micro-batches of similar lengths trimmed to their longest row;
  bf16    the same with learn.dtype = "bfloat16" (autocast; LoRA weights stay fp32);
  bf16-ckpt  bf16 with learn.gradient_checkpointing on, the default of every job: its price on
          this machine (the three above run without it; its share of the peak counts the same
          useful FLOPs, not the recomputed forward).
The peak is a 2048^3 torch matmul on the same threads, fp32 and bf16. A LoRA update's work is taken
as 4 x (non-embedding parameters) FLOPs per token (forward, and the backward to the activations:
the frozen base gets no weight gradient) plus 6 x vocab x hidden per position whose logits are
computed; the fraction is that over the peak of the dtype used.

    python bench/learn/bench_learner_speed.py [--rows 16] [--steps 2] [--model builtin:smollm2-135m-instruct]

Writes bench/results/learner_speed.json and prints markdown rows.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/learn/"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.jobfile import validate_job
from unstable_dask.learn.trainer import Trainer

from common import matmul_peak, row, save, tictactoe_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    args = ap.parse_args()

    def job(dtype: str, checkpointing: bool = False):
        return validate_job({"model": {"base": args.model, "max_new_tokens": 48},
                             "learn": {"batch_size": args.rows, "mini_batch_size": 8, "lr": 1e-6,
                                       "gradient_checkpointing": checkpointing, "dtype": dtype}})
    dev = torch.device("cpu")
    learners = {"fp32": Trainer(job("float32"), None, dev), "bf16": Trainer(job("bfloat16"), None, dev),
                "bf16-ckpt": Trainer(job("bfloat16", checkpointing=True), None, dev)}
    before = Trainer(job("float32"), None, dev)
    batch = tictactoe_batch(before.tokenizer, args.rows)
    tok = before.batch(batch).tokens
    adv = torch.tensor(batch.column("advantage").to_pylist())

    def before_step() -> float:
        t0 = time.perf_counter()
        before.optimizer.zero_grad()
        for s in range(0, args.rows, 8):
            ids, att = tok.input_ids[s:s + 8], tok.attention_mask[s:s + 8]
            width = int(att.sum(-1).max())  # padded to the micro-batch's longest row
            ids, att, mask = ids[:, -width:], att[:, -width:], tok.loss_mask[s:s + 8, -width:]
            logits = before.policy(input_ids=ids, attention_mask=att).logits[:, :-1].float()
            lp = logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            loss = -(adv[s:s + 8] * (lp * mask[:, 1:]).sum(-1) / 48).sum() / args.rows
            loss.backward()
        torch.nn.utils.clip_grad_norm_(before.policy.parameters(), 0.2)
        before.optimizer.step()
        return int(tok.attention_mask.sum()) / (time.perf_counter() - t0)

    tps: dict[str, list[float]] = {"before": [], **{k: [] for k in learners}}
    for i in range(args.steps + 1):  # step 0 of each is a warm-up
        b = before_step()
        got = {k: t.update(batch)["tokens_per_s"] for k, t in learners.items()}
        if i:
            tps["before"].append(b)
            for k, v in got.items():
                tps[k].append(v)
    med = {k: statistics.median(v) for k, v in tps.items()}
    cfg = before.policy.config if hasattr(before.policy, "config") else before.policy.base_model.config
    params = sum(p.numel() for n, p in before.policy.named_parameters() if "lora_" not in n and "embed" not in n)
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    tokens = int(tok.attention_mask.sum())
    completion = int(tok.loss_mask.sum())
    flops_tok_before = 4 * params + 6 * vocab * hidden  # logits at every position
    flops_tok_now = 4 * params + 6 * vocab * hidden * (completion + args.rows) / tokens  # logits from the completion on
    peak = {"fp32": matmul_peak("float32"), "bf16": matmul_peak("bfloat16")}
    frac = {"before": med["before"] * flops_tok_before / peak["fp32"], "fp32": med["fp32"] * flops_tok_now / peak["fp32"],
            "bf16": med["bf16"] * flops_tok_now / peak["bf16"], "bf16-ckpt": med["bf16-ckpt"] * flops_tok_now / peak["bf16"]}
    res = dict(model=args.model, rows=args.rows, tokens=tokens, completion_tokens=completion,
               tokens_per_s=med, samples=tps, matmul_peak_flops=peak, peak_fraction=frac,
               speedup_fp32=med["fp32"] / med["before"], speedup_bf16=med["bf16"] / med["before"],
               checkpointing_vs_none_bf16=med["bf16-ckpt"] / med["bf16"],
               torch_threads=torch.get_num_threads())
    save("learner_speed", res, settings=vars(args))
    print(row("learner", "tok/s", "vs before", "share of matmul peak"))
    for k in tps:
        print(row(k, f"{med[k]:.0f}", f"{med[k] / med['before']:.2f}", f"{frac[k]:.1%}"))
    print(row("matmul peak GFLOP/s (fp32, bf16)", f"{peak['fp32'] / 1e9:.0f}", f"{peak['bf16'] / 1e9:.0f}", ""))


if __name__ == "__main__":
    main()
