"""What readers pay for checking each committed partition's row counts (issue 23: a data table
that lost a commit is an error, never a smaller table). On a lake of R rounds x 16 task files
written as bench_lake.py writes them, one process times, interleaved (median of --reps each):
  connect+count   Lake.connect() and a count(*) of turns, with the check and with it switched off
  check           read.check_counts alone, per data table (the work the check adds)
Writes bench/results/lake_check.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/lake/"]  # what bench/stale.py checks for changes since a result's commit

from bench_lake import QUERIES, write_round

from unstable_dask.lake import Lake, read

from common import save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    real = read.check_counts
    times: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        lake = Path(tmp) / "lake"
        for r in range(args.rounds):
            write_round(lake, r, 16, 8, rng)
        for _ in range(args.reps):
            for mode in ("on", "off"):
                read.check_counts = real if mode == "on" else (lambda *a: None)
                t = time.perf_counter()
                con = Lake(lake).connect()
                con.sql(QUERIES["count"]).fetchall()
                con.close()
                times[mode].append(time.perf_counter() - t)
        read.check_counts = real
        snap = Lake(lake).snapshot
        check = {}
        for table in ("games", "turns"):
            marker, data = snap.log("rounds"), snap.log(table)
            t = time.perf_counter()
            for _ in range(args.reps):
                real(str(lake), table, marker, data)
            check[table] = (time.perf_counter() - t) / args.reps
        files = len(snap.log("turns").paths)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"{args.rounds} rounds, {files} turns files: connect+count {on:.3f} s with the check, {off:.3f} s without "
          f"(ratio {on / off:.3f}); the check alone: games {check['games'] * 1000:.2f} ms, turns "
          f"{check['turns'] * 1000:.2f} ms")
    print(f"results: {save('lake_check', dict(rounds=args.rounds, turns_files=files, connect_count_on_s=on, connect_count_off_s=off, ratio=on / off, check_s=check), settings=vars(args))}")


if __name__ == "__main__":
    main()
