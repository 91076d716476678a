"""dask-jobqueue kinds (slurm, pbs, lsf, sge): one batch job runs one Dask worker.

A job's worker gets `--resources GPU=<gpus_per_job>` and the scheduler's GPU request (`--gres`
on SLURM, `ngpus` on PBS, `-gpu` on LSF, `-l gpu` on SGE); the engine task asks for all of them,
so one task at a time drives a worker's engine. With `lifetime`, workers retire gracefully
before the walltime kills them: their running tasks go back to the scheduler (a graceful
retirement does not count against the task's allowed failures) and a replacement job is
submitted, so a round loses no games. `--lifetime-restart` is deliberately not used: restarting
the worker inside the same job would only meet the walltime a few minutes later.
"""
from __future__ import annotations

import inspect
import re
from typing import Any

import dask_jobqueue
from dask.utils import parse_bytes, parse_timedelta
from dask_jobqueue.core import Job, JobQueueCluster

from unstable_dask.config import ClusterConfig
from unstable_dask.errors import JobError

JOBQUEUE_KINDS = ("slurm", "pbs", "lsf", "sge")

_CLASSES: dict[str, tuple[type[JobQueueCluster], type[Job]]] = {
    "slurm": (dask_jobqueue.SLURMCluster, dask_jobqueue.slurm.SLURMJob),
    "pbs": (dask_jobqueue.PBSCluster, dask_jobqueue.pbs.PBSJob),
    "lsf": (dask_jobqueue.LSFCluster, dask_jobqueue.lsf.LSFJob),
    "sge": (dask_jobqueue.SGECluster, dask_jobqueue.sge.SGEJob),
}

# Exported to every worker job. daemon False: vLLM V1 starts its engine core as a child process.
PROLOGUE = [
    "export DASK_DISTRIBUTED__WORKER__DAEMON=False",
    "export VLLM_WORKER_MULTIPROC_METHOD=spawn",
]

# Keys this module sets from named [cluster] keys; `extra` may not set them a second way.
_NAMED = {
    "cores": "cores", "memory": "memory", "processes": "processes", "queue": "queue",
    "account": "account", "project": "account", "walltime": "walltime", "interface": "interface",
    "job_extra_directives": "job_extra_directives", "worker_extra_args": "worker_extra_args",
    "job_script_prologue": "job_script_prologue", "resource_spec": "gpus_per_job",
    "dashboard_address": "dashboard",
}


def parse_duration(value: str, key: str) -> float:
    """Seconds in a Dask duration such as '55m' or '90s'; JobError naming `key` otherwise."""
    try:
        return float(parse_timedelta(value))
    except (ValueError, KeyError, TypeError):
        raise JobError(f"{key} has value {value!r}: expected a duration such as '55m', '3600s' or '1h'") from None


