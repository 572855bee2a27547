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
from launch import demo_overrides, finish, fuzz_frames, start, wait_for_step

from qurl.outputs import books
from qurl.outputs.report import read_metrics
from qurl.wire import transport
from qurl.wire.protocol import Status, encode

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def last_step(run_dir) -> int:
    return max([r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss/policy" in r] or [0])


def pids(run_dir) -> dict:
    """logs/pids.json, read again while the launcher is rewriting it."""
    for _ in range(50):
        try:
            return json.loads((Path(run_dir) / "logs" / "pids.json").read_text())
        except (OSError, json.JSONDecodeError):
            time.sleep(0.1)
    raise AssertionError("logs/pids.json unreadable")


def wait_until(predicate, timeout=120, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# -- 1. the books ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # 20-50 s of processes: the default suite stays under 10 minutes
def test_books_balance_through_two_server_kills_and_a_learner_kill(demo_dir, tmp_path):
    """rollout-0 SIGKILLed twice, the learner once (then run.resume=true): every group lands in a named category."""
    run_dir = tmp_path / "faults"
    proc = start(demo_dir, run_dir, 40)
    wait_for_step(run_dir, 1)
    for _ in range(2):
        victim = pids(run_dir)["rollout-0"]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: pids(run_dir)["rollout-0"] != victim, what="the server's restart")
        hello = f"rollout server rollout-0-{pids(run_dir)['rollout-0']} says hello"
        wait_until(lambda: hello in (run_dir / "logs" / "learner.log").read_text(), what="the new server's hello")
        wait_for_step(run_dir, last_step(run_dir) + 2)  # so the next checkpoint's ledger holds the new session
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
    assert "DRIFT" not in (run_dir / "logs" / "learner.log").read_text()  # int8 noise stays under the drift guard
    assert b["generated"] == sum(b[k] for k in books.CATEGORIES) and b["lost_in_transit"] == 0
    assert b["used"] == (saved + 2) * 4  # batch_prompts=4 groups per step, the resumed steps included
    ledger = json.loads((run_dir / books.LEDGER).read_text())
    assert len(ledger["reports"]) >= 4  # three sessions before the learner died, at least one after
    assert ledger["buffer"]["life"] == 2
    print("books after 2 server kills and 1 learner kill:", {k: v for k, v in b.items() if k != "problems"})


@pytest.mark.slow  # ~1 minute of processes
def test_a_stopped_server_is_killed_and_restarted_by_the_watchdog(demo_dir, tmp_path):
    """SIGSTOP the rollout server: alive, silent, no exit code. qurl-async kills it after run.server_silence_s
    without a heartbeat, says so, restarts it within run.max_restarts, and the run finishes with balanced books
    (before the watchdog the learner waited async.wait_timeout_s and exited 1)."""
    run_dir = tmp_path / "wedged"
    proc = start(demo_dir, run_dir, 8, "run.server_silence_s=4", "async.wait_timeout_s=120")
    try:
        wait_for_step(run_dir, 2)
        victim = pids(run_dir)["rollout-0"]
        os.kill(victim, signal.SIGSTOP)
        code, out = finish(proc, timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, out
    line = next(line for line in out.splitlines() if "sent no heartbeat" in line)
    assert f"pid {victim}" in line and "run.server_silence_s=4" in line, line
    assert "restarting it (1/3)" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"]["rollout-0"] == 1 and summary["steps"] == 8 and summary["books"]["balanced"], summary
    print(f"watchdog: {line.strip()}")


def _ledger() -> dict:
    """Two server sessions and a learner that restarted once; balanced."""
    wire = {
        "a": {"sessions": {"s1": [5, 5]}, "life": 1, "restart_gaps": 0},  # seq 0..5 sent, 5 received
        "b": {"sessions": {"s2": [4, 5]}, "life": 2, "restart_gaps": 1},
    }
    buffer = {
        "received": 9,
        "used": 6,
        "dropped": {"stale": 1, "filter": 0, "invalid": 0, "restart": 1},
        "buffered": 1,
        "life": 2,
        "wire": wire,
    }
    reports = {
        "a": books.report({"generated": 8, "sent": 6, "bad_groups": 1, "unsent": 1}, final=False, life=1),
        "b": books.report({"generated": 7, "sent": 6, "bad_groups": 0, "unsent": 1}, final=False, life=2),
    }
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


@pytest.mark.slow  # the default suite keeps the pool's failure modes (test_rewards.py) and garbage at both sockets
# (the quick fault soak, test_soak.py): it stays under 10 minutes
def test_failing_verifier_and_fuzzed_learner_sockets_leave_a_run_that_completes(demo_dir, tmp_path, monkeypatch):
    """A `module:function` reward that hangs, crashes and returns NaN, and garbage on the learner's PULL and ROUTER
    while it trains: nothing dies, every failure is counted, the run finishes and its books balance."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "flaky"
    proc = start(demo_dir, run_dir, 3, "reward.name=reward_fns:flaky", "reward.timeout_s=0.5", "data.eval_files=[]")
    wait_until(lambda: (run_dir / "logs" / "pids.json").exists(), what="the launcher")  # endpoints are resolved
    cfg = (run_dir / "config.yaml").read_text()
    endpoints = {k: re.search(rf"{k}: (tcp://\S+)", cfg).group(1) for k in ("trajectories", "control")}
    ctx = zmq.Context()
    sent = 0
    try:
        push = transport.connect(ctx, zmq.PUSH, endpoints["trajectories"], max_bytes=1 << 20)
        dealer = transport.connect(ctx, zmq.DEALER, endpoints["control"], max_bytes=1 << 20)
        rng = np.random.default_rng(0)
        for frames in fuzz_frames(rng, None):
            push.send_multipart(frames)
            dealer.send_multipart(frames)
            sent += 1
        wait_for_step(run_dir, 1)  # the garbage was queued before the learner's first batch
        os.kill(pids(run_dir)["learner"], 0)  # still alive
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


@pytest.mark.slow  # ~1 minute of processes
def test_a_reward_function_failing_on_most_samples_is_loud_and_stops_the_run_with_exit_2(
    demo_dir, tmp_path, monkeypatch
):
    """A custom verifier that raises on a third of the answers and returns a string on another third: the console
    warns at once with the counts and the first error, and past reward.max_error_frac (0.5) the run stops with
    exit 2 and one line naming the function (it used to run to the end with exit 0 and say nothing)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "broken"
    code, out = finish(start(demo_dir, run_dir, 40, "reward.name=reward_fns:mostly_broken", "data.eval_files=[]"))
    assert code == 2, out
    warning = next(line for line in out.splitlines() if "WARNING: the reward function failed on" in line)
    assert "error" in warning and "first: error: " in warning, warning
    stop = next(line for line in out.splitlines() if "the learner stopped (exit 2)" in line)
    assert "reward.name=reward_fns:mostly_broken" in stop and "reward.max_error_frac=0.5" in stop, stop
    assert (run_dir / "checkpoints").exists()  # what was trained is kept: fix the function, then resume
    print(f"warning: {warning.strip()}\nstop: {stop.strip()}")


# -- 3: a learner with no producer waits visibly and stops on its timeout -----------------------------------------


def test_learner_without_trajectories_waits_visibly_then_stops_on_its_timeout(demo_dir, tmp_path):
    run_dir = tmp_path / "idle"
    cmd = [
        str(BIN / "qurl-learner"),
        "--config",
        "configs/demo-cpu.yaml",
        *demo_overrides(demo_dir, run_dir, 3),
        "data.eval_files=[]",
        "async.wait_timeout_s=4",
        "log.interval_s=1",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "waiting for trajectories" in proc.stderr and "no rollout server has said hello yet" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "async.wait_timeout_s" in errors[0], errors


# -- 6 and 5: the drift guard (a server on another model) and authentication against a live learner ---------------


def _other_model(demo_dir, out: Path) -> Path:
    """The demo architecture and tokenizer with fresh random weights: loads everywhere, but is another policy."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(Path(demo_dir) / "model")).save_pretrained(out)
    for f in (Path(demo_dir) / "model").iterdir():
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.slow  # 20-50 s of processes: the default suite stays under 10 minutes
def test_drift_guard_warns_on_a_server_with_another_model_and_forged_frames_are_refused(demo_dir, tmp_path):
    from test_learner import free_port

    run_dir, secret = tmp_path / "drift", "s3cret"
    endpoints = [f"transport.{k}=tcp://127.0.0.1:{free_port()}" for k in ("trajectories", "weights", "control")]
    common = [*demo_overrides(demo_dir, run_dir, 2), "data.eval_files=[]", f"transport.secret={secret}", *endpoints]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run_dir.mkdir(parents=True)
    with open(run_dir / "learner.log", "wb") as llog, open(run_dir / "server.log", "wb") as slog:
        learner = subprocess.Popen(
            [str(BIN / "qurl-learner"), "--config", "configs/demo-cpu.yaml", *common],
            cwd=ROOT,
            env=env,
            stdout=llog,
            stderr=subprocess.STDOUT,
        )
        server = subprocess.Popen(
            [
                str(BIN / "qurl-rollout-server"),
                "--config",
                "configs/demo-cpu.yaml",
                *common,
                f"model.path={_other_model(demo_dir, tmp_path / 'other')}",
            ],
            cwd=ROOT,
            env=env,
            stdout=slog,
            stderr=subprocess.STDOUT,
        )
    ctx = zmq.Context()
    try:
        push = transport.connect(ctx, zmq.PUSH, endpoints[0].split("=", 1)[1], max_bytes=1 << 20)
        dealer = transport.connect(ctx, zmq.DEALER, endpoints[2].split("=", 1)[1], max_bytes=1 << 20)
        hello = Status(type="hello", server_id="intruder", version=0)
        push.send_multipart(encode(hello, sender="intruder", session="x", seq=0))  # no HMAC
        signed = encode(hello, sender="intruder", session="x", seq=0, secret=secret.encode())
        dealer.send_multipart(signed)
        time.sleep(1.5)  # past the receiver's one-line-per-second log limit
        dealer.send_multipart(signed)  # the same stamp again
        assert learner.wait(timeout=180) == 0, (run_dir / "learner.log").read_text()[-3000:]
    finally:
        server.kill()
        server.wait()
        ctx.destroy(linger=0)
    log = (run_dir / "learner.log").read_text()
    assert "BadAuth" in log and "Replay" in log, log[-3000:]
    drift = [line for line in log.splitlines() if "DRIFT" in line]
    assert len(drift) == 1 and "model.path" in drift[0], log[-3000:]
    kl = float(re.search(r"kl_k3 (\S+) >", drift[0]).group(1))
    print(f"drift guard: first-batch kl_k3 {kl:.3g} with a different rollout model")


# -- 2. checkpoints under SIGKILL ----------------------------------------------------------------------------------

SAVER = """
import os, sys, time, torch, torch.distributed as dist
from learner import checkpoint
root, start = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + root + ".store", rank=0, world_size=1)
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])  # 50 MB of weights, 150 MB with AdamW
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 1024)).sum().backward()
opt.step()
for step in range(start, start + 1000):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)
    t = time.perf_counter()
    checkpoint.save(root, step, model, opt, {"step": step}, keep=2)
    print(step, round(time.perf_counter() - t, 3), flush=True)
