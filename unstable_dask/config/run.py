"""[run] and [cluster]: where a run's data lives and what it runs on."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from unstable_dask.config.base import MAX_WORKERS, NAME, Strict


class RunConfig(Strict):
    name: str = Field("demo", pattern=NAME)
    """The run's name: every table of the lake is partitioned by it, so runs share a lake. Letters,
    digits, `_`, `.`, `-`."""
    lake: str = "lake"
    """Where the lake lives: a local folder or an `s3://bucket/prefix` URI (needs the `s3` extra)."""
    reports: str = "reports"
    """The folder `run report` writes the run's HTML pages to (`<reports>/<run.name>/index.html`)."""
    seed: int = 0
    """Game seeds and ids derive from (seed, round, split, index); also seeds the LoRA init and the
    ratings' bootstrap."""
    compact_every: int = Field(0, ge=0)
    """`loop` compacts the run's lake files every this many rounds (0: never; `run compact` by hand)."""
    trackers: list[Literal["wandb", "mlflow"]] = []
    """Experiment trackers the lake is mirrored to after each commit and by `run track` (needs the
    `trackers` extra)."""

    @field_validator("lake", "reports")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("an empty location would write into the current folder; name a folder "
                             "(e.g. \"lake\", \"reports\") or, for the lake, an s3:// URI")
        return v

    @field_validator("lake")
    @classmethod
    def _storage(cls, v: str) -> str:
        import importlib.util
        if "://" in v:
            if not v.startswith("s3://") or len(v) <= len("s3://"):
                raise ValueError("a lake is a local folder or an s3://bucket/prefix URI (S3 or an S3-compatible store)")
            if importlib.util.find_spec("s3fs") is None:
                raise ValueError("an s3:// lake needs s3fs, which is not installed: pip install 'unstable-dask[s3]'")
        return v

    @field_validator("trackers")
    @classmethod
    def _installed(cls, v: list[str]) -> list[str]:
        import importlib.util
        missing = [t for t in dict.fromkeys(v) if importlib.util.find_spec(t) is None]
        if missing:
            raise ValueError(f"{' and '.join(missing)} is not installed: pip install 'unstable-dask[trackers]'")
        return v


ClusterKind = Literal["local", "local-gpu", "slurm", "pbs", "lsf", "sge", "address"]


class ClusterConfig(Strict):
    kind: ClusterKind = "local"
    """What runs the workers: `local` (CPU processes on this machine), `local-gpu` (one worker per
    visible GPU), `slurm`, `pbs`, `lsf`, `sge` (one batch job per worker, through dask-jobqueue), or
    `address` (an existing Dask scheduler)."""
    n_workers: int = Field(2, gt=0, le=MAX_WORKERS)
    """local: worker processes (the cores are split between them); local-gpu: at most this many,
    capped at the visible GPUs."""
    threads_per_worker: int = Field(1, gt=0)
    """Dask threads per local worker: tasks one worker runs at once."""
    memory_limit: str = "auto"
    """Memory per worker before Dask's nanny restarts it: `auto` (the machine's RAM split between
    local workers; no limit on GPU workers), a size such as `"16GB"`, or `"0"` (no limit)."""
    address: str = ""
    """kind = "address": the scheduler to connect to, e.g. `tcp://10.0.0.5:8786`."""
    dashboard: bool = True
    """Serve Dask's dashboard (on a free port; its link is printed)."""
    queue: Optional[str] = None
    """Batch kinds (slurm, pbs, lsf, sge): the queue or partition jobs are submitted to; unset: the
    system's default."""
    account: Optional[str] = None
    """Batch kinds: the account (SLURM, PBS) or project (LSF, SGE) jobs are charged to."""
    walltime: str = "01:00:00"
    """Batch kinds: each worker job's wall-clock limit, `HH:MM:SS` (or `D-HH:MM:SS`)."""
    cores: int = Field(4, gt=0)
    """Batch kinds: CPU cores each worker job asks for."""
    memory: str = "16GB"
    """Batch kinds: memory each worker job asks for (a size such as `"16GB"`)."""
    processes: int = Field(1, gt=0)
    """Batch kinds: Dask worker processes per job (at most `cores`; 1 when `gpus_per_job` > 0)."""
    gpus_per_job: int = Field(1, ge=0)
    """Batch kinds: GPUs each worker job asks for (SLURM `--gres`, PBS `ngpus`, LSF `-gpu`, SGE
    `-l gpu`), also the worker's `GPU` resource; 0: CPU-only jobs."""
    jobs: int = Field(1, ge=0)
    """Batch kinds: worker jobs kept running when adaptive scaling (`adapt_min`/`adapt_max`) is off."""
    adapt_min: Optional[int] = Field(None, ge=0)
    """Batch kinds: adaptive scaling's fewest jobs; set with `adapt_max`, at most it."""
    adapt_max: Optional[int] = Field(None, ge=0)
    """Batch kinds: adaptive scaling's most jobs; set with `adapt_min`; unset: a fixed `jobs`."""
    lifetime: Optional[str] = None
    """Workers retire gracefully after this long (Dask's `--lifetime`, e.g. `"55m"`), before the
    walltime kills them: their tasks move on and a new job replaces them; unset: they run until
    the job ends."""
    lifetime_stagger: str = "4m"
    """Random spread of `lifetime` between workers, so they do not all retire at once."""
    death_timeout: int = Field(180, gt=0)
    """Seconds a batch job's worker may take to start (its imports included) and may live without
    a scheduler."""
    interface: Optional[str] = None
    """Batch kinds: the network interface workers listen on (e.g. `"ib0"`); unset: Dask's choice."""
    job_extra_directives: list[str] = []
    """Batch kinds: extra scheduler directives, each one line of the job script (e.g.
    `"--gpus-per-node=a100:1"`; one naming `gpu` replaces the GPU request made from `gpus_per_job`)."""
    worker_extra_args: list[str] = []
    """Batch kinds: extra arguments of each job's `dask worker` command."""
    job_script_prologue: list[str] = []
    """Batch kinds: shell lines run before the worker starts (e.g. `"module load cuda"`)."""
    extra: dict[str, Any] = {}
    """Batch kinds: any other dask-jobqueue keyword, passed through (one a named key sets is refused)."""
