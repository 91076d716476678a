"""unstable_dask: self-play on TextArena games as Dask batch jobs over a Parquet/DuckDB lake."""
import os as _os
import warnings as _warnings

# Set before transformers is imported (workers import this package first): its weight-loading
# progress bars would interleave with the job's own progress display.
_os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# peft reads a property transformers 5 deprecated; nothing for a user to act on.
_warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