"""


@pytest.mark.slow  # 20-50 s of processes: the default suite stays under 10 minutes
def test_sigkill_during_checkpoint_writes_keeps_the_newest_complete_one(tmp_path):
    """A real process writing 150 MB checkpoints in a loop, SIGKILLed at several points of a write: the newest complete
    checkpoint is found, loads, and holds that step's weights; the torn one is never picked."""
    import torch
    from safetensors.torch import load_file

    from learner import checkpoint

    root = str(tmp_path / "checkpoints")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    fingerprint = checkpoint.fingerprint(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)]))
    torn, start = 0, 1
    for fraction in (0.1, 0.4, 0.7, 0.95):
        if os.path.exists(root + ".store"):
            os.remove(root + ".store")
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, root, str(start)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        first = proc.stdout.readline().split()  # one complete save, and how long it took
        assert first, "the saver died"
        time.sleep(float(first[1]) * fraction)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        torn += any(name.startswith(".tmp-step_") for name in os.listdir(root))
        done = [int(first[0])] + [int(line.split()[0]) for line in proc.stdout.read().splitlines()]
        latest = checkpoint.find_latest(root, fingerprint)
        step = int(os.path.basename(latest).split("_")[1])
        assert step in (done[-1], done[-1] + 1)  # +1: killed after the rename, before the print
        checkpoint.check(latest, fingerprint)
        weights = load_file(os.path.join(latest, "model.safetensors"))
        assert all(bool((t == step).all()) for t in weights.values())
        assert torch.load(os.path.join(latest, "rng_rank0.pt"), weights_only=True)["cpu"].dtype == torch.uint8
        start = step + 1
    assert torn >= 2, "the kills should land inside writes"


