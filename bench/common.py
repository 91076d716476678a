"""Shared by the bench scripts: result files (with the commit and settings they were measured with),
the markdown row each prints, the synthetic learner batch, and the figures of a round played on a
cluster whose engines are resident."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def machine() -> dict:
    """The machine a figure was measured on: CPU model, cores, memory, GPU (None without one)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        memory = None
    gpu = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        gpu = ", ".join(out.stdout.split("\n")[:-1]) or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"cpu": cpu, "arch": platform.machine(), "cores": os.cpu_count(),
            "memory_gib": round(memory, 1) if memory else None, "gpu": gpu, "python": platform.python_version()}


def commit() -> tuple[str | None, bool | None]:
    """(HEAD of the checkout the bench runs from, whether its tracked files differ from HEAD): the code a
    figure measured. bench/stale.py compares it with today's code."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "unstable_dask", "bench")
    except OSError:
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(dirty.stdout.strip())


def code_digest(paths: list[str]) -> str:
    """sha256 over the files under `paths` (tracked, or untracked and not ignored) as they are on disk:
    the code a figure measured, committed or not. bench/stale.py compares it with today's."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "--", *paths],
                            capture_output=True, text=True, check=True).stdout.split("\n")
    h = hashlib.sha256()
    for rel in sorted({x for x in listed if x}):
        if (ROOT / rel).is_file():
            h.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0")
    return h.hexdigest()


def save(name: str, data: dict, settings: dict | None = None) -> Path:
    """Write bench/results/<name>.json and return its path: the figures in `data`, and what they were
    measured with: the commit (and whether the tree was dirty), date, machine, the bench script, its
    command line, `settings` (its parsed options), the paths it MEASURES and digests of that code and
    of the script, so that bench/stale.py can tell when either changed."""
    import __main__
    RESULTS.mkdir(parents=True, exist_ok=True)
    script = Path(getattr(__main__, "__file__", None) or sys.argv[0]).resolve()
    head, dirty = commit()
    from stale import code_of  # the script as stale.py compares it: bookkeeping (paths, imports) left out
    measures = list(getattr(__main__, "MEASURES", []))
    meta = {"bench": name, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "commit": head, "dirty": dirty,
            "script": str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else str(script),
            "command": " ".join(["python", *sys.argv]),
            "settings": {k: (v if isinstance(v, (str, int, float, bool, type(None), list)) else str(v))
                         for k, v in (settings or {}).items()},
            "measures": measures, "code_digest": code_digest(measures) if measures else None,
            "script_digest": hashlib.sha256(code_of(script.read_text()).encode()).hexdigest() if script.is_file() else None}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**data, **meta}, indent=2, sort_keys=True, default=str) + "\n")
    return path


def learner_batch(tokenizer, prompts: list[str], completions: list[str]):
    """Learner rows as the batch query returns them, for these prompts and completions (tokenized by
    `tokenizer`): advantages -1, 0, 1 in turn, sampled at temperature 1, no stored log-probs."""
    import pyarrow as pa
    n = len(prompts)
    ids = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    return pa.table({"round": [0] * n, "game_id": [f"g{i}" for i in range(n)], "turn": [0] * n, "pid": [0] * n,
                     "prompt": prompts, "prompt_tokens": [len(x) for x in ids(prompts)],
                     "completion_token_ids": ids(completions), "logprobs": [None] * n,
                     "temperature": [1.0] * n, "top_p": [1.0] * n,
                     "advantage": [float((i % 3) - 1) for i in range(n)],
                     "env_reward": [1.0] * n, "final_reward": [1.0] * n, "step_reward": [1.0] * n})


def tictactoe_batch(tokenizer, n: int, repeat: int = 5):
    """`n` learner rows like the SmolLM2 learning job's: a chat prompt of `repeat` copies of a rules text
    (5: ~300 tokens, the TicTacToe learning job's; 10: ~410-token prompts, ~430-token rows) and
    completions of 4-40 tokens."""
    rules = ("You are playing Tic Tac Toe. Make valid moves to win. On your turn, choose a cell by "
             "its number, e.g. [4]. The board so far:\n") * repeat
    prompts = [f"<|im_start|>user\n{rules}Game {i}: the opponent played [{i % 9}].<|im_end|>\n<|im_start|>assistant\n"
               for i in range(n)]
    return learner_batch(tokenizer, prompts,
                         [f"I play [{(i + 4) % 9}]" + " because it blocks the row" * (i % 9) for i in range(n)])


def replay_arguments() -> argparse.ArgumentParser:
    """The options of a bench that replays a real run's learner batches (recorded_batches)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="jobs/smollm2-tictactoe-dagger-base.toml")
    ap.add_argument("--lake", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--at", default="1", help="the iteration (or checkpoint uid) whose batches to replay")
    ap.add_argument("--updates", type=int, default=6, help="timed updates of each learner (after one warm-up)")
    return ap


def recorded_batches(job, at: str, n: int) -> list:
    """(table, seed) of the first `n` updates of iteration (or checkpoint uid) `at` of `job`'s run,
    replayed from its lake at the table versions and with the seeds that update recorded
    (learner.recorded_plan); cycles through the iteration's updates when `n` is larger."""
    from unstable_dask.lake import Lake
    from unstable_dask.learn.learner import build_query, recorded_plan, run_batch
    p = recorded_plan(job, at)
    out = []
    with Lake(job.run.lake).at(p.versions).connect() as con:
        for u in range(n):
            update = u % max(len(p.seeds), 1)
            out.append((run_batch(con, job, build_query(job, p, update, con)), p.seeds.get(update, u)))
    return out


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
