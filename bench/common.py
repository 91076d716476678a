"""Shared by the bench scripts: result files, the markdown row each prints, and the figures of a
round played on a cluster whose engines are resident."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"


def save(name: str, data: dict) -> Path:
    """Write bench/results/<name>.json (with the command line and machine) and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"bench": name, "machine": machine(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python", *sys.argv]), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def small_adapter(base_path: str, folder: str) -> str:
    """A LoRA adapter of the jobs' default shape on base_path, saved in folder: small random B, so it
    costs what a trained adapter costs (compute and memory do not depend on the values)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from unstable_dask.config import LoraConfig as Lora
    shape = Lora()  # the job's default LoRA: what jobs/smollm2-learn.toml trains
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_path),
                           LoraConfig(r=shape.rank, lora_alpha=shape.alpha, target_modules=shape.target_modules))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    model.save_pretrained(folder)
    return folder


def vllm_batch(engine, prompt_ids: list[list[int]], params) -> list:
    """`vllm.LLM.generate` on the project's resident vLLM engine: every prompt sent at once to the
    same async engine, no log-probs or decoding of ours; vLLM's RequestOutputs, in order.
    `params`: one SamplingParams for all, or a list of one per prompt."""
    import asyncio

    from unstable_dask.inference import aio

    llm = engine.started()

    async def one(i: int, ids: list[int]):
        last = None
        p = params[i] if isinstance(params, list) else params
        async for out in llm.generate({"prompt_token_ids": ids}, p, request_id=f"raw-{i}-{id(ids)}"):
            last = out
        return last

    async def every():
        return await asyncio.gather(*(one(i, x) for i, x in enumerate(prompt_ids)))
    return aio.run(every())


def matmul_peak(dtype: str = "float32", n: int = 2048, reps: int = 5, threads: int | None = None) -> float:
    """FLOP/s of an n^3 torch matmul on this machine (best of `reps`): the physical limit an engine
    or a learner is compared with. `threads`: torch threads for the measurement (default: as set)."""
    import torch
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a, b = (torch.randn(n, n, dtype=getattr(torch, dtype)) for _ in range(2))
        a @ b
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            t.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * n ** 3 / min(t)


def forward_flops(model_path: str) -> tuple[float, float]:
    """(FLOPs per token through the non-embedding weights, FLOPs per token of the LM head) of a
    decoder-only transformers model, counted from its config: 2 x weights per token for each."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model_path)
    h, layers = c.hidden_size, c.num_hidden_layers
    head = getattr(c, "head_dim", None) or h // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", c.num_attention_heads) * head
    attn = h * c.num_attention_heads * head * 2 + h * kv * 2  # q, o; k, v
    mlp = 3 * h * c.intermediate_size  # gate, up, down
    return 2.0 * layers * (attn + mlp), 2.0 * c.vocab_size * h


# ---------------------------------------------------------------- a round on resident engines

def _start_engine(model_cfg) -> tuple[str, float]:
    from unstable_dask.inference.engine import get_engine
    t = time.perf_counter()
    engine = get_engine(model_cfg)
    if hasattr(engine, "prepare"):  # a vLLM engine starts when its first task says what it uses
        engine.prepare({None})
    return engine.name, time.perf_counter() - t


def on_every_worker(client, fn, *args) -> list:
    """fn(*args) as a task on each worker of the cluster (in the worker process, where its resident
    engine lives), in worker order; their results."""
    return client.gather([client.submit(fn, *args, workers=[w], allow_other_workers=False, pure=False)
                          for w in sorted(client.scheduler_info()["workers"])])


def start_engines(client, model_cfg) -> tuple[str, float]:
    """Start the resident engine on every worker of the cluster before a round (engine start timed
    apart from it): the engine's name and the slowest worker's start in seconds."""
    started = on_every_worker(client, _start_engine, model_cfg)
    return started[0][0], max(x[1] for x in started)


def empty_prefix_cache(model_cfg) -> None:
    """On the worker: empty the resident vLLM engine's prefix cache, so that no phase starts with
    the blocks an earlier one computed (each starts as the round did)."""
    from unstable_dask.inference import aio
    from unstable_dask.inference.engine import get_engine
    assert aio.run(get_engine(model_cfg).started().reset_prefix_cache())


def task_figures(tasks: list[dict], wall: float) -> dict:
    """tok/s over `wall` (tasks run side by side on the workers), in-flight share, cache hit rate."""
    tokens = sum(t["completion_tokens"] for t in tasks)
    room = sum(t["concurrency"] * t["wall_s"] for t in tasks)
    prompt = sum(t.get("prompt_tokens", 0) for t in tasks)
    return {"completion_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "cached_tokens": sum(t.get("cached_tokens", 0) for t in tasks),
            "in_flight_frac": sum(t["in_flight_s"] for t in tasks) / room if room else None,
            "prefix_cache_hit_rate": sum(t.get("cached_tokens", 0) for t in tasks) / prompt if prompt else None}


def model_tasks(tasks: list[dict]) -> list[dict]:
    return [t for t in tasks if t["completion_tokens"]]  # the baseline's tasks (agents only) have no engine


def round_figures(job, client) -> dict:
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
    return {"games": s.games, "turns": s.turns, **task_figures(model_tasks(s.tasks), s.wall_s),
            "tok_s": s.tokens_per_s, "tasks": s.tasks, "in_flight_bound": bound,
            "prompt_tokens_fed": fed, "completion_tokens_made": made}


def game_turns(rows: list[dict]) -> list[list[dict]]:
    """A round's model turns game by game (rows with game_id and turn), each game's in turn order."""
    by_game: dict = {}
    for r in sorted(rows, key=lambda r: (r["game_id"], r["turn"])):
        by_game.setdefault(r["game_id"], []).append(r)
    return list(by_game.values())


def turn_waves(rows: list[dict]) -> list[list[dict]]:
    """A round's model turns by dependency: wave k holds the k-th model turn of every game that has
    one (rows with game_id and turn). A round cannot send a game's turn k+1 before turn k is played,
    so sending every prompt at once is not reachable by any round; the waves one after another, each
    all at once, are the best a wave-synchronous (lock-step) schedule of these games can do. Per-game
    play can beat them: a short game's later turns overlap a long game's earlier ones."""
    games = game_turns(rows)
    depth = max((len(v) for v in games), default=0)
    return [[v[k] for v in games if len(v) > k] for k in range(depth)]
