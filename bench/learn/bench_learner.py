"""Learner tokens/s (Trainer.step: ids + REINFORCE update) vs a bare peft loop on the same
batch (pre-tokenized, forward/log-softmax/backward/clip/AdamW only). Target: ratio >= 0.9.

    python bench/learn/bench_learner.py [--batch 32] [--steps 5]

Prints a markdown row; writes bench/results/bench_learner.json.
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

from common import learner_batch, row, save


def make_batch(tokenizer, n: int):
    """A short-game chat prompt (twice) and completions of 6-21 tokens, as learner rows."""
    prompt = ("<|im_start|>user\nYou are playing a two-player zero-sum game. Make valid actions to win.\n"
              "Observation: [GAME] Current Board: Available Moves: [0], [1], [2], [3]<|im_end|>\n<|im_start|>assistant\n")
    return learner_batch(tokenizer, [prompt * 2 + str(i) for i in range(n)],
                         [f"I pick \\boxed{{[{i % 4}]}} because " + "reason " * (i % 16) for i in range(n)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    job = validate_job({"learn": {"batch_size": args.batch, "mini_batch_size": 8, "gradient_checkpointing": False}})
    dev = torch.device("cpu")
    ours = Trainer(job, None, dev)
    bare = Trainer(job, None, dev)  # same model + LoRA + AdamW; only the loop below differs
    batch = make_batch(ours.tokenizer, args.batch)
    tok = bare.batch(batch).tokens
    adv = torch.tensor(batch.column("advantage").to_pylist())

    def plain_logprobs(model, ids, att):
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        return logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    def bare_step() -> float:
        t0 = time.perf_counter()
        bare.optimizer.zero_grad()
        for s in range(0, args.batch, 8):
            lp = plain_logprobs(bare.policy, tok.input_ids[s:s + 8], tok.attention_mask[s:s + 8])
            loss = -(adv[s:s + 8] * (lp * tok.loss_mask[s:s + 8, 1:]).sum(-1) / 64).sum() / args.batch
            loss.backward()
        torch.nn.utils.clip_grad_norm_(bare.policy.parameters(), 0.2)
        bare.optimizer.step()
        return int(tok.attention_mask.sum()) / (time.perf_counter() - t0)

    # Alternate the two so drift in machine load hits both alike; step 0 of each is a warm-up.
    ours_tps, bare_tps = [], []
    for i in range(args.steps + 1):
        m, b = ours.update(batch), bare_step()
        if i:
            ours_tps.append(m["tokens_per_s"])
            bare_tps.append(b)
    res = dict(name="bench_learner", model=job.model.base, device="cpu", batch=args.batch,
               ours_tokens_per_s=statistics.median(ours_tps), bare_tokens_per_s=statistics.median(bare_tps))
    res["ratio"] = res["ours_tokens_per_s"] / res["bare_tokens_per_s"]
    save("bench_learner", res, settings=vars(args))
    print(row("benchmark", "ours tok/s", "bare peft tok/s", "ratio", "target"))
    print(row(f"learner (REINFORCE, builtin:tiny, CPU, batch {args.batch})", f"{res['ours_tokens_per_s']:.0f}",
              f"{res['bare_tokens_per_s']:.0f}", f"{res['ratio']:.2f}", ">= 0.9"))


if __name__ == "__main__":
    main()
