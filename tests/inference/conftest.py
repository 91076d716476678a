"""Fixtures of the hf engine tests: one torch thread, the shared greedy engine."""
import pytest
import torch

from unstable_dask.inference.engine import get_engine

from helpers.hf_engine import GREEDY


@pytest.fixture(scope="module")
def one_thread():
    # Tiny matmuls gain nothing from threads, and on a shared, oversubscribed CPU OpenMP
    # barriers made generate 10x slower (measured); restore the setting afterwards.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def engine(cache, one_thread):
    """builtin:tiny on hf, greedy (GREEDY), in a module's private model cache."""
    return get_engine(GREEDY)
