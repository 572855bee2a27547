#!/usr/bin/env bash
# GPU check of the SGLang engine adapter (needs a CUDA GPU and `pip install -e '.[sglang]'`): see the docstring of
# benchmarks/gpu_check_sglang.py. Usage: bash benchmarks/gpu_check_sglang.sh [--quick] [--out FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" benchmarks/gpu_check_sglang.py "$@"
