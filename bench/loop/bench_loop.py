"""A round played by `loop` right after a learner update vs the same round played by `round` alone.

The SmolLM2 job (jobs/smollm2-cpu.toml: its engine, template, sampling and generation length),
with fewer games. Each repeat starts from a copy of a lake that holds round 0 (played once, by the
base model) and runs two fresh processes:

  L  `run loop --rounds 2`: the driver trains ckpt-1 (learn in the driver process, then rate and
     report) and the workers play round 1 with it. Stopped once round 1 is committed (its own
     learner update is not timed).
  A  `run round` on a copy of L's lake taken as soon as ckpt-1 is committed: the same round (same
     checkpoint files, game ids, seeds and sampling seeds), played with nothing before it.

A runs after L has stopped, never beside it: two engine workers of 2 OpenMP threads each on a
2-core machine spin at each other's barriers, and both rounds then took over 12 min for 8 games
(a first version of this bench ran them side by side). Load from elsewhere is recorded (load
average) rather than cancelled. Tokens/s of a round = its completion tokens / (last game finished
- first game started), from the lake (the issue's definition); the figure is the median over
repeats of the per-repeat ratio L / A. Per-process CPU seconds during each round (driver, worker;
from /proc) say where the time went.

    python bench/loop/bench_loop.py [--train-games 6] [--eval-games 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/play/", "unstable_dask/inference/", "unstable_dask/learn/", "unstable_dask/lake/", "unstable_dask/cluster/", "unstable_dask/loop.py", "unstable_dask/run.py", "unstable_dask/cli.py"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save  # noqa: E402

RUN = "bench-loop"


class CpuSampler:
    """Cumulative CPU seconds of a process and its descendants, sampled every `every` seconds."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.pid, self.every, self.samples = pid, every, []  # (time, {pid: (role, cpu_s)})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.is_set():
            procs = {}
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                    cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                procs[int(entry)] = (int(stat[1]), (int(stat[11]) + int(stat[12])) / tick, cmd)
            tree, todo = {}, [self.pid]
            while todo:
                p = todo.pop()
                if p in procs:
                    role = "driver" if p == self.pid else ("worker" if b"spawn_main" in procs[p][2] else "other")
                    tree[p] = (role, procs[p][1])
                    todo += [c for c, (ppid, _, _) in procs.items() if ppid == p]
            self.samples.append((time.time(), tree))
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds per role used between two wall-clock times (nearest samples)."""
        def at(t: float) -> dict:
            return min(self.samples, key=lambda s: abs(s[0] - t))[1]
        a, b = at(t0), at(t1)
        out: dict[str, float] = {}
        for pid, (role, cpu) in b.items():
            out[role] = out.get(role, 0.0) + cpu - a.get(pid, (role, 0.0))[1]
        return out


def start_cli(args: list[str], lake: Path, overrides: list[str]) -> tuple[subprocess.Popen, CpuSampler]:
    """`python -m unstable_dask.run ...` in a fresh process, its CPU sampled."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    sets = [x for o in overrides + [f'run.lake="{lake}"', f'run.reports="{lake.parent / "reports"}"']
            for x in ("--set", o)]
    proc = subprocess.Popen([sys.executable, "-m", "unstable_dask.run", *args, *sets], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, CpuSampler(proc.pid)


def finish(proc: subprocess.Popen, sampler: CpuSampler, what: str, check: bool = True) -> None:
    err = proc.communicate(timeout=3600)[1]
    sampler.stop()
    if check and proc.returncode != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}):\n{err[-3000:]}")


