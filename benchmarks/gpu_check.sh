#!/usr/bin/env bash
# Engine checks on a CUDA machine: parity tests (fp32, int8 via _int_mm, fp8, in-place updates) on the GPU,
# then the rollout throughput benchmark with --device cuda. Results go under $OUT (default benchmarks/out).
# Needs torch (CUDA), transformers, safetensors, numpy, pytest; no pyzmq / omegaconf / math-verify.
# DEVICE=cpu rehearses the same steps on the CPU, small (the default suite runs it so that the script cannot rot).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out}"
PY="${PYTHON:-python}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cuda ]; then
  tests=(tests/test_engine.py tests/test_engine_quant.py)
  bench=(--threads 4 --repeats 3)
else  # the rehearsal: one parity test per file and the quick benchmark
  tests=(tests/test_engine.py tests/test_engine_quant.py -k in_place)
  bench=(--quick --threads 1)
fi

DEVICE="$DEVICE" $PY - <<'EOF2' 2>&1 | tee "$OUT/gpu_env.txt"
import os
import torch
if os.environ["DEVICE"] == "cuda":
    assert torch.cuda.is_available(), "no CUDA device"
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
          "capability", torch.cuda.get_device_capability(0))
else:
    print("torch", torch.__version__, "rehearsal on the CPU")
EOF2
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

QURL_TEST_DEVICE="$DEVICE" timeout 300 $PY -m pytest "${tests[@]}" -q -p no:cacheprovider -o addopts="" 2>&1 \
  | tee "$OUT/gpu_engine_tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout 420 $PY benchmarks/rollout_throughput.py --device "$DEVICE" "${bench[@]}" \
    --configs fp32,bf16,int8,int8+bf16,fp8-channel+bf16,fp8+bf16,hf-fp32,hf-bf16 \
    --out "$OUT/rollout_throughput_$DEVICE.json" 2> "$OUT/rollout_throughput_$DEVICE.log" >/dev/null
bench_rc=$?
$PY -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['ratios'], indent=1))" \
    "$OUT/rollout_throughput_$DEVICE.json" 2>/dev/null || tail -20 "$OUT/rollout_throughput_$DEVICE.log"
echo "engine tests rc=$tests_rc benchmark rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
