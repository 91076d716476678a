"""bench/play/bench_kuhn_policies.py measures what the enumeration says: its random agent draws
from a stream of its own, not the one env.reset(seed) dealt the cards from."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from unstable_dask.play import yardsticks as ys

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_kuhn_policies", ROOT / "bench" / "play" / "bench_kuhn_policies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_scores_the_best_reply_at_its_exact_value():
    bench, n = _bench(), 3000
    p = sum(bench.play("KuhnPoker-v0-single-train", bench.aggressive, g % 2, 10_000 + g) for g in range(n)) / n
    exact = float(ys.kuhn_score(ys.kuhn_expert, 1))  # 11/16: bet whenever betting is legal, never fold
    assert abs(p - exact) < 2.576 * math.sqrt(exact * (1 - exact) / n), (p, exact)  # 0.742 with the shared stream
