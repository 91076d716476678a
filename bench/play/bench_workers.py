"""Scale-out: games/s of one round job on 1 and on 2 local workers, and SLURM worker start-up.

  W1, W2   the same job (builtin tiny model, hf backend) played by `play_round` on a LocalCluster
           of 1 and of 2 worker processes; each cluster plays a warm-up round first, so engine
           start-up is not in the timed rounds (median of --repeats).
           Ratio = W2 / W1 (ideal 2.0 with >= 2 free cores).
  SLURM    `open_client(kind = "slurm")` with two 1-GPU jobs (fake GRES) on the localhost SLURM
           of scripts/slurm-localhost.sh: seconds from submit until both workers are connected,
           and from close until squeue is empty; median of --slurm-repeats. Skipped when that
           SLURM is not running (start it with `make slurm-up`).

    python bench/play/bench_workers.py [--games 24] [--repeats 3] [--slurm-repeats 3]
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/play/", "unstable_dask/inference/", "unstable_dask/cluster/", "unstable_dask/lake/"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save  # noqa: E402

SLURM_DIR = os.environ.get("SLURM_LOCAL_DIR", "/tmp/unstable-dask-slurm")


def games_per_s(n_workers: int, games: int, repeats: int, tmp: str) -> dict:
    from unstable_dask.cluster.client import open_client
    from unstable_dask.jobfile import load_job
    from unstable_dask.play.round import play_round

    # Equal tasks, several per worker, so both layouts get the same work in the same pieces.
    job = load_job(None, {"run.lake": f"{tmp}/w{n_workers}", "run.reports": f"{tmp}/r{n_workers}",
                          "round.train_games": games, "round.eval_games": 0, "round.games_per_task": 2,
                          "round.concurrency": 2, "round.max_turns": 12, "round.error_allowance": 10_000,
                          "model.max_new_tokens": 16, "cluster.kind": "local",
                          "cluster.n_workers": n_workers, "cluster.dashboard": False})
    with open_client(job.cluster) as client:
        warm = job.model_copy(update={"round": job.round.model_copy(update={"train_games": 2 * 2 * n_workers})})
        play_round(warm, client=client)  # every worker loads its engine here
        walls = [play_round(job, client=client).wall_s for _ in range(repeats)]
    wall = statistics.median(walls)
    return {"workers": n_workers, "games": games, "wall_s": [round(w, 2) for w in walls],
            "games_per_s": round(games / wall, 3)}


def slurm_running() -> bool:
    script = os.path.join(ROOT, "scripts", "slurm-localhost.sh")
    return subprocess.run(["bash", script, "status"], capture_output=True).returncode == 0


def slurm_startup(repeats: int, tmp: str) -> dict:
    from unstable_dask.cluster.client import open_client
    from unstable_dask.config import ClusterConfig

    os.environ["SLURM_CONF"] = f"{SLURM_DIR}/slurm.conf"
    cfg = ClusterConfig(kind="slurm", queue="debug", cores=1, memory="1GB", gpus_per_job=1, jobs=2,
                        walltime="00:10:00", interface="lo", dashboard=False,
                        extra={"log_directory": f"{tmp}/slurm-logs"})
    ready, drained = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with open_client(cfg) as client:
            client.wait_for_workers(2, timeout=120)
            ready.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        while subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip():
            time.sleep(0.1)
        drained.append(time.perf_counter() - t1)
    return {"jobs": 2, "repeats": repeats, "ready_s": [round(x, 2) for x in ready],
            "ready_median_s": round(statistics.median(ready), 2),
            "cancel_median_s": round(statistics.median(drained), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--games", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per layout; the median is reported")
    ap.add_argument("--slurm-repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-workers-")
    atexit.register(shutil.rmtree, tmp, True)
    load = os.getloadavg()[0]
    w1 = games_per_s(1, args.games, args.repeats, tmp)
    w2 = games_per_s(2, args.games, args.repeats, tmp)
    ratio = round(w2["games_per_s"] / w1["games_per_s"], 2)
    slurm = slurm_startup(args.slurm_repeats, tmp) if slurm_running() else None
    path = save("bench_workers", {"w1": w1, "w2": w2, "ratio_w2_w1": ratio,
                                  "slurm": slurm, "load_average_at_start": round(load, 2)}, settings=vars(args))
    print(row("games", "1 worker games/s", "2 workers games/s", "ratio", "SLURM 2 workers ready (s)",
              "SLURM cancel (s)", "load avg"))
    print(row("---", "---", "---", "---", "---", "---", "---"))
    print(row(args.games, w1["games_per_s"], w2["games_per_s"], ratio,
              slurm["ready_median_s"] if slurm else "n/a", slurm["cancel_median_s"] if slurm else "n/a",
              round(load, 1)))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
