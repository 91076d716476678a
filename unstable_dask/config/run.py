"""[run] and [cluster]: where a run's data lives and what it runs on."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from unstable_dask.config.base import MAX_WORKERS, NAME, Strict


class RunConfig(Strict):
    name: str = Field("demo", pattern=NAME)
    lake: str = "lake"
    reports: str = "reports"
    seed: int = 0
    # `loop` compacts the run's lake files every this many rounds (0: never; `run compact` by hand)
    compact_every: int = Field(0, ge=0)
    # Experiment trackers the lake is mirrored to (trackers.py) after each commit and by `run track`.
    trackers: list[Literal["wandb", "mlflow"]] = []

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
    n_workers: int = Field(2, gt=0, le=MAX_WORKERS)  # local: worker processes; local-gpu: capped at visible GPUs
    threads_per_worker: int = Field(1, gt=0)
    memory_limit: str = "auto"  # per worker; "0" disables the nanny's memory kill (vLLM workers)
    address: str = ""  # kind = "address": an existing scheduler, e.g. tcp://10.0.0.5:8786
    dashboard: bool = True
    # dask-jobqueue kinds (slurm, pbs, lsf, sge)
    queue: Optional[str] = None
    account: Optional[str] = None
    walltime: str = "01:00:00"
    cores: int = Field(4, gt=0)
    memory: str = "16GB"
    processes: int = Field(1, gt=0)
    gpus_per_job: int = Field(1, ge=0)
    jobs: int = Field(1, ge=0)  # scale(jobs=...) when adapt is off
    adapt_min: Optional[int] = Field(None, ge=0)
    adapt_max: Optional[int] = Field(None, ge=0)
    lifetime: Optional[str] = None  # worker --lifetime, e.g. "55m"
    lifetime_stagger: str = "4m"
    death_timeout: int = Field(180, gt=0)  # s a batch job's worker may take to start (and live without a scheduler)
    interface: Optional[str] = None
    job_extra_directives: list[str] = []
    worker_extra_args: list[str] = []
    job_script_prologue: list[str] = []
    extra: dict[str, Any] = {}  # any other dask-jobqueue keyword, passed through
