"""Scale out on one machine (issue 11): several rollout servers under one global budget, a learner over two nodes.

Real processes throughout: `qurl-async` with 2 servers and 2 gloo learner ranks, and `torchrun --nnodes 2`
on loopback against a 2-rank single-node learner.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from launch import ROOT, demo_overrides, finish, start
from safetensors.torch import load_file

from qurl.outputs.report import read_metrics
from qurl.supervisor.launcher import free_port

BIN = os.path.dirname(sys.executable)


def _server_log(run_dir, life: int) -> str:
    """What rollout-1's life `life` (0: the first start) wrote."""
    path = run_dir / "logs" / "rollout-1.log"
    parts = path.read_text().split(" start (restart ") if path.exists() else []
    return parts[life + 1] if len(parts) > life + 1 else ""


def _wait(predicate, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.5)


def _steps(run_dir) -> int:
    return max([r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r], default=0)


@pytest.mark.slow  # 20-50 s of processes: the default suite stays under 10 minutes
def test_two_servers_and_two_ranks_share_one_budget_and_outlive_a_killed_server(demo_dir, tmp_path):
    run_dir = tmp_path / "two"
    proc = start(
        demo_dir,
        run_dir,
        2000,
        "cluster.rollout_servers=2",
        "cluster.learner_ranks=2",
        "eval.every=0",
        "checkpoint.every=0",
    )
    try:
        _wait(lambda: "applied delta weights" in _server_log(run_dir, 0))  # both servers up
        step = _steps(run_dir)
        _wait(lambda: _steps(run_dir) >= step + 5)
        os.kill(json.loads((run_dir / "logs" / "pids.json").read_text())["rollout-1"], signal.SIGKILL)
        # the launcher restarts it; the new server gets the current weights at once and a share of the budget
        _wait(lambda: "applied full weights version" in _server_log(run_dir, 1))
        step = _steps(run_dir)
        _wait(lambda: _steps(run_dir) >= step + 5)
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # a clean stop: checkpoint, books, summary
    code, out = finish(proc, timeout=300)
    assert code == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["restarts"] == {"rollout-0": 0, "rollout-1": 1}
    books = summary["books"]
    assert books["balanced"], books["problems"]
    # three server lives: rollout-0, rollout-1 before the kill and after it; the groups of each were used
    used = {sid: s["used"] for sid, s in books["servers"].items()}
    assert len(used) == 3 and all(n > 0 for n in used.values()), used
    assert sum(used.values()) == books["used"] == steps * 4
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r]
    assert len(rows) == steps
    for r in rows:  # the learner's counters: the bound held between every two batches
        assert r["admission/violations"] == 0, r
        assert r["admission/min_margin"] >= 0 and r["admission/min_held_margin"] >= 0, r
        assert r["admission/max_held"] <= r["admission/max_reserved"] <= r["admission/limit"], r
    assert max(r["admission/servers"] for r in rows) == 2
    assert any(r["admission/max_reserved"] == r["admission/limit"] for r in rows)  # the budget did bind
    # the dead server's share came back when its replacement said hello, not 30 s later
    assert re.search(
        r"rollout-1-\d+ replaces rollout-1-\d+: its budget share is returned",
        (run_dir / "logs" / "learner.log").read_text(),
    )
    print(f"{steps} steps; groups used per server life {used}")


LEARNER_SMALL = [
    "train.batch_prompts=4",
    "rollout.n_samples=4",
    "async.max_staleness=0",
    "checkpoint.every=0",
    "eval.every=0",
    "data.eval_files=[]",
    "log.interval_s=2",
    "reward.timeout_s=5",
    "run.seed=7",
]


def _endpoints() -> list[str]:
    return [f"transport.{name}=tcp://127.0.0.1:{free_port()}" for name in ("trajectories", "weights", "control")]


def _server(demo_dir, run_dir, endpoints, log):
    cmd = [
        os.path.join(BIN, "qurl-rollout-server"),
        "--config",
        "configs/demo-cpu.yaml",
        *demo_overrides(demo_dir, run_dir, 3),
        *LEARNER_SMALL,
        *endpoints,
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1")
    )


def _learners(demo_dir, run_dir, steps, endpoints, two_nodes: bool, log) -> list[subprocess.Popen]:
    args = ["--config", "configs/demo-cpu.yaml", *demo_overrides(demo_dir, run_dir, steps), *LEARNER_SMALL, *endpoints]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not two_nodes:
        return [
            subprocess.Popen(
                [os.path.join(BIN, "qurl-learner"), *args, "cluster.learner_ranks=2"],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        ]
    port = free_port()
    return [
        subprocess.Popen(
            [
                os.path.join(BIN, "torchrun"),
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--no-python",
                os.path.join(BIN, "qurl-learner"),
                *args,
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for node in (0, 1)
    ]


def _train(demo_dir, run_dir, steps, two_nodes: bool) -> dict[str, torch.Tensor]:
    """A learner (2 ranks on one node, or 1 rank on each of two torchrun nodes) and one server; the final weights."""
    endpoints = _endpoints()
    os.makedirs(run_dir / "logs", exist_ok=True)
    with open(run_dir / "logs" / "learner.log", "wb") as llog, open(run_dir / "logs" / "server.log", "wb") as slog:
        learners = _learners(demo_dir, run_dir, steps, endpoints, two_nodes, llog)
        server = _server(demo_dir, run_dir, endpoints, slog)
        try:
            deadline = time.time() + 400
            while any(p.poll() is None for p in learners) and time.time() < deadline:
                time.sleep(0.5)
            codes = [p.poll() for p in learners]
        finally:
            for p in [*learners, server]:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in [*learners, server]:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
    assert codes == [0] * len(learners), (run_dir / "logs" / "learner.log").read_text()[-3000:]
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r]
    assert [r["staleness/max"] for r in rows] == [0] * steps  # every batch on-policy: no group dropped, none raced
    manifest = json.loads((run_dir / "checkpoints" / f"step_{steps}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["files"]["rng_rank1.pt"]["size"] > 0  # rank 0 wrote rank 1's RNG
    return load_file(run_dir / "hf" / "model.safetensors")


@pytest.mark.slow  # 20-50 s of processes: the default suite stays under 10 minutes
def test_two_torchrun_nodes_train_the_same_weights_as_two_local_ranks(demo_dir, tmp_path):
    steps = 3
    two_nodes = _train(demo_dir, tmp_path / "nodes", steps, two_nodes=True)
    one_node = _train(demo_dir, tmp_path / "local", steps, two_nodes=False)
    start = load_file(os.path.join(demo_dir, "model", "model.safetensors"))
    assert two_nodes.keys() == one_node.keys()
    moved = max((two_nodes[k] - start[k]).abs().max().item() for k in start if k in two_nodes)
    gap = max((two_nodes[k] - one_node[k]).abs().max().item() for k in two_nodes)
    print(f"largest weight change over {steps} steps {moved:.2e}; two nodes vs one node: {gap:.2e}")
    assert moved > 1e-4 and gap <= 1e-5
