"""Cluster factory: a job's [cluster] section becomes a Dask Client.

`local` starts a LocalCluster of CPU workers; `address` connects to a running scheduler.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import dask
from distributed import Client, LocalCluster

from .config import ClusterConfig, JobError


@contextlib.contextmanager
def open_client(cfg: ClusterConfig) -> Iterator[Client]:
    """Yield a Client for the configured cluster and close what this call started."""
    if cfg.kind == "address":
        if not cfg.address:
            raise JobError("cluster.address must name a scheduler (e.g. tcp://host:8786) when cluster.kind = 'address'")
        with Client(cfg.address, timeout="30s") as client:
            yield client
        return
    if cfg.kind == "local":
        # Workers are non-daemonic so an engine may start subprocesses (vLLM, tokenizers pools).
        with dask.config.set({"distributed.worker.daemon": False}):
            cluster = LocalCluster(
                n_workers=cfg.n_workers, threads_per_worker=cfg.threads_per_worker,
                processes=True, memory_limit=cfg.memory_limit,
                dashboard_address=":0" if cfg.dashboard else None,
                host="127.0.0.1",
            )
        with cluster, Client(cluster) as client:
            yield client
        return
    raise JobError(f"cluster.kind {cfg.kind!r} is not available in this build")
