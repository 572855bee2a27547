"""The mismatch alarm on a real run: a weight push broken on purpose (every int8 projection's scales reversed, by
tests/fixtures/broken_push) makes mismatch/kl_k3 jump, and the alarm fires within a few steps, long before the reward
says anything; with mismatch.stop the run checkpoints and stops with exit 3 and one line."""

from __future__ import annotations

import os
from pathlib import Path

from launch import finish, start

from qurl.outputs.report import read_metrics

BROKEN_PUSH = Path(__file__).resolve().parents[1] / "fixtures" / "broken_push"


def test_a_push_with_swapped_scales_fires_the_mismatch_alarm_within_a_few_steps(demo_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(BROKEN_PUSH), os.environ.get("PYTHONPATH")])))
    run_dir = tmp_path / "broken-push"
    code, out = finish(start(demo_dir, run_dir, 12, "mismatch.stop=true", "eval.every=0"))
    assert code == 3, out[-3000:]
    rows = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "mismatch/kl_k3" in r]
    kl = {r["step"]: r["mismatch/kl_k3"] for r in rows}
    fired = [r["step"] for r in rows if r["mismatch/alarm"]]
    print("mismatch/kl_k3 per step:", {k: round(v, 4) for k, v in kl.items()}, "fired at", fired)
    assert kl[1] < 0.1  # version 0: the server quantized the checkpoint itself, correctly
    assert fired == [rows[-1]["step"]] and fired[0] <= 6  # the first broken push lands at step 2 or 3
    assert max(kl.values()) > 20 * kl[1]
    assert "WARNING: the mismatch alarm fired" in out
    assert "the learner stopped (exit 3): qurl-learner: mismatch alarm: smoothed mismatch/kl_k3" in out
    assert (run_dir / "checkpoints" / f"step_{fired[0]}").is_dir()
