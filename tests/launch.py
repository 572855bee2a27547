"""Starting qurl-async on the prepared demo, as the scenario tests (tests/scenarios/) and the supervisor's tests do:
a run's overrides, start and finish, waiting for a step, the one line a refused start must print, and garbage
frames for a live run's sockets."""

import json
import os
import subprocess
import sys
import time

import numpy as np

from qurl.outputs.report import read_metrics
from qurl.wire.protocol import Status, encode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QURL_ASYNC = os.path.join(os.path.dirname(sys.executable), "qurl-async")
SMALL = [
    "train.batch_prompts=4",
    "rollout.n_samples=4",
    "eval.max_problems=32",
    "checkpoint.every=2",
    "log.interval_s=2",
    "reward.timeout_s=5",
]


def demo_overrides(demo_dir, run_dir, steps):
    return [
        f"model.path={demo_dir}/model",
        f"data.train_files=[{demo_dir}/train.jsonl]",
        f"data.eval_files=[{demo_dir}/heldout.jsonl]",
        f"run.dir={run_dir}",
        f"train.steps={steps}",
        *SMALL,
    ]


def start(demo_dir, run_dir, steps, *extra):
    cmd = [QURL_ASYNC, "--config", "configs/demo-cpu.yaml", *demo_overrides(demo_dir, run_dir, steps), *extra]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(proc, timeout=300):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def descendants_alive(pgid: int) -> list[int]:
    """Processes still in the launcher's session (children run in sessions of their own, so check by cmdline too)."""
    alive = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == pgid or int(fields[4]) == pgid:
                alive.append(int(pid))
        except (OSError, IndexError):
            continue
    return alive


def wait_for_step(run_dir, step, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        if any(r.get("step", 0) >= step for r in rows):
            return
        time.sleep(0.5)
    raise AssertionError(f"no step {step} within {timeout} s")


def refusal(out: str) -> str:
    """The console output of a refused start, which must be exactly one line."""
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    return lines[0]


def fuzz_frames(rng: np.random.Generator, secret: bytes | None) -> list[list[bytes]]:
    """Random bytes, random JSON headers, and valid messages with one field or frame broken."""
    good = encode(
        Status(type="heartbeat", server_id="fuzz", version=0), sender="fuzz", session="f", seq=0, secret=secret
    )
    out = [[rng.bytes(int(rng.integers(0, 300))) for _ in range(int(rng.integers(1, 4)))] for _ in range(60)]
    for _ in range(30):
        header = {
            "kind": rng.choice(["trajectory_group", "status", "weight_push", "x"]),
            "schema": int(rng.integers(0, 3)),
            "sender": "fuzz",
            "session": "f",
            "seq": int(rng.integers(-2, 5)),
            "auth": None,
            "arrays": [{"name": "prompt_ids", "dtype": "int32", "shape": [int(rng.integers(-1, 4))], "nbytes": 8}],
        }
        out.append([json.dumps(header).encode(), rng.bytes(8)])
    for _ in range(30):
        frames = [bytes(f) for f in good]
        i = int(rng.integers(0, len(frames)))
        b = bytearray(frames[i])
        if b:
            b[int(rng.integers(0, len(b)))] ^= 0xFF
        frames[i] = bytes(b)
        out.append(frames)
    return out
