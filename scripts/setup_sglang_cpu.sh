#!/usr/bin/env bash
# Create .venv-sglang: the pinned sglang (--no-deps) plus the light imports its CPU tests need, on CPU torch.
# Never installs a CUDA torch. Run the tests with:
#   .venv-sglang/bin/python -m pytest tests/test_sglang.py -q -p no:cacheprovider
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${QURL_SGLANG_VENV:-.venv-sglang}"
python="${PYTHON:-python3}"
stamp="$venv/.qurl-sglang-$(sha256sum "$0" | cut -c1-16)"
[ -f "$stamp" ] && exit 0
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"

pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
echo "torch==2.13.0" > "$pins"  # a constraint on every step below: nothing may swap in sglang's CUDA torch 2.14.1
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$pins")

echo "setup-sglang: CPU torch 2.13.0"
"${pip[@]}" torch==2.13.0
echo "setup-sglang: sglang 0.5.23 without its dependencies, plus triton and tvm-ffi (imported at module level)"
"${pip[@]}" --no-deps sglang==0.5.23 triton==3.9.0 apache-tvm-ffi==0.1.11
echo "setup-sglang: the pure-Python (and small) imports of the modules the tests use"
"${pip[@]}" numpy msgspec psutil pydantic orjson packaging requests pybase64 pyzmq pillow starlette tqdm ipython \
  aiohttp dill gguf partial-json-parser uvloop uvicorn fastapi setproctitle einops openai==2.8.0 \
  transformers==5.19.0 tokenizers==0.23.2 sentencepiece==0.2.1 compressed-tensors==0.18.0
echo "setup-sglang: qurl (no deps) and the test runner"
"${pip[@]}" --no-deps -e .
"${pip[@]}" omegaconf safetensors pytest pytest-timeout
touch "$stamp"