def wait_for(path: Path, proc: subprocess.Popen, what: str) -> None:
    while not path.exists():
        if proc.poll() is not None:
            raise SystemExit(f"{what} ended ({proc.returncode}) before {path} appeared:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.2)


def round_figures(lake: Path, round_: int) -> dict:
    from unstable_dask.lake import Lake
    g = Lake(lake).sql("""SELECT min(started_at) AS t0, max(finished_at) AS t1, count(*) AS games
                          FROM games WHERE run = ? AND round = ?""", [RUN, round_]).to_pylist()[0]
    r = Lake(lake).sql("SELECT checkpoint_uid, completion_tokens, started_at, committed_at FROM rounds "
                 "WHERE run = ? AND round = ?", [RUN, round_]).to_pylist()[0]
    span = (g["t1"] - g["t0"]).total_seconds()
    return {"checkpoint": r["checkpoint_uid"], "games": g["games"], "completion_tokens": r["completion_tokens"],
            "play_s": span, "tok_s": r["completion_tokens"] / span,
            "window": (g["t0"].timestamp(), g["t1"].timestamp())}


def without_round(src: Path, dst: Path, round_: int) -> None:
    shutil.copytree(src, dst)
    for table in ("games", "turns", "rounds"):
        shutil.rmtree(dst / table / f"run={RUN}" / f"round={round_}", ignore_errors=True)
    (dst / "lake.duckdb").unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default=str(ROOT / "jobs" / "smollm2-cpu.toml"))
    ap.add_argument("--train-games", type=int, default=6)
    ap.add_argument("--eval-games", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    over = [f'run.name="{RUN}"', f"round.train_games={args.train_games}", f"round.eval_games={args.eval_games}",
            "cluster.dashboard=false"]
    job = ["--job", args.job]
    tmp = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    seed = tmp / "seed" / "lake"
    finish(*start_cli(["round", *job], seed, over), "round 0")  # the base model's round: every repeat starts here
    sides: dict[str, list[dict]] = {"loop": [], "alone": []}
    for i in range(args.repeats):
        lake_l, lake_a = tmp / f"loop{i}" / "lake", tmp / f"alone{i}" / "lake"
        shutil.copytree(seed.parent, lake_l.parent)
        load = os.getloadavg()[0]
        loop_proc, loop_cpu = start_cli(["loop", "--rounds", "2", *job], lake_l, over)
        wait_for(lake_l / "checkpoints" / f"run={RUN}" / "iteration=1" / "checkpoint.parquet", loop_proc, "loop")
        without_round(lake_l, lake_a, 1)
        wait_for(lake_l / "rounds" / f"run={RUN}" / "round=1" / "commit.parquet", loop_proc, "loop")
        loop_proc.send_signal(signal.SIGINT)  # round 1 is in: its learner update is not part of the figure
        finish(loop_proc, loop_cpu, "loop", check=False)
        alone = start_cli(["round", *job], lake_a, over)
        finish(*alone, "round")
        load = (load + os.getloadavg()[0]) / 2
        for name, lake, cpu in (("loop", lake_l, loop_cpu), ("alone", lake_a, alone[1])):
            fig = round_figures(lake, 1)
            fig.update(cpu_s=cpu.cpu_between(*fig.pop("window")), load_1m=load)
            sides[name].append(fig)
        lf, af = sides["loop"][-1], sides["alone"][-1]
        print(f"repeat {i}: loop {lf['tok_s']:.1f} tok/s ({lf['completion_tokens']} tokens, worker "
              f"{lf['cpu_s'].get('worker', 0):.0f} CPU s), alone {af['tok_s']:.1f} tok/s ({af['completion_tokens']} "
              f"tokens, worker {af['cpu_s'].get('worker', 0):.0f} CPU s), ratio {lf['tok_s'] / af['tok_s']:.2f}, "
              f"load {load:.1f}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(f["tok_s"] for f in v) for k, v in sides.items()}
    ratios = [lf["tok_s"] / af["tok_s"] for lf, af in zip(sides["loop"], sides["alone"])]
    ratio = statistics.median(ratios)
    cpu_per_token = {k: statistics.median(f["cpu_s"].get("worker", 0.0) / f["completion_tokens"] for f in v)
                     for k, v in sides.items()}
    driver = {k: statistics.median(f["cpu_s"].get("driver", 0.0) / f["play_s"] for f in v) for k, v in sides.items()}
    result = {"job": os.path.relpath(args.job, ROOT), "train_games": args.train_games, "eval_games": args.eval_games,
              "repeats": args.repeats, "loop_tok_s": med["loop"], "alone_tok_s": med["alone"],
              "ratio_per_repeat": ratios, "loop_vs_alone": ratio,
              "worker_cpu_s_per_token": cpu_per_token, "driver_cores_busy": driver, "runs": sides,
              "load_average_1m": statistics.median(f["load_1m"] for f in sides["loop"])}
    path = save("loop", result, settings=vars(args))
    print(row("round 1 (ckpt-1), same games and seeds, played one after the other", "tok/s (median)", "ratio (median)"))
    print(row("---", "---", "---"))
    print(row("`round` alone in a fresh process (baseline)", f"{med['alone']:.1f}", "1.00"))
    print(row("inside `loop`, right after the learner update", f"{med['loop']:.1f}", f"{ratio:.2f} (target >= 0.95)"))
    print(f"worker CPU s/token: loop {cpu_per_token['loop']:.3f}, alone {cpu_per_token['alone']:.3f}; "
          f"driver cores busy while playing: loop {driver['loop']:.2f}, alone {driver['alone']:.2f}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
