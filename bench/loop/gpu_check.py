"""The GPU path in one command (`make gpu-check`): round, single-GPU loop with sleep/wake, learner memory.

On a machine with a CUDA GPU this runs, on a Dask `local-gpu` cluster (one worker per GPU, its
engine resident), a scaled-down version of a GPU job (default jobs/qwen3-selfplay.toml):

  1. round    a round of the job; tokens/s vs the backend's own batched generate on the very
              prompts the round sent, called on the same resident weights inside the worker
              (vLLM: `LLM.generate`; hf: transformers `generate`), same sampling settings: all
              at once, and in dependency waves (the k-th model turn of every game together,
              wave after wave: the best a wave-synchronous schedule of these games can do)
  2. loop     `loop --rounds 3` on one GPU: the learner runs as a task on the engine's worker and
              the engine sleeps during the update (vLLM level-1 sleep; hf: weights moved to host);
              round 1 plays the first adapter (on CUDA vLLM JIT-compiles its Triton LoRA kernels
              then), round 2 the second: the hot-swap's own cost
  3. learner  the learner_steps of that loop: CUDA memory allocated/reserved/peak, tokens/s,
              engine sleep/wake seconds and the device memory free while the engine slept
  4. quant    (--stages quant) the learner's peak memory by learn.quantization: one round's lake,
              then one update per setting (none, 8bit, 4bit) on a copy of it, each in a fresh
              process, so the same batch and nothing else differ

and writes one JSON (bench/results/gpu_check.json). Without a GPU it exits 2 with one line.

    python bench/loop/gpu_check.py [--job jobs/qwen3-selfplay.toml] [--model BASE] [--backend vllm|hf]
                              [--games 32] [--max-new-tokens 256]

--model replaces the job's model (e.g. builtin:tiny on a machine with no model hub); --shape
qwen3-1.7b builds a random-weight model of Qwen3-1.7B's architecture (28 layers, hidden 2048,
GQA 16/8 heads) on the builtin tokenizer, so memory and speed figures are those of the real
size where no weights can be downloaded (its vocabulary is the builtin tokenizer's, so the
embedding and the learner's logits are smaller than Qwen3's 151,936-token ones). --backend
defaults to the job's, falling back to hf (recorded) when vllm cannot be imported.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/play/", "unstable_dask/inference/", "unstable_dask/learn/", "unstable_dask/lake/", "unstable_dask/cluster/", "unstable_dask/loop.py", "unstable_dask/run.py", "unstable_dask/cli.py"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save, turn_waves, vllm_batch  # noqa: E402


def _gpu_info() -> dict:
    """Device facts from nvidia-smi and torch, without creating a CUDA context in this process
    (the driver must leave CUDA to the workers)."""
    import torch
    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "device_count": torch.cuda.device_count()}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        info["nvidia_smi"] = out
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"unavailable ({e})"
    for name in ("vllm", "transformers", "peft", "dask", "duckdb"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - a missing package is a fact to record
            info[name] = f"not importable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return info


# Qwen3-1.7B's published architecture (config.json of Qwen/Qwen3-1.7B-Base), less its vocabulary.
SHAPES = {"qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                             max_position_embeddings=40960, tie_word_embeddings=True)}


def _random_model(shape: str) -> str:
    """A random-weight model of a published architecture on the builtin tokenizer (bf16 files), built
    once into the model cache: a rerun on the same machine reuses the files and, since vLLM keys its
    torch.compile cache by the model's path, the compiled graphs (a cold engine start took 2 minutes
    on an H200, 35 s of it compiling)."""
    from unstable_dask.inference.weights import build_cached, resolve_model

    def build(out) -> None:
        import torch
        from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
        tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny"))
        cfg = Qwen3Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, **SHAPES[shape])
        torch.manual_seed(0)
        Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
        tok.save_pretrained(out)
    # the shape's settings in the name: an edited SHAPES entry builds anew, never reuses old files
    digest = hashlib.sha256(json.dumps(SHAPES[shape], sort_keys=True).encode()).hexdigest()[:8]
    return str(build_cached(f"random-{shape}-{digest}", build))


def _raw_generate(model_cfg, waves: list[list[str]], batch: int) -> dict:
    """On the worker: the backend's own generate on the resident weights, same prompts and sampling,
    one wave after another, every prompt of a wave at once (vLLM) or in chunks of `batch` (hf)."""
    import torch

    from unstable_dask.inference.engine import encode_prompts, get_engine, prompt_budget
    engine = get_engine(model_cfg)
    engine.wake_up()
    budget = prompt_budget(model_cfg)
    tokens, t0 = 0, time.perf_counter()
    for wave in waves:
        ids = encode_prompts(engine.tokenizer, wave, budget)
        if model_cfg.backend == "vllm":
            params = engine.vm.SamplingParams(temperature=model_cfg.temperature, top_p=model_cfg.top_p,
                                              max_tokens=model_cfg.max_new_tokens)
            tokens += sum(len(o.outputs[0].token_ids) for o in vllm_batch(engine, ids, params))
        else:
            tokens += _hf_generate(engine, model_cfg, ids, batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"prompts": sum(map(len, waves)), "waves": len(waves), "completion_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "cuda_mem_peak": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}


def _hf_generate(engine, model_cfg, ids: list[list[int]], batch: int) -> int:
    """transformers `generate` on the resident model, left-padded chunks of `batch`; tokens generated."""
    import torch
    hf, pad, tokens = engine.hf, engine.tokenizer.pad_token_id, 0
    with torch.inference_mode():
        for i in range(0, len(ids), batch):
            chunk = ids[i:i + batch]
            width = max(len(x) for x in chunk)
            inp = torch.tensor([[pad] * (width - len(x)) + x for x in chunk], device=hf.device)
            att = (torch.arange(width, device=hf.device)[None, :] >=
                   torch.tensor([width - len(x) for x in chunk], device=hf.device)[:, None]).long()
            kw = (dict(do_sample=True, temperature=model_cfg.temperature, top_p=model_cfg.top_p, top_k=0)
                  if model_cfg.temperature > 0 else {})
            seq = hf.base.generate(input_ids=inp, attention_mask=att, max_new_tokens=model_cfg.max_new_tokens,
                                   eos_token_id=hf.eos_ids, pad_token_id=pad, **kw)
            new = seq[:, width:]
            eos = torch.isin(new, torch.tensor(hf.eos_ids, device=new.device))
            # generated tokens up to and including the first EOS, like the engine counts them
            first = torch.where(eos.any(-1), eos.int().argmax(-1) + 1, torch.full_like(eos[:, 0], new.shape[1], dtype=torch.long))
            tokens += int(first.sum())
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", default="jobs/qwen3-selfplay.toml")
    ap.add_argument("--model", default=None, help="replace model.base (e.g. builtin:tiny when no hub is reachable)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="random weights of this architecture instead of --model")
    ap.add_argument("--backend", choices=["vllm", "hf"], default=None)
    ap.add_argument("--games", type=int, default=32, help="train games per round (eval games: a quarter)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64, help="learner batch (turns)")
    ap.add_argument("--loop-rounds", type=int, default=3, help="rounds of the loop stage (3: the second "
                    "adapter's round shows the hot-swap without the first adapter's kernel compilation)")
    ap.add_argument("--out", default="gpu_check", help="bench/results/<out>.json")
    ap.add_argument("--stages", default="round,loop", help="comma list of round, loop, quant (the learner "
                    "figures come from the loop); a short device lease can re-measure one stage")
    args = ap.parse_args()
    stages = set(args.stages.split(","))
    if not stages or stages - {"round", "loop", "quant"}:
        ap.error(f"--stages: expected a comma list of round, loop, quant; got {args.stages!r}")

    import torch
    if not torch.cuda.is_available():
        print("gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False on this machine); "
              "the CPU path is covered by `make test`", file=sys.stderr)
        sys.exit(2)

    from unstable_dask.jobfile import load_job

    info = _gpu_info()
    backend = args.backend
    if backend is None:
        backend = load_job(args.job).model.backend
        if backend == "vllm" and not str(info["vllm"])[:1].isdigit():
            backend = "hf"
    tmp = tempfile.mkdtemp(prefix="gpu-check-")
    n_eval = max(args.games // 4, 2)
    over = {"run.lake": f"{tmp}/lake", "run.reports": f"{tmp}/reports", "model.backend": backend,
            "model.max_new_tokens": args.max_new_tokens, "learn.max_generation_len": args.max_new_tokens,
            "round.train_games": args.games, "round.eval_games": n_eval,
            # every game of the round in flight at once: the round's batches are the raw baseline's
            "round.games_per_task": args.games + n_eval, "round.concurrency": args.games + n_eval,
            "model.hf_max_batch": args.games + n_eval,
            "learn.batch_size": args.batch_size, "learn.mini_batch_size": min(8, args.batch_size),
            "learn.device": "cuda", "cluster.kind": "local-gpu", "cluster.n_workers": 1,
            "cluster.memory_limit": "0", "cluster.dashboard": False}
    if args.shape:
        t = time.perf_counter()
        over["model.base"] = _random_model(args.shape)
        print(f"built random-weight {args.shape} in {time.perf_counter() - t:.0f} s", flush=True)
    elif args.model:
        over["model.base"] = args.model
    job = load_job(args.job, over)
    result: dict = {"gpu": info, "job": args.job, "model": args.shape and f"random-weight {args.shape}" or job.model.base, "backend": backend,
                    "games_per_round": args.games, "max_new_tokens": args.max_new_tokens}
    print(f"gpu_check: {info['nvidia_smi']} | model {job.model.base} | backend {backend}", flush=True)
    try:
        if "round" in stages:
            result["round"] = _round_stage(job, load_job(args.job, over | {"run.lake": f"{tmp}/warm"}), result)
            save(args.out, result, settings=vars(args))  # a lease that ends during the loop still leaves the round's figures
        if "loop" in stages:
            result.update(_loop_stage(load_job(args.job, over | {"run.lake": f"{tmp}/loop", "run.name": "gpu-loop"}),
                                      args.loop_rounds))
            save(args.out, result, settings=vars(args))
        if "quant" in stages:
            result["quantization"] = _quant_stage(args.job, over | {"run.lake": f"{tmp}/quant", "run.name": "gpu-quant"})
        result["ok"] = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    path = save(args.out, result, settings=vars(args))
    print(row("figure", "value"))
    print(row("---", "---"))
    if "round" in result:
        print(row("round tok/s", f"{result['round']['tok_s']:.0f}"))
        print(row("raw generate tok/s (same prompts, same weights)", f"{result['round']['raw_generate']['tok_s']:.0f}"))
        print(row("round / raw generate", f"{result['round']['round_vs_raw_generate']:.2f}"))
        print(row(f"raw generate in {result['round']['raw_waves']['waves']} dependency waves tok/s",
                  f"{result['round']['raw_waves']['tok_s']:.0f}"))
        print(row("round / raw generate in waves", f"{result['round']['round_vs_raw_waves']:.2f}"))
    for st in result.get("learner_steps", []):
        print(row(f"learner it {st['iteration']} update {st['update']}",
                  f"peak {st['cuda_mem_peak'] / 2**20:.0f} MiB, reserved {st['cuda_mem_reserved'] / 2**20:.0f} MiB, "
                  f"{st['tokens_per_s']:.0f} tok/s"))
    for q, st in result.get("quantization", {}).items():
        print(row(f"learner quantization {q}", f"peak {st['cuda_mem_peak'] / 2**20:.0f} MiB, "
                  f"{st['tokens_per_s']:.0f} tok/s, loss {st['loss']:.4f}"))
    print(f"results: {path}")


def _round_stage(job, warm, result: dict) -> dict:
    """1. a round (after a warm-up round on its own lake: engine load and first kernels out of the
    figure) vs the backend's own generate on the round's prompts, in the same worker."""
    from unstable_dask.cluster.client import open_client
    from unstable_dask.lake import Lake
    from unstable_dask.play.round import play_round
    n_games = job.round.train_games + job.round.eval_games
    with open_client(job.cluster) as client:
        t = time.perf_counter()
        play_round(warm, client=client)
        result["engine_load_and_warmup_s"] = time.perf_counter() - t
        s = play_round(job, client=client)
        waves = model_turn_waves(Lake(job.run.lake))
        prompts = [p for w in waves for p in w]
        raw = client.submit(_raw_generate, job.model, [prompts], n_games, resources={"GPU": 1}, pure=False).result()
        by_wave = client.submit(_raw_generate, job.model, waves, n_games, resources={"GPU": 1}, pure=False).result()
    print(f"round: {s.tokens_per_s:.0f} tok/s vs raw generate {raw['tok_s']:.0f} tok/s at once, "
          f"{by_wave['tok_s']:.0f} tok/s in {len(waves)} waves", flush=True)
    return {"games": s.games, "turns": s.turns, "completion_tokens": s.completion_tokens, "wall_s": s.wall_s,
            "tok_s": s.tokens_per_s, "raw_generate": raw, "round_vs_raw_generate": s.tokens_per_s / raw["tok_s"],
            "raw_waves": by_wave, "round_vs_raw_waves": s.tokens_per_s / by_wave["tok_s"]}


def model_turn_waves(lake) -> list[list[str]]:
    """The round's model prompts in dependency waves (common.turn_waves)."""
    rows = lake.sql("SELECT game_id, turn, prompt FROM turns WHERE prompt IS NOT NULL").to_pylist()
    return [[r["prompt"] for r in wave] for wave in turn_waves(rows)]


