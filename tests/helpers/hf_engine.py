"""The hf engine the engine tests share (tests/inference/conftest.py builds it): builtin:tiny,
greedy, 12 new tokens; a test derives its variants with `GREEDY.model_copy(update=...)`."""
from unstable_dask.config import ModelConfig

GREEDY = ModelConfig(backend="hf", temperature=0.0, max_new_tokens=12, max_model_len=256, hf_max_batch=8)
