"""qurl-async: start the learner and the rollout server(s), supervise them, and report the run."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from qurl import books
from qurl.cli import parse
from qurl.config import ConfigError, get, run_dir, to_yaml
from qurl.layout import REPLACES_ENV, plan
from qurl.report import plot_curves, read_metrics, write_summary

PROG = "qurl-async"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Children get SIGTERM if the launcher is killed, so no orphan outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_endpoints(cfg: DictConfig) -> None:
    """Replace `auto` endpoints (and the nccl weight group's rendezvous) with free loopback ports."""
    for name in ("trajectories", "weights", "control"):
        if cfg.transport[name] == "auto":
            cfg.transport[name] = f"tcp://127.0.0.1:{free_port()}"
    if cfg.sync.transport == "nccl" and cfg.sync.group_endpoint == "auto":
        cfg.sync.group_endpoint = f"tcp://127.0.0.1:{free_port()}"


def _script(name: str) -> list[str]:
    """The console script next to this interpreter, so children run in the same environment."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return [path] if os.path.exists(path) else [name]


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: str
    proc: Optional[subprocess.Popen] = None
    restarts: int = 0
    log_file: Optional[object] = field(default=None, repr=False)

    def start(self) -> None:
        self.log_file = open(self.log_path, "ab", buffering=0)
        self.log_file.write(f"--- {self.name} start (restart {self.restarts}) ---\n".encode())
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent)

    def poll(self) -> Optional[int]:
        return self.proc.poll() if self.proc else None

    def signal(self, sig: int, group: bool = True) -> None:
        """Signal the child and everything it started, or (group=False) the child alone."""
        if self.proc and self.proc.poll() is None:
            try:
                if group:
                    os.killpg(self.proc.pid, sig)
                else:
                    self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""


def _threads_per_process(n_processes: int) -> str:
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // n_processes))


def node_gpus(cfg: DictConfig) -> tuple[Optional[int], Optional[list[str]]]:
    """(GPUs this node has, the launcher's CUDA_VISIBLE_DEVICES list); (None, None) for a CPU config."""
    if not cfg.cluster.learner_gpus and not cfg.cluster.rollout_gpus:
        return None, None
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return torch.cuda.device_count(), [v.strip() for v in visible.split(",")] if visible else None


def build_children(cfg: DictConfig, config_path: str, out: str, available_gpus: Optional[int] = None,
                   visible: Optional[list[str]] = None) -> tuple[Child, list[Child]]:
    """The learner (it spawns its own ranks) and the rollout servers, as qurl.layout.plan places them."""
    learner_plan, *server_plans = plan(cfg, available_gpus, visible)
    base_env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not cfg.cluster.learner_gpus:
        base_env["OMP_NUM_THREADS"] = _threads_per_process(cfg.cluster.learner_ranks + len(server_plans))
    logs = os.path.join(out, "logs")
    learner, *servers = [Child(p.name, _script(p.program) + ["--config", config_path], dict(base_env, **p.env),
                               os.path.join(logs, f"{p.name}.log")) for p in [learner_plan, *server_plans]]
    return learner, servers


class Progress:
    """One tqdm bar fed from metrics.jsonl: step / total, reward, tokens/s, version, staleness."""

    def __init__(self, total: int, metrics_path: str):
        from tqdm import tqdm

        self.path, self.offset, self.rows = metrics_path, 0, []
        self.bar = tqdm(total=total, desc="qurl", unit="step", dynamic_ncols=True)

    def update(self) -> None:
        if not os.path.exists(self.path):
            return
        rows = read_metrics(self.path)
        new = rows[len(self.rows):]
        self.rows = rows
        if not new:
            return
        last = new[-1]
        self.bar.n = int(last.get("step", self.bar.n))
        post = {"reward": last.get("reward/mean"), "tok/s": last.get("rollout/tokens_per_s"),
                "v": last.get("version"), "stale": last.get("staleness/mean")}
        for key in ("eval/acc_quant", "eval/acc_fp"):
            acc = [r[key] for r in rows if key in r]
            if acc:
                post[key.split("/")[1]] = acc[-1]
        self.bar.set_postfix({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in post.items()
                              if v is not None}, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def main(argv: Optional[list[str]] = None) -> int:
    cfg = parse(PROG, argv)
    out = run_dir(cfg)
    if os.path.exists(os.path.join(out, "metrics.jsonl")) and not get(cfg, "run.resume"):
        print(f"{PROG}: {out} already holds a run; pass run.resume=true to continue it, or choose another "
              f"run.name / run.dir", file=sys.stderr)
        return 2
    config_path = os.path.join(out, "config.yaml")
    try:
        learner, servers = build_children(cfg, config_path, out, *node_gpus(cfg))
    except ConfigError as exc:
        print(f"{PROG}: config error: {exc}", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    resolve_endpoints(cfg)
    cfg.run.dir = out
    config_yaml = to_yaml(cfg)
    with open(config_path, "w") as f:
        f.write(config_yaml)

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    started = time.time()
    print(f"{PROG}: run folder {out}; logs in {out}/logs/", file=sys.stderr)
    learner.start()
    for s in servers:
        s.start()
    _write_pids(out, [learner, *servers])
    progress = Progress(cfg.train.steps, os.path.join(out, "metrics.jsonl"))
    code = 0
    try:
        code = _supervise(cfg, learner, servers, progress, stop)
    finally:
        progress.close()
        _shutdown(learner, servers)
    wall = time.time() - started
    ledger = books.close_run(out, learner_ended_cleanly=learner.poll() == 0)
    summary = write_summary(out, config_yaml, wall, {"restarts": {s.name: s.restarts for s in servers},
                                                     "exit_code": code, "books": ledger})
    plot_curves(out)
    _print_summary(summary, out, code, config_path)
    return code


def _supervise(cfg: DictConfig, learner: Child, servers: list[Child], progress: Progress, stop: dict) -> int:
    max_restarts = get(cfg, "run.max_restarts")
    while True:
        time.sleep(0.5)
        progress.update()
        if stop["signal"] is not None:
            print(f"\n{PROG}: got signal {stop['signal']}; asking the learner to checkpoint and stop",
                  file=sys.stderr)
            learner.signal(signal.SIGTERM)
            _wait(learner, timeout=120)
            return 0 if learner.poll() == 0 else 1
        code = learner.poll()
        if code is not None:
            progress.update()
            if code == 0:
                return 0
            print(f"\n{PROG}: the learner exited with code {code}; last lines of its log:\n{learner.tail()}\n"
                  f"resume with: {PROG} --config <your config> run.resume=true "
                  f"(run.dir={cfg.run.dir})", file=sys.stderr)
            return 1
        for s in servers:
            code = s.poll()
            if code is None:
                continue
            if s.restarts >= max_restarts:
                print(f"\n{PROG}: {s.name} exited with code {code} and run.max_restarts={max_restarts} is used "
                      f"up; last lines of its log:\n{s.tail()}", file=sys.stderr)
                learner.signal(signal.SIGTERM)
                _wait(learner, timeout=120)
                return 1
            s.restarts += 1
            print(f"\n{PROG}: {s.name} exited with code {code}; restarting it ({s.restarts}/{max_restarts})",
                  file=sys.stderr)
            s.env[REPLACES_ENV] = str(s.proc.pid)  # the new server's hello returns the dead one's budget share
            s.start()
            _write_pids(cfg.run.dir, [learner, *servers])


def _write_pids(out: str, children: list[Child]) -> None:
    """logs/pids.json: the live process of each child, for operators (and fault-injection tests)."""
    with open(os.path.join(out, "logs", "pids.json"), "w") as f:
        json.dump({c.name: c.proc.pid for c in children if c.proc}, f)


def _wait(child: Child, timeout: float) -> None:
    if child.proc is None:
        return
    try:
        child.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.signal(signal.SIGKILL)
        child.proc.wait()


def _shutdown(learner: Child, servers: list[Child]) -> None:
    """SIGTERM everything still running, then SIGKILL what does not leave in time."""
    for child in servers:  # a server stops its own engine (SGLang's subprocesses) and reward workers in order
        child.signal(signal.SIGTERM, group=False)
    learner.signal(signal.SIGTERM)
    for child in [*servers, learner]:
        _wait(child, timeout=30)
        if child.log_file:
            child.log_file.close()


def _print_summary(summary: dict, out: str, code: int, config_path: str) -> None:
    acc = {k: summary.get(f"eval/acc_quant/{k}") for k in ("first", "final")}
    lines = [f"{PROG}: {'finished' if code == 0 else 'FAILED'} after {summary['steps']} steps "
             f"in {summary['wall_s']:.0f} s"]
    if acc["first"] is not None and acc["final"] is not None:
        lines.append(f"  held-out accuracy (quantized engine): {acc['first']:.3f} -> {acc['final']:.3f}")
    b = summary["books"]
    lines.append(f"  books: {b['generated']} groups generated, {b['used']} used, {b['dropped_stale']} dropped stale; "
                 + ("balanced" if b["balanced"] else "DO NOT BALANCE: " + "; ".join(b["problems"])))
    lines.append(f"  outputs: {out}/summary.json, {out}/curves.png, {out}/metrics.jsonl, {out}/checkpoints/")
    print("\n".join(lines), file=sys.stderr)
