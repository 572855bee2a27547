"""Reliability guarantees (docs/RELIABILITY.md) checked with real processes: the books balance through SIGKILLs of
the rollout server and the learner, failing verifiers and fuzzed sockets leave a run that completes, a learner
without trajectories waits visibly and stops on its timeout, and a wrong rollout model trips the drift guard.
"""
from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from qurl import books, transport
from qurl.protocol import Status, encode
from qurl.report import read_metrics
from test_async import demo_overrides, finish, start, wait_for_step

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def last_step(run_dir) -> int:
    return max([r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss/policy" in r] or [0])


def pids(run_dir) -> dict:
    return json.loads((Path(run_dir) / "logs" / "pids.json").read_text())


def wait_until(predicate, timeout=120, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# -- 1. the books ------------------------------------------------------------------------------------------------


def test_books_balance_through_two_server_kills_and_a_learner_kill(demo_dir, tmp_path):
    """rollout-0 SIGKILLed twice, the learner once (then run.resume=true): every group lands in a named category."""
    run_dir = tmp_path / "faults"
    proc = start(demo_dir, run_dir, 40)
    wait_for_step(run_dir, 1)
    for _ in range(2):
        victim = pids(run_dir)["rollout-0"]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: pids(run_dir)["rollout-0"] != victim, what="the server's restart")
        wait_for_step(run_dir, last_step(run_dir) + 2)  # the new server's groups are being trained on
    wait_until(lambda: (run_dir / "checkpoints" / f"step_{last_step(run_dir)}").exists(), what="a checkpoint")
    os.kill(pids(run_dir)["learner"], signal.SIGKILL)
    code, out = finish(proc)
    assert code != 0 and "run.resume=true" in out
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["restarts"]["rollout-0"] == 2 and first["books"]["balanced"], first["books"]
    saved = max(int(d.name.split("_")[1]) for d in (run_dir / "checkpoints").glob("step_*"))

    code, out = finish(start(demo_dir, run_dir, saved + 2, "run.resume=true"))
    assert code == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    b = summary["books"]
    assert b["balanced"] and b["problems"] == [], b
    assert b["generated"] == sum(b[k] for k in books.CATEGORIES) and b["lost_in_transit"] == 0
    assert b["used"] == (saved + 2) * 4  # batch_prompts=4 groups per step, the resumed steps included
    ledger = json.loads((run_dir / books.LEDGER).read_text())
    assert len(ledger["reports"]) >= 4  # three sessions before the learner died, at least one after
    assert ledger["buffer"]["life"] == 2
    print("books after 2 server kills and 1 learner kill:", {k: v for k, v in b.items() if k != "problems"})


def _ledger() -> dict:
    """Two server sessions and a learner that restarted once; balanced."""
    wire = {"a": {"sessions": {"s1": [5, 5]}, "life": 1, "restart_gaps": 0},  # seq 0..5 sent, 5 received
            "b": {"sessions": {"s2": [4, 5]}, "life": 2, "restart_gaps": 1}}
    buffer = {"received": 9, "used": 6, "dropped": {"stale": 1, "filter": 0, "invalid": 0, "restart": 1},
              "buffered": 1, "life": 2, "wire": wire}
    reports = {"a": books.report({"generated": 8, "sent": 6, "bad_groups": 1, "unsent": 1}, final=False, life=1),
               "b": books.report({"generated": 7, "sent": 6, "bad_groups": 0, "unsent": 1}, final=False, life=2)}
    return {"buffer": buffer, "reports": reports}


def test_books_name_every_loss_and_the_check_fails_on_a_double_count_or_a_vanished_group():
    closed = books.close(_ledger(), {}, learner_ended_cleanly=True)
    assert closed["balanced"], closed["problems"]
    assert closed["generated"] == 15 and closed["received"] == 9
    assert (closed["unsent_at_exit"], closed["bad_groups"], closed["lost_in_transit"]) == (2, 1, 2)
    assert closed["lost_at_learner_restart"] == 1  # b's seq gap across the resume
    assert closed["undelivered_at_end"] == 0

    twice = _ledger()
    twice["buffer"]["received"] += 1  # one group booked twice by the buffer
    twice["buffer"]["used"] += 1
    assert not books.close(twice, {}, True)["balanced"]
    vanished = _ledger()
    vanished["buffer"]["used"] -= 1  # received, then in no category
    assert "used + dropped" in " ".join(books.close(vanished, {}, True)["problems"])
    dup_seq = _ledger()
    dup_seq["buffer"]["wire"]["a"]["sessions"]["s1"] = [7, 5]  # more accepted than seq numbers sent
    dup_seq["buffer"]["received"] += 2
    dup_seq["buffer"]["used"] += 2
    assert "counted twice" in " ".join(books.close(dup_seq, {}, True)["problems"])
    server = _ledger()
    server["reports"]["a"]["generated"] += 1  # the server lost track of a group
    assert "server's own counters" in " ".join(books.close(server, {}, True)["problems"])
    final = copy.deepcopy(_ledger())
    exits = {"a": books.report({"generated": 8, "sent": 5, "bad_groups": 1, "unsent": 2}, final=True)}
    assert "final count" in " ".join(books.close(final, exits, True)["problems"])  # seq 5 seen, only 5 sent


# -- 3 and 4: failing verifiers and fuzzed sockets, in one run -----------------------------------------------------


def _fuzz_frames(rng: np.random.Generator, secret: bytes | None) -> list[list[bytes]]:
    """Random bytes, random JSON headers, and valid messages with one field or frame broken."""
    good = encode(Status(type="heartbeat", server_id="fuzz", version=0), sender="fuzz", session="f", seq=0,
                  secret=secret)
    out = [[rng.bytes(int(rng.integers(0, 300))) for _ in range(int(rng.integers(1, 4)))] for _ in range(60)]
    for _ in range(30):
        header = {"kind": rng.choice(["trajectory_group", "status", "weight_push", "x"]), "schema": int(rng.integers(0, 3)),
                  "sender": "fuzz", "session": "f", "seq": int(rng.integers(-2, 5)), "auth": None,
                  "arrays": [{"name": "prompt_ids", "dtype": "int32", "shape": [int(rng.integers(-1, 4))], "nbytes": 8}]}
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


def test_failing_verifier_and_fuzzed_learner_sockets_leave_a_run_that_completes(demo_dir, tmp_path, monkeypatch):
    """A `module:function` reward that hangs, crashes and returns NaN, and garbage on the learner's PULL and ROUTER
    while it trains: nothing dies, every failure is counted, the run finishes and its books balance."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "flaky"
    proc = start(demo_dir, run_dir, 4, "reward.name=reward_fns:flaky", "reward.timeout_s=1", "data.eval_files=[]")
    wait_for_step(run_dir, 1)
    cfg = (run_dir / "config.yaml").read_text()
    endpoints = {k: re.search(rf"{k}: (tcp://\S+)", cfg).group(1) for k in ("trajectories", "control")}
    ctx = zmq.Context()
    sent = 0
    try:
        push = transport.connect(ctx, zmq.PUSH, endpoints["trajectories"], max_bytes=1 << 20)
        dealer = transport.connect(ctx, zmq.DEALER, endpoints["control"], max_bytes=1 << 20)
        rng = np.random.default_rng(0)
        for frames in _fuzz_frames(rng, None):
            push.send_multipart(frames)
            dealer.send_multipart(frames)
            sent += 1
        time.sleep(1.0)
        learner = pids(run_dir)["learner"]
        os.kill(learner, 0)  # still alive
    finally:
        ctx.destroy(linger=1000)
    code, out = finish(proc)
    assert code == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    status = summary["totals"]["reward_status"]
    assert status.get("nan", 0) > 0 and status.get("ok", 0) > 0, status
    assert status.get("timeout", 0) + status.get("error", 0) > 0, status
    assert summary["books"]["balanced"], summary["books"]
    assert summary["restarts"]["rollout-0"] == 0
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "buffer/bad_messages" in r]
    assert rows[-1]["buffer/bad_messages"] >= sent  # every garbage message on the PULL socket counted
    assert "dropped a bad message" in (run_dir / "logs" / "learner.log").read_text()
    print("reward statuses of trained samples:", status, "; fuzz messages per socket:", sent)


# -- 3: a learner with no producer waits visibly and stops on its timeout -----------------------------------------


def test_learner_without_trajectories_waits_visibly_then_stops_on_its_timeout(demo_dir, tmp_path):
    run_dir = tmp_path / "idle"
    cmd = [str(BIN / "qurl-learner"), "--config", "configs/demo-cpu.yaml",
           *demo_overrides(demo_dir, run_dir, 3), "data.eval_files=[]", "async.wait_timeout_s=4", "log.interval_s=1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "waiting for trajectories" in proc.stderr and "no rollout server has said hello yet" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "async.wait_timeout_s" in errors[0], errors
