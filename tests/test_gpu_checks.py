"""The prepared GPU check scripts, rehearsed on the CPU so that a signature change cannot break them unseen.

benchmarks/gpu_check.sh runs here with DEVICE=cpu (the same steps, tiny shapes). benchmarks/gpu_check_sglang.py needs
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
    """The whole prepared check at tiny shapes, with the device's missing packages hidden: the parity tests, then every
    step of gpu_check.py, each a figure."""
    device_python = str(ROOT / "tests" / "fixtures" / "device_python")  # without pyzmq, omegaconf, sglang, ...
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path), "PYTHON": sys.executable, "PYTHONPATH": device_python}
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "passed" in (tmp_path / "gpu_engine_tests.txt").read_text()
    check = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = check["steps"]
    assert list(steps) == ["logprob_memory", "learner_step", "decode", "eval_time"], steps
    assert not [name for name, step in steps.items() if "error" in step or "skipped" in step], steps
    heads = {(r["head"], r["tokens"]) for r in steps["logprob_memory"]["rows"]}
    assert heads == {("dense", 256), ("chunked", 256)}
    assert steps["learner_step"]["updates"] == 2 and steps["learner_step"]["step_s"] > 0
    assert {(r["format"], r["batch"]) for r in steps["decode"]["rows"]} == {
        (f, b) for f in ("bf16", "int8", "fp8") for b in (16, 64)
    }
    assert all(r["tokens_per_s"] > 0 for r in steps["decode"]["rows"]), steps["decode"]
    assert steps["eval_time"]["eval_s_estimate"] > 0 and len(steps["eval_time"]["points"]) == 4
    assert sum(step["seconds"] for step in steps.values()) < 300  # inside the budget it was given


def test_gpu_check_keeps_every_figure_when_a_later_step_fails(tmp_path):
    """The harness: a step that raises or overruns is recorded and the next one runs; the JSON on disk holds every
    figure from before (run with steps that return at once, so the limits are the only thing timed)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_check import BUDGETS, run_steps
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def run(name: str, limit: float) -> dict:
        if name == "learner_step":
            raise RuntimeError("CUDA out of memory. Tried to allocate 9.50 GiB")
        if name == "decode":
            raise subprocess.TimeoutExpired("gpu_check.py --step decode", limit)
        return {"figure": name}

    out = tmp_path / "check.json"
    result = {"steps": {}}
    run_steps(["logprob_memory", "learner_step", "decode", "eval_time"], run, 400.0, result, str(out))
    steps = json.loads(out.read_text())["steps"]
    assert steps["logprob_memory"]["figure"] == "logprob_memory" and steps["eval_time"]["figure"] == "eval_time"
    assert steps["learner_step"]["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 9.50 GiB"
    assert steps["decode"]["error"] == f"over its {BUDGETS['decode']} s limit"
    result = {"steps": {}}
    run_steps(["logprob_memory", "eval_time"], run, 5.0, result, str(out))  # 5 s left: nothing starts
    assert all("skipped" in step for step in json.loads(out.read_text())["steps"].values())


def test_sglang_gpu_check_imports_and_parses_without_sglang():
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check_sglang.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "--device" in proc.stdout, proc.stderr[-2000:]
