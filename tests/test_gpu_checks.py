"""The prepared GPU check scripts, rehearsed on the CPU so that a signature change cannot break them unseen.

benchmarks/gpu_check.sh runs here with DEVICE=cpu (the same steps, small). benchmarks/gpu_check_sglang.py needs
sglang: its full rehearsal (every scheme and transport on SGLang's CPU engine) runs in `make test-sglang`
(tests/test_sglang_engine.py); here it must at least import and parse its arguments without sglang.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_script_rehearses_on_cpu(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "passed" in (tmp_path / "gpu_engine_tests.txt").read_text()
    bench = json.loads((tmp_path / "rollout_throughput_cpu.json").read_text())
    assert bench["benchmark"] and bench["rows"] and bench["ratios"]


def test_sglang_gpu_check_imports_and_parses_without_sglang():
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check_sglang.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "--device" in proc.stdout, proc.stderr[-2000:]