def parse_walltime(value: str) -> int:
    """Seconds in a batch walltime: 'HH:MM:SS', 'HH:MM' or 'D-HH:MM:SS'."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d{2})(?::(\d{2}))?", value.strip())
    if not m:
        raise JobError(f"cluster.walltime has value {value!r}: expected 'HH:MM:SS' (or 'D-HH:MM:SS')")
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def _walltime_for(kind: str, seconds: int) -> str:
    if kind == "lsf":  # bsub -W takes [hours:]minutes
        return f"{seconds // 3600}:{(seconds % 3600) // 60:02d}"
    return f"{seconds // 3600:02d}:{(seconds % 3600) // 60:02d}:{seconds % 60:02d}"


def _gpu_directives(cfg: ClusterConfig) -> tuple[list[str], dict[str, Any]]:
    """Extra job directives and job keywords that request cfg.gpus_per_job GPUs."""
    n = cfg.gpus_per_job
    # A site-specific GPU request written by the user (e.g. '--gpus-per-node=a100:1') wins.
    if n == 0 or any("gpu" in d.lower() for d in cfg.job_extra_directives):
        return [], {}
    if cfg.kind == "slurm":
        return [f"--gres=gpu:{n}"], {}
    if cfg.kind == "lsf":
        return [f'-gpu "num={n}"'], {}
    if cfg.kind == "sge":
        return [f"-l gpu={n}"], {}
    # PBS Pro asks for GPUs inside the select statement, next to cores and memory.
    from dask_jobqueue.pbs import pbs_format_bytes_ceil
    mem = pbs_format_bytes_ceil(parse_bytes(cfg.memory))
    return [], {"resource_spec": f"select=1:ncpus={cfg.cores}:ngpus={n}:mem={mem}"}


def _worker_args(cfg: ClusterConfig) -> list[str]:
    args = list(cfg.worker_extra_args)
    resources = f"GPU={cfg.gpus_per_job}" if cfg.gpus_per_job > 0 else ""
    if resources:
        # Merge into a user's own --resources instead of passing the flag twice (the last wins).
        for i, a in enumerate(args):
            if a == "--resources" and i + 1 < len(args):
                args[i + 1] = f"{args[i + 1]} {resources}"
                break
            if a.startswith("--resources="):
                args[i] = f"{a} {resources}"
                break
        else:
            args += ["--resources", resources]
        if cfg.memory_limit == "auto":
            # The nanny would terminate a worker at 95% of memory/processes; a vLLM worker's RSS
            # (pinned buffers, CUDA context) is not worth losing the loaded engine over, and the
            # batch system still enforces the job's memory. Repeated flag: click keeps the last.
            args += ["--memory-limit", "0"]
    if cfg.memory_limit != "auto":
        args += ["--memory-limit", cfg.memory_limit]
    if cfg.lifetime is not None:
        args += ["--lifetime", cfg.lifetime, "--lifetime-stagger", cfg.lifetime_stagger]
    return args


def _check(cfg: ClusterConfig) -> int:
    """Validate jobqueue-specific values; return the walltime in seconds."""
    walltime = parse_walltime(cfg.walltime)
    try:
        parse_bytes(cfg.memory)
    except (ValueError, TypeError):
        raise JobError(f"cluster.memory has value {cfg.memory!r}: expected a size such as '16GB'") from None
    if cfg.gpus_per_job > 0 and cfg.processes != 1:
        raise JobError(f"cluster.processes is {cfg.processes} but must be 1 when cluster.gpus_per_job > 0 "
                       f"(one worker drives a job's GPUs; for one worker per GPU use gpus_per_job = 1 and more jobs)")
    if cfg.processes > cfg.cores:
        raise JobError(f"cluster.processes ({cfg.processes}) must be <= cluster.cores ({cfg.cores})")
    if (cfg.adapt_min is None) != (cfg.adapt_max is None):
        raise JobError("cluster.adapt_min and cluster.adapt_max must be set together (adaptive scaling between them)")
    if cfg.adapt_max is not None and cfg.adapt_min is not None and cfg.adapt_min > cfg.adapt_max:
        raise JobError(f"cluster.adapt_min ({cfg.adapt_min}) must be <= cluster.adapt_max ({cfg.adapt_max})")
    if cfg.adapt_max is None and cfg.jobs == 0:
        raise JobError("cluster.jobs is 0 and adapt is off: no worker would start (set jobs >= 1 or adapt_min/adapt_max)")
    if cfg.lifetime is not None:
        life = parse_duration(cfg.lifetime, "cluster.lifetime")
        stagger = parse_duration(cfg.lifetime_stagger, "cluster.lifetime_stagger")
        if stagger > life:
            raise JobError(f"cluster.lifetime_stagger ({cfg.lifetime_stagger}) must be <= cluster.lifetime ({cfg.lifetime})")
        if life + stagger >= walltime:
            raise JobError(f"cluster.lifetime ({cfg.lifetime}) plus lifetime_stagger ({cfg.lifetime_stagger}) must be "
                           f"shorter than cluster.walltime ({cfg.walltime}), so workers retire before the job is killed")
    _, job_cls = _CLASSES[cfg.kind]
    allowed = _accepted_keywords(cfg.kind)
    for key in cfg.extra:
        if key in _NAMED:
            raise JobError(f"cluster.extra.{key} is set by cluster.{_NAMED[key]}; set it there instead")
        if key not in allowed:
            raise JobError(f"cluster.extra.{key} is not a {job_cls.__name__.removesuffix('Job')}Cluster keyword "
                           f"(known: {', '.join(sorted(allowed))})")
    return walltime


def _accepted_keywords(kind: str) -> set[str]:
    cluster_cls, job_cls = _CLASSES[kind]
    names: set[str] = set()
    for fn in (Job.__init__, job_cls.__init__, JobQueueCluster.__init__):
        names |= {p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in ("self", "job_cls")}
    return names - {"scheduler", "name", "config_name", "n_workers", "loop", "asynchronous"}


def jobqueue_kwargs(cfg: ClusterConfig) -> dict[str, Any]:
    """Keyword arguments for the kind's JobQueueCluster (job keywords and `extra` included)."""
    if cfg.kind not in JOBQUEUE_KINDS:
        raise JobError(f"cluster.kind {cfg.kind!r} submits no batch jobs; expected one of {', '.join(JOBQUEUE_KINDS)}")
    walltime = _check(cfg)
    directives, gpu_kwargs = _gpu_directives(cfg)
    kwargs: dict[str, Any] = {
        "cores": cfg.cores, "memory": cfg.memory, "processes": cfg.processes,
        "queue": cfg.queue, "walltime": _walltime_for(cfg.kind, walltime),
        "interface": cfg.interface,
        # jobqueue's default, 60 s, counts the worker process's imports (torch, vLLM): they ran past
        # it on a loaded node (tests/test_slurm.py) and do on shared file systems.
        "death_timeout": cfg.death_timeout,
        "job_extra_directives": [*cfg.job_extra_directives, *directives],
        "worker_extra_args": _worker_args(cfg),
        "job_script_prologue": [*PROLOGUE, *cfg.job_script_prologue],
        **gpu_kwargs,
    }
    if cfg.account:  # SLURM and PBS call it account (-A); LSF and SGE call it project (-P).
        kwargs["account" if cfg.kind in ("slurm", "pbs") else "project"] = cfg.account
    kwargs.update(cfg.extra)
    return kwargs


