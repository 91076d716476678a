"""How far apart are the engine's stored behaviour log-probs and the learner's fp32 recomputation?

The measurement behind the tolerances of tests/helpers/logprob_check.py: real rounds of the builtin tiny
model (`hf`, or `vllm` with --backend vllm where `make install` put vLLM in .venv), each learner
token's stored log-prob against a plain fp32 forward pass over prompt + completion ids, split into
tokens within fp32 noise and nucleus-boundary flips.

    python bench/inference/bench_logprob_noise.py [--backend hf|vllm] [--rounds 3]

Writes bench/results/logprob_noise_<backend>.json.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/inference/", "unstable_dask/play/", "unstable_dask/learn/"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save
from helpers import logprob_check  # noqa: E402
from helpers.adapters import completion_logits  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from unstable_dask.cluster.client import open_client
    from unstable_dask.inference.engine import encode_prompts
    from unstable_dask.inference.weights import resolve_model
    from unstable_dask.jobfile import load_job
    from unstable_dask.lake import Lake
    from unstable_dask.play.round import play_round

    settings = [(0.7, 0.95), (0.9, 0.95), (1.0, 0.9)]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            temperature, top_p = settings[k % len(settings)]
            job = load_job("jobs/demo.toml", {
                "run.lake": f"{tmp}/lake", "run.name": f"noise{k}", "run.seed": k, "model.backend": args.backend,
                "model.temperature": temperature, "model.top_p": top_p, "model.max_new_tokens": 24,
                "cluster.n_workers": 1, "round.train_games": 32, "round.eval_games": 0,
                "model.vllm.enforce_eager": True,
                "round.train_envs": [{"env_id": "TicTacToe-v0-train", "num_players": 2, "num_actors": 2}]})
            with open_client(job.cluster) as client:
                play_round(job, client=client)
            rows = Lake(job.run.lake).sql("SELECT prompt, prompt_tokens, completion_token_ids, logprobs FROM turns "
                            "WHERE run = ? AND prompt_tokens > 0 ORDER BY game_id, turn", [job.run.name]).to_pylist()
            path = resolve_model(job.model.base)
            tok = AutoTokenizer.from_pretrained(path)
            ids = [encode_prompts(tok, [r["prompt"]], r["prompt_tokens"])[0] for r in rows]
            gens = [SimpleNamespace(token_ids=r["completion_token_ids"]) for r in rows]
            stored = torch.tensor([x for r in rows for x in r["logprobs"]])
            logits, targets, _ = completion_logits(path, ids, gens)
            v = logprob_check.check(logits, targets, stored, temperature, top_p)
            diff = (stored.double() - v.recomputed.double()).abs()
            exact = diff[diff <= logprob_check.TOL]
            out.append(dict(temperature=temperature, top_p=top_p, tokens=v.tokens, flips=v.flips,
                            max_exact=v.max_exact, max_gap=v.max_gap, p999_exact=float(exact.quantile(0.999)),
                            flip_sizes=sorted(float(d) for d in diff[diff > logprob_check.TOL])))
            print(row(args.backend, temperature, top_p, v.tokens, v.flips, f"{v.max_exact:.2g}"), flush=True)
    total = sum(r["tokens"] for r in out)
    result = dict(backend=args.backend, rounds=out, tokens=total, flips=sum(r["flips"] for r in out),
                  max_exact=max(r["max_exact"] for r in out),
                  max_gap=max(r["max_gap"] for r in out), tol=logprob_check.TOL, eps=logprob_check.EPS)
    print(f"{args.backend}: {total} tokens, {result['flips']} boundary flips, non-boundary max {result['max_exact']:.3g}, "
          f"largest boundary gap at a flip {result['max_gap']:.3g}")
    print(save(f"logprob_noise_{args.backend}", result, settings=vars(args)))


if __name__ == "__main__":
    main()
