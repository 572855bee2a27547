"""The randomized fault soak (tests/scenarios/soak.py): a quick form in the default suite (each kind of fault once),
and a long one (three of each) compared with an undisturbed run of the same seed."""

from __future__ import annotations

import json
import math

import pytest
from soak import KINDS, soak


def _claims(result: dict, steps: int) -> None:
    """What must hold after any soak: the final step reached, balanced books with nothing counted twice, every
    checkpoint left behind intact, no process of the run left over."""
    assert result["reached_step"] == steps, result
    assert result["books_balanced"] and result["books_problems"] == [], result
    books = result["books"]
    assert books["generated"] >= books["used"] == steps * 4, books  # batch_prompts=4 groups per step, each once
    assert result["checkpoints"] and not any(result["checkpoints"].values()), result["checkpoints"]
    assert result["leftover_pids"] == [], result


def test_soak_quick(demo_dir, tmp_path):
    """Each kind of fault once (disk filling where a tmpfs can be mounted) while the demo runs 12 steps."""
    result = soak(demo_dir, tmp_path, steps=12, seed=0, faults=dict.fromkeys(KINDS, 1), pause_s=(1.0, 2.5))
    print("soak (quick):", json.dumps({k: v for k, v in result.items() if k != "books"}))
    _claims(result, 12)
    assert sum(result["faults"].values()) >= 3, result  # the run may end before the last draw


@pytest.mark.slow  # ~5 minutes: two runs of 40 steps, one under 15 faults
def test_soak_against_an_undisturbed_run(demo_dir, tmp_path):
    """Three faults of each kind over 40 steps; the final held-out accuracy (256 problems) stays within three
    standard errors of the difference of two evaluations of an undisturbed run of the same seed."""
    faults = dict.fromkeys(KINDS, 3) | {"kill_learner": 2}
    result = soak(demo_dir, tmp_path / "soak", steps=40, seed=0, faults=faults, extra=["eval.max_problems=256"])
    clean = soak(demo_dir, tmp_path / "clean", steps=40, seed=0, faults={}, extra=["eval.max_problems=256"])
    print("soak:", json.dumps({k: v for k, v in result.items() if k != "books"}))
    print("undisturbed:", json.dumps({k: clean[k] for k in ("wall_s", "acc_fp_final", "reached_step")}))
    _claims(result, 40)
    _claims(clean, 40)
    a, b = result["acc_fp_final"], clean["acc_fp_final"]
    noise = 3 * math.sqrt(max(a * (1 - a), b * (1 - b), 0.01) * 2 / 256)
    assert abs(a - b) <= noise, (a, b, noise)
