import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


_SESSION_CLIENTS: list = []  # the session's local_client once a test asked for it


@pytest.fixture(scope="session")
def local_client():
    """A real Dask LocalCluster with 2 worker processes, shared by the tests that play rounds."""
    from unstable_dask.cluster.client import open_client
    from unstable_dask.config import ClusterConfig
    with open_client(ClusterConfig(kind="local", n_workers=2, dashboard=False)) as client:
        _SESSION_CLIENTS.append(client)
        yield client
        _SESSION_CLIENTS.remove(client)


@pytest.fixture(scope="module", autouse=True)
def _engines_last_one_module():
    """Engines a test module left resident (in this process and in the shared cluster's workers)
    closed when the module ends. Each vLLM engine sizes its KV cache from the memory free when it
    starts (80% of it on a CPU: 18 GB for a SmolLM2 engine in this process), so engines kept from
    one module starved the next modules' engines, which then failed to start (CI, 2026-11-28)."""
    yield
    from unstable_dask.inference.engine import close_resident
    close_resident()
    for client in _SESSION_CLIENTS:
        client.run(close_resident)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private builtin-model cache (UNSTABLE_DASK_CACHE) for one test module."""
    mp = pytest.MonkeyPatch()
    mp.setenv("UNSTABLE_DASK_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session", autouse=True)
def _close_engines():
    """Engines the tests built in this process (in-process clients) closed before pytest closes its
    output: left to vLLM's exit hooks, its engine core's shutdown logs to closed streams."""
    yield
    from unstable_dask.inference.engine import close_resident
    close_resident()
