#!/usr/bin/env bash
# Engine checks on a CUDA machine: parity tests (fp32, int8 via _int_mm, fp8, in-place updates) on the GPU,
# then the rollout throughput benchmark with --device cuda. Results go under $OUT (default benchmarks/out).
# Needs torch (CUDA), transformers, safetensors, numpy, pytest; no pyzmq / omegaconf / math-verify.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

$PY - <<'EOF' 2>&1 | tee "$OUT/gpu_env.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      "capability", torch.cuda.get_device_capability(0))
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

QURL_TEST_DEVICE=cuda timeout 300 $PY -m pytest tests/test_engine.py tests/test_engine_quant.py -q \
    -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/gpu_engine_tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout 420 $PY benchmarks/rollout_throughput.py --device cuda --threads 4 --repeats 3 \
    --configs fp32,bf16,int8,int8+bf16,fp8-channel+bf16,fp8+bf16,hf-fp32,hf-bf16 \
    --out "$OUT/rollout_throughput_cuda.json" 2> "$OUT/rollout_throughput_cuda.log" >/dev/null
bench_rc=$?
$PY -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['ratios'], indent=1))" \
    "$OUT/rollout_throughput_cuda.json" 2>/dev/null || tail -20 "$OUT/rollout_throughput_cuda.log"
echo "engine tests rc=$tests_rc benchmark rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
