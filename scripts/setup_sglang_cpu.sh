#!/usr/bin/env bash
# Create .venv-sglang: torch 2.14.1 + torchvision 0.29.1 (the pair sglang 0.5.23 pins), sglang 0.5.23 with all
# its dependencies, and qurl with its test extras. About 11 GB and 5 minutes on a fresh machine; idempotent.
# The real sglang.Engine then runs on a CPU (unquantized) under tests/sglang_cpu/ (see tests/test_sglang_engine.py).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${QURL_SGLANG_VENV:-.venv-sglang}"
python="${PYTHON:-python3}"
stamp="$venv/.qurl-sglang-$(cat "$0" pyproject.toml | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0
# The install needs about 11 GB; on a fuller disk pip dies half-way with ENOSPC, so say so first, in one line.
need_gb="${QURL_SGLANG_NEED_GB:-12}"
free_kb="$(df -Pk "$(dirname "$venv")" 2>/dev/null | awk 'NR==2 {print $4}' || true)"  # empty where df cannot tell
free_gb=$(( ${free_kb:-0} / 1048576 ))
if [ -n "$free_kb" ] && [ "$free_gb" -lt "$need_gb" ]; then
  echo "setup-sglang: $free_gb GB free on the disk of $venv; the SGLang venv needs about $need_gb GB (free space, or set QURL_SGLANG_VENV to a roomier disk)" >&2
  exit 2
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"

pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
printf 'torch==2.14.1\ntorchvision==0.29.1\nsglang==0.5.23\n' > "$pins"
# --no-cache-dir: the CUDA wheels would otherwise sit twice on disk (cache + venv), several GB on a small CI disk
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir -c "$pins")

echo "setup-sglang: torch 2.14.1 + torchvision 0.29.1 (a CUDA build; it runs on a CPU)"
"${pip[@]}" torch==2.14.1 torchvision==0.29.1
echo "setup-sglang: sglang 0.5.23 with its dependencies, and qurl[test] (a few minutes)"
"${pip[@]}" sglang==0.5.23 -e ".[test]"
"$venv/bin/python" -m pip check --disable-pip-version-check || echo "setup-sglang: pip check reports the above"
touch "$stamp"