# -- 5 and 4: nothing on an input path unpickles or evaluates; a tokenizer of another model is refused -------------

UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle"}


def test_no_pickle_or_eval_in_the_package_and_torch_load_is_weights_only():
    import ast

    found = []
    for pkg in ("qurl", "learner", "rollout_server"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                    found += [f"{where} imports {n}" for n in names if n and n.split(".")[0] in UNSAFE_MODULES]
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
                if isinstance(func, ast.Name) and name in UNSAFE_CALLS:
                    found.append(f"{where} calls {name}()")
                kwargs = {k.arg: k.value for k in node.keywords}
                if (
                    owner == "torch"
                    and name == "load"
                    and not (
                        isinstance(kwargs.get("weights_only"), ast.Constant) and kwargs["weights_only"].value is True
                    )
                ):
                    found.append(f"{where} torch.load without weights_only=True")
                if owner == "yaml" and name in ("load", "unsafe_load", "full_load"):
                    found.append(f"{where} yaml.{name}")
    assert found == [], found


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_with_one_line(demo_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(Path(demo_dir) / "model", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    cmd = [
        str(BIN / "qurl-rollout-server"),
        "--config",
        "configs/demo-cpu.yaml",
        f"model.path={model}",
        f"data.train_files=[{demo_dir}/train.jsonl]",
        "data.eval_files=[]",
        *(f"transport.{k}=tcp://127.0.0.1:9" for k in ("trajectories", "weights", "control")),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # EXIT_INPUT: qurl-async does not restart it
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "vocab_size is 100" in lines[0] and "tokenizer has" in lines[0], proc.stderr