def job_script(cfg: ClusterConfig) -> str:
    """The batch script one worker job would be submitted with; starts nothing.

    The scheduler address in it is a placeholder: the real one exists only once the cluster runs.
    """
    kwargs = jobqueue_kwargs(cfg)  # a kind that is not a batch scheduler's is a one-line error here
    _, job_cls = _CLASSES[cfg.kind]
    job_kwargs = {k: v for k, v in kwargs.items() if k in _job_keywords(job_cls)}
    job = job_cls(scheduler="tcp://SCHEDULER-ADDRESS:PORT", name="dask-worker", **job_kwargs)
    return job.job_script()


def _job_keywords(job_cls: type[Job]) -> set[str]:
    return {p for fn in (Job.__init__, job_cls.__init__) for p in inspect.signature(fn).parameters}


def open_jobqueue_cluster(cfg: ClusterConfig, scheduler_options: dict[str, Any]) -> JobQueueCluster:
    """Start the kind's JobQueueCluster and ask for its workers (fixed jobs or adaptive)."""
    kwargs = jobqueue_kwargs(cfg)
    cluster_cls, _ = _CLASSES[cfg.kind]
    # jobqueue takes scheduler settings only through scheduler_options; a user's own win.
    kwargs["scheduler_options"] = {**scheduler_options, **kwargs.get("scheduler_options", {})}
    cluster = cluster_cls(**kwargs)
    try:
        if cfg.adapt_max is not None:
            cluster.adapt(minimum_jobs=cfg.adapt_min or 0, maximum_jobs=cfg.adapt_max)
        elif cfg.lifetime is not None:
            # Fixed scale does not replace a retired job; adaptive between equal bounds does.
            cluster.adapt(minimum_jobs=cfg.jobs, maximum_jobs=cfg.jobs)
        else:
            cluster.scale(jobs=cfg.jobs)
    except Exception:
        cluster.close()
        raise
    return cluster
