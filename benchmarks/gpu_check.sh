#!/usr/bin/env bash
# The GPU check, one prepared run of at most 9 minutes on one borrowed GPU: the embedded engine's parity tests on the
# device (fp32, bf16, int8 via _int_mm, fp8, in-place updates; <= 2 min), then benchmarks/gpu_check.py (<= 7 min:
# the learner's log-prob memory at 7B shapes, one FSDP2 step and the engine's decode at 1.5B shapes, the eval's cost).
# Needs torch (CUDA), transformers, safetensors, numpy, pytest; no pyzmq / omegaconf / math-verify / sglang.
# Results go under $OUT (default benchmarks/out); every step's figures are kept when a later one fails.
# STEPS=learner_step,decode reruns some of gpu_check.py's steps (a second try on what is left of a GPU lease).
# DEVICE=cpu rehearses the same steps on the CPU at tiny shapes (the default suite runs it so that it cannot rot).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cuda ]; then
  export QURL_CPU_KERNELS=0  # the CPU kernels are not what this checks, and a first build would eat its budget
  tests=(tests/test_engine.py tests/test_engine_quant.py)
  check=(--device cuda --budget-s 400)
else  # the rehearsal: one parity test per file and the tiny check
  tests=(tests/test_engine.py tests/test_engine_quant.py -k in_place)
  check=(--device cpu --tiny --budget-s 300)
fi

DEVICE="$DEVICE" "$PY" - <<'EOF2' 2>&1 | tee "$OUT/gpu_env.txt"
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

QURL_TEST_DEVICE="$DEVICE" timeout 120 "$PY" -m pytest "${tests[@]}" -q -p no:cacheprovider -o addopts="" 2>&1 \
  | tee "$OUT/gpu_engine_tests.txt"
tests_rc=${PIPESTATUS[0]}

[ -n "${STEPS:-}" ] && check+=(--steps "$STEPS")
timeout 410 "$PY" benchmarks/gpu_check.py "${check[@]}" --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
check_rc=${PIPESTATUS[0]}
echo "engine tests rc=$tests_rc gpu_check rc=$check_rc"
[ "$tests_rc" -eq 0 ] && [ "$check_rc" -eq 0 ]
