"""unstable_dask: self-play on TextArena games as Dask batch jobs over a Parquet/DuckDB lake."""
import os as _os
import warnings as _warnings

# Set before transformers is imported (workers import this package first): its weight-loading
# progress bars would interleave with the job's own progress display.
_os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch's OpenMP threads on a CPU (the hf engine, the learner) spin this many iterations at a barrier
# before they sleep (libgomp's default: 300,000). Beside another CPU-bound process on one of 2 cores,
# a waiting thread otherwise spins through the time slice its descheduled peer needs: generation ran
# 6x and an update 16x slower; with 10,000, 2.2x and 2.1x (the share of the cores lost), and no
# slower alone (bench/loop/bench_neighbour.py). Read when torch loads libgomp, which this package
# never does at import; an exported GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# peft reads a property transformers 5 deprecated; nothing for a user to act on.
_warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