def _loop_stage(ljob, rounds: int) -> dict:
    """2.+3. the single-GPU loop: learn on the engine's worker with the engine asleep (its own
    cluster, so the loop opens and closes it as a user's `loop` would), and its learner_steps."""
    from unstable_dask.lake import Lake
    from unstable_dask.loop import loop
    t = time.perf_counter()
    loop(ljob, rounds=rounds, rate=False)
    out = {f"loop_{rounds}_rounds_wall_s": time.perf_counter() - t}
    out["learner_steps"] = Lake(ljob.run.lake).sql("SELECT * EXCLUDE (rounds, created_at) FROM learner_steps "
                                    "ORDER BY iteration, update").to_pylist()
    out["loop_rounds"] = Lake(ljob.run.lake).sql("SELECT round, completion_tokens, "
                                  "epoch(committed_at - started_at) AS wall_s FROM rounds ORDER BY round").to_pylist()
    return out


def _learn_once(job_path: str, over: dict) -> dict:
    """One learner update in this (fresh) process; its learner_steps row."""
    from unstable_dask.jobfile import load_job
    from unstable_dask.lake import Lake
    from unstable_dask.learn.learner import learn
    job = load_job(job_path, over)
    learn(job)
    return Lake(job.run.lake).sql("SELECT * EXCLUDE (rounds, created_at) FROM learner_steps").to_pylist()[0]


def _quant_stage(job_path: str, over: dict) -> dict:
    """4. peak learner memory by learn.quantization on one batch: a round writes the lake, then each
    setting trains ckpt-1 on its own copy of it in a spawned process (a fresh CUDA context and
    peak counter; no engine on the device)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from unstable_dask.cluster.client import open_client
    from unstable_dask.jobfile import load_job
    from unstable_dask.play.round import play_round
    job = load_job(job_path, over)
    with open_client(job.cluster) as client:
        play_round(job, client=client)
    out = {}
    for q in ("none", "8bit", "4bit"):
        lake = f"{job.run.lake}-{q}"
        shutil.copytree(job.run.lake, lake)
        # cluster.kind local: the update runs in the spawned process itself, not on a GPU worker
        qover = over | {"run.lake": lake, "learn.quantization": q, "cluster.kind": "local"}
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
            out[q] = ex.submit(_learn_once, job_path, qover).result()
        print(f"quant {q}: peak {out[q]['cuda_mem_peak'] / 2**20:.0f} MiB", flush=True)
    return out


if __name__ == "__main__":
    main()
