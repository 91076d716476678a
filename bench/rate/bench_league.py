"""The league's cost: games played by adaptive pairing vs a full round-robin until the same
separation (every adjacent pair of the ranking separated at league.confidence).

    .venv/bin/python bench/rate/bench_league.py [--seeds 2] [--checkpoints 4 8] [--gap 0.5]

Outcomes are synthetic (tests/synthetic_lake.play_league_pass: seat 0 wins with probability
sigmoid(s0 - s1 + 0.3), 10% draws), because the builtin tiny model's checkpoints are all equally
untrained (the duplicate format then splits every deal 1-1 and nothing ever separates) and a real
learning run's league takes hours on this machine. Everything else is the real league: the same
entrants (random, the base model, a run's checkpoints, on a learning curve whose steps shrink),
the real pairing (play/league.py), the rate job and the league tables (rate/league.py) on a real
lake, one pass at a time, for `league.pairing = "adaptive"` and `"round-robin"` on the same truth
and seed. Writes bench/results/league.json; the last line is the markdown row for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/rate/", "unstable_dask/play/", "unstable_dask/lake/"]  # what bench/stale.py checks for changes since a result's commit

from unstable_dask.jobfile import load_job  # noqa: E402
from unstable_dask.lake import Lake  # noqa: E402

from common import RESULTS, row, save  # noqa: E402
from helpers import synthetic_lake as sl  # noqa: E402


def truth(checkpoints: int, gap: float) -> dict[str, float]:
    """random < base < ckpt-1 < ... with steps gap x 0.85^(k-1), at least 0.6 gap: a curve that
    flattens, as learning does (steps below ~0.3 logits take thousands of games to separate)."""
    s, out = 0.0, {"random": -2 * gap, "base:builtin:tiny": 0.0}
    for k in range(1, checkpoints + 1):
        s += gap * max(0.85 ** (k - 1), 0.6)
        out[f"syn:ckpt-{k}"] = s
    return out


def league(lake: Path, pairing: str, strength: dict[str, float], seed: int, checkpoints: int) -> dict:
    for k in range(1, checkpoints + 1):
        sl.write_checkpoint(lake, "syn", k, f"ckpt-{k}", f"ckpt-{k - 1}" if k > 1 else None)
    job = load_job(None, {"run.lake": str(lake), "run.name": "syn", "league.pairing": pairing,
                          "league.entrants": ["syn:*", "base", "random"], "league.first_pass": ["random", "base"],
                          "league.games": [{"env_id": "KuhnPoker-v0-train"}], "league.deals_per_pair": 2,
                          "league.budget_per_entrant": 4000, "league.seed": seed})
    t = time.perf_counter()
    plans = sl.run_league(job, strength, seed)
    rows = Lake(lake).sql("SELECT entrant FROM league_ratings WHERE run = ? ORDER BY rank", [job.league_name]).to_pylist()
    order = [r["entrant"] for r in rows]
    return {"pairing": pairing, "seed": seed, "games": plans[-1].played, "passes": len(plans) - 1,
            "stopped": plans[-1].reason, "true_order": order == sorted(strength, key=lambda u: -strength[u]),
            "wrong_adjacent": sum(strength[a] < strength[b] for a, b in zip(order, order[1:])),
            "seconds": round(time.perf_counter() - t, 1)}


def sequential_check(trials: int = 200, looks: int = 20, per_look: int = 4) -> dict:
    """How often the league's separation rule separates two EQUAL entrants: once at a single check
    (the test's level) and ever, when checked after every pass as a league does (optional stopping)."""
    from unstable_dask.rate import bradley_terry
    from unstable_dask.rate.league import PRIOR
    rng = random.Random(0)

    def separated(wins: int, losses: int) -> bool:
        s = bradley_terry.fit([("a", "b", wins, 0, losses)], bootstrap=200, seed=0, prior=PRIOR).samples
        return max((s[:, 0] > s[:, 1]).mean(), (s[:, 1] > s[:, 0]).mean()) >= 0.95

    ever, single = 0, {n: 0 for n in (8, 20, 60)}
    for _ in range(trials):
        wins = losses = 0
        hit = False
        for _ in range(looks):
            w = sum(rng.random() < 0.5 for _ in range(per_look))
            wins, losses = wins + w, losses + per_look - w
            hit = hit or separated(wins, losses)
        ever += hit
        for n in single:
            w = sum(rng.random() < 0.5 for _ in range(n))
            single[n] += separated(w, n - w)
    return {"trials": trials, "checks": looks, "games_per_check": per_look, "ever_separated": ever / trials,
            "separated_at_one_check": {str(n): k / trials for n, k in single.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--checkpoints", type=int, nargs="*", default=[4, 8],
                    help="field sizes: checkpoints + base + random (none: keep the fields of league.json, "
                         "redo the sequential check only)")
    ap.add_argument("--gap", type=float, default=0.5, help="first checkpoint step, logits")
    args = ap.parse_args()
    fields, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.checkpoints:
            strength, runs = truth(n, args.gap), []
            for seed in range(args.seeds):
                for pairing in ("adaptive", "round-robin"):
                    runs.append(league(Path(tmp) / f"{n}-{pairing}-{seed}", pairing, strength, seed, n))
                    print(runs[-1], flush=True)
            by = {p: [r for r in runs if r["pairing"] == p] for p in ("adaptive", "round-robin")}
            ratios = [a["games"] / b["games"] for a, b in zip(by["adaptive"], by["round-robin"])]
            field = {"entrants": len(strength), "strength": strength, "runs": runs, "ratio_per_seed": ratios,
                     "ratio_mean": statistics.mean(ratios),
                     "games_mean": {p: statistics.mean(r["games"] for r in rs) for p, rs in by.items()},
                     "passes_mean": {p: statistics.mean(r["passes"] for r in rs) for p, rs in by.items()}}
            fields.append(field)
            lines.append(row(f"{len(strength)} entrants, {args.seeds} seeds", round(field["games_mean"]["adaptive"]),
                             round(field["games_mean"]["round-robin"]), f"**{field['ratio_mean']:.2f}**",
                             f"{field['passes_mean']['adaptive']:.0f} / {field['passes_mean']['round-robin']:.0f}",
                             f"{sum(r['true_order'] for r in by['adaptive'])}/{args.seeds}, "
                             f"{sum(r['true_order'] for r in by['round-robin'])}/{args.seeds}"))
    if not args.checkpoints and (RESULTS / "league.json").is_file():
        fields = json.loads((RESULTS / "league.json").read_text())["fields"]
    check = sequential_check()
    print(check)
    out = {"confidence": 0.95, "deals_per_pair": 2, "gap": args.gap, "fields": fields, "sequential_check": check,
           "outcomes": "synthetic (Bradley-Terry truth, seat edge 0.3, 10% draws)"}
    print(f"wrote {save('league', out, settings=vars(args))}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
