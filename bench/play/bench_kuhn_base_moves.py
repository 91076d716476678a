"""What a model samples at Kuhn Poker decisions, by prompt template and temperature: the moves a
learner can reinforce before it has learned anything.

REINFORCE raises only what it samples. On Kuhn Poker the best reply to the random agent is to bet
whenever it may and never fold (bench_kuhn_policies.py), so whether the base model ever writes
`[bet]` where a bet is legal decides whether a run can find it. This plays random legal moves to
reach decisions (seeded), renders each decision's observation with a template, samples one
completion per decision through the project's own engine (`get_engine`, as a round does), and
reads the move as the round would: `\\boxed{}` extraction, then the env's own rule (the first
`[check]`/`[bet]`/`[call]`/`[fold]` in the action). Counts are split by decision kind: `open`
(`[check]` or `[bet]` legal) and `facing` (a bet to call or fold). `--orders listed,reversed` also
samples each observation with its two move lists (the action rules and the available actions) in
reverse order: whether the model picks a move for what it is or for where it is listed.

    python bench/play/bench_kuhn_base_moves.py [--model builtin:smollm2-135m-instruct] [--backend auto]
        [--env KuhnPoker-v0-single-train] [--decisions 128] [--templates default,qwen3-zs,chat]
        [--temperatures 0.7,1.0] [--orders listed] [--name kuhn_base_moves]

Writes bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/play/", "unstable_dask/inference/"]  # what bench/stale.py checks for changes since a result's commit


from common import row, save  # noqa: E402

_MOVE = re.compile(r"\[(check|bet|call|fold)\]", re.IGNORECASE)  # KuhnPokerEnv.step's own rule
_RULES = re.compile(r"(- '\[(?:check|bet|call|fold)\]'.*\n)+")  # the observation's "Action Rules" lines
_AVAILABLE = re.compile(r"Your available actions are: (.*)$", re.MULTILINE)


def reverse_moves(obs: str) -> str:
    """The observation with its action-rule lines and its available actions in reverse order."""
    rules = _RULES.search(obs)
    if rules:
        obs = obs[:rules.start()] + "".join(rules.group(0).splitlines(keepends=True)[::-1]) + obs[rules.end():]
    available = _AVAILABLE.search(obs)
    if available:
        moves = ", ".join(available.group(1).split(", ")[::-1])
        obs = obs[:available.start(1)] + moves + obs[available.end(1):]
    return obs


def decisions(env_id: str, n: int) -> list[tuple[str, list[str]]]:
    """n (observation, legal moves) pairs, half opening the betting, half after one random legal move."""
    import textarena as ta

    from unstable_dask.play.agents import legal_moves
    from unstable_dask.play.envs import register_envs
    register_envs()
    out: list[tuple[str, list[str]]] = []
    seed = 0
    while len(out) < n:
        rng = random.Random(seed)
        env = ta.make(env_id)
        env.reset(num_players=2, seed=seed)
        seed += 1
        _, obs = env.get_observation()
        if rng.random() < 0.5:
            done, _ = env.step(rng.choice(legal_moves(env_id, obs)))
            if done:
                continue
            _, obs = env.get_observation()
        out.append((obs, legal_moves(env_id, obs)))
    return out


def sample(model: str, backend: str, template: str, temperature: float,
           cases: list[tuple[str, list[str]]], reverse: bool = False) -> dict[str, dict[str, int]]:
    from unstable_dask.config.model import ModelConfig
    from unstable_dask.inference.engine import get_engine
    from unstable_dask.play.prompts import extract_action, render_prompt

    cfg = ModelConfig(base=model, backend=backend, template=template, temperature=temperature,
                      max_new_tokens=24, max_model_len=1024)
    engine = get_engine(cfg)
    prompts = [render_prompt(template, reverse_moves(obs) if reverse else obs, engine.chat_prompt) for obs, _ in cases]
    counts: dict[str, dict[str, int]] = {"open": collections.Counter(), "facing": collections.Counter()}
    for gen, (_, legal) in zip(engine.generate(prompts, seed=0), cases):
        action, _ = extract_action(gen.text)
        m = _MOVE.search(action.strip())
        move = f"[{m.group(1).lower()}]" if m else None
        counts["open" if "[bet]" in legal else "facing"][move if move in legal else "invalid"] += 1
    return {k: dict(v) for k, v in counts.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--env", default="KuhnPoker-v0-single-train")
    ap.add_argument("--decisions", type=int, default=128)
    ap.add_argument("--templates", default="default,qwen3-zs,chat")
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--orders", default="listed", help="listed and/or reversed (the move lists' order)")
    ap.add_argument("--name", default="kuhn_base_moves")
    args = ap.parse_args()
    cases = decisions(args.env, args.decisions)
    results = []
    print(row("order", "template", "temperature", "open: legal / bets of legal", "facing a bet: legal / folds of legal",
              "seconds"))
    for order, template, t in itertools.product(args.orders.split(","), args.templates.split(","),
                                                (float(x) for x in args.temperatures.split(","))):
        if order not in ("listed", "reversed"):
            raise SystemExit(f"--orders: {order!r} is neither 'listed' nor 'reversed'")
        t0 = time.time()
        counts = sample(args.model, args.backend, template, t, cases, reverse=order == "reversed")
        results.append({"order": order, "template": template, "temperature": t, "counts": counts,
                        "seconds": time.time() - t0})
        o, f = counts["open"], counts["facing"]
        o_legal, f_legal = o.get("[check]", 0) + o.get("[bet]", 0), f.get("[call]", 0) + f.get("[fold]", 0)
        print(row(order, template, t, f"{o_legal} of {sum(o.values())} / {o.get('[bet]', 0)}",
                  f"{f_legal} of {sum(f.values())} / {f.get('[fold]', 0)}", f"{time.time() - t0:.0f}"))
    path = save(args.name, {"model": args.model, "env": args.env, "decisions": args.decisions,
                            "max_new_tokens": 24, "results": results}, settings=vars(args))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
