"""The learner's model load per iteration, built every time (`learn.resident = "never"`) against kept
in the process (`"auto"`): what a `loop` iteration's `time_model_load_s` holds, alone.

Makes K parent adapters of the job's LoRA shape (random LoRA weights, an AdamW state after one step,
as a trained checkpoint has), then builds the Trainer from each of them in turn, as K successive
learner iterations of one process would, handing the model back after each (Trainer.release).
`never` and `auto` sequences alternate (A B A B); under `auto` the first build of a sequence loads
(nothing is kept yet) and is left out, as is the first of `never`. CPU, the job's learn settings.

    python bench/learn/bench_resident.py [--job jobs/smollm2-tictactoe-strength.toml] [--adapters 4] [--repeats 2]

Writes bench/results/resident.json and prints a markdown row.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/learn/trainer.py", "unstable_dask/learn/resident.py"]  # what bench/stale.py checks

import torch  # noqa: E402

from unstable_dask.jobfile import load_job  # noqa: E402
from unstable_dask.learn import resident  # noqa: E402
from unstable_dask.learn.trainer import Trainer  # noqa: E402

from common import row, save  # noqa: E402


def make_adapters(job, k: int, root: Path) -> list[str]:
    out = []
    for i in range(k):
        trainer = Trainer(job, None, torch.device("cpu"))
        for p in trainer.policy.parameters():
            if p.requires_grad:
                p.data.normal_(0, 0.01)
                p.grad = torch.randn_like(p)
        trainer.optimizer.step()  # AdamW's moments, as a checkpoint carries them
        folder = root / f"ckpt-{i + 1}"
        trainer.save(folder)
        out.append(str(folder))
    return out


def builds(job, setting: str, adapters: list[str]) -> list[float]:
    """Seconds to build the Trainer from each adapter in turn, the model handed back after each."""
    job = job.model_copy(update={"learn": job.learn.model_copy(update={"resident": setting})})
    resident.clear()
    times = []
    for a in adapters:
        t = time.perf_counter()
        trainer = Trainer(job, a, torch.device("cpu"))
        times.append(time.perf_counter() - t)
        trainer.release()
    resident.clear()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="jobs/smollm2-tictactoe-strength.toml")
    ap.add_argument("--adapters", type=int, default=4, help="successive iterations per sequence")
    ap.add_argument("--repeats", type=int, default=2, help="never/auto pairs, in turn")
    args = ap.parse_args()
    job = load_job(args.job, {"learn.device": "cpu"})
    with tempfile.TemporaryDirectory(prefix="resident") as tmp:
        adapters = make_adapters(job, args.adapters, Path(tmp))
        builds(job, "never", adapters[:1])  # imports and page cache warm for both
        seqs: dict[str, list[list[float]]] = {"never": [], "auto": []}
        for _ in range(args.repeats):
            for setting in seqs:
                seqs[setting].append(builds(job, setting, adapters))
    later = {s: [t for seq in v for t in seq[1:]] for s, v in seqs.items()}  # iterations 2..K of each sequence
    med = {s: statistics.median(v) for s, v in later.items()}
    data = dict(job=args.job, model=job.model.base, builds_s=seqs, median_from_iteration_2_s=med,
                ratio_auto_over_never=med["auto"] / med["never"])
    save("resident", data, settings=vars(args))
    print(row("job", "model", "load s, never (median, iterations 2..K)", "load s, auto", "auto / never"))
    print(row(args.job, job.model.base, f"{med['never']:.2f}", f"{med['auto']:.2f}",
              f"{data['ratio_auto_over_never']:.2f}x"))


if __name__ == "__main__":
    main()
