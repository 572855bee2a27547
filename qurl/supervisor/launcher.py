"""qurl-async: start the learner and the rollout server(s), supervise them, and report the run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from qurl.config import ConfigError, get, run_dir, to_yaml
from qurl.outputs import books, checkpoint_files
from qurl.outputs.checkpoint_files import step_dirs
from qurl.outputs.metrics import truncate_after
from qurl.outputs.report import (
    NO_ANSWER_STEPS,
    NO_SIGNAL_STEPS,
    no_answer_streak,
    no_signal_streak,
    plot_curves,
    read_metrics,
    write_summary,
)
from qurl.rewards import BUILTIN, FAILED_STATUSES
from qurl.supervisor import environment, preflight, run_folder
from qurl.supervisor.cli import EXIT_DIVERGED, EXIT_FAULT, EXIT_INPUT, die_with_parent, parse
from qurl.supervisor.layout import HEARTBEAT_ENV, LEND_CORES_ENV, REPLACES_ENV, plan

PROG = "qurl-async"


# What SGLang sets in its own processes where these are unset; the learner must broadcast with the same values
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


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
    proc: subprocess.Popen | None = None
    restarts: int = 0
    log_file: object | None = field(default=None, repr=False)
    heartbeat: str | None = None  # a rollout server's heartbeat file (HEARTBEAT_ENV), touched by its loop

    def start(self) -> None:
        if self.heartbeat:  # a fresh life is not watched until its loop beats
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.heartbeat)
        self.log_file = open(self.log_path, "ab", buffering=0)
        self.log_file.write(f"--- {self.name} start (restart {self.restarts}) ---\n".encode())
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def silent_s(self) -> float | None:
        """Seconds since its loop last beat; None before the first beat of this life (it is still loading)."""
        try:
            return time.time() - os.stat(self.heartbeat).st_mtime if self.heartbeat else None
        except FileNotFoundError:
            return None

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

    def last_line(self) -> str:
        """The last non-empty line of its log: a child that refuses to run says why there, in one line."""
        lines = [line for line in self.tail(5).splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(its log is empty)"

    def tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""


def threads_per_process(cfg: DictConfig, n_servers: int, cores: int | None = None) -> str:
    """OMP threads for each CPU process: the cores split among the processes that compute at the same time.

    Asynchronous, the learner ranks and the servers all run at once; synchronous (async.max_staleness 0),
    the servers wait while the learner trains and the learner waits while they generate, so each side
    gets the cores to itself. An OMP_NUM_THREADS the user set wins.
    """
    ranks = cfg.cluster.learner_ranks
    at_once = max(ranks, n_servers) if get(cfg, "async.max_staleness") == 0 else ranks + n_servers
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (cores or os.cpu_count() or 1) // at_once))


def lend_cores(cfg: DictConfig) -> str | None:
    """For a CPU learner: every core, when it may take its servers' share while they wait (learner/core_lending.py):
    async, one rank beside CPU servers, cluster.lend_idle_cores on, and the thread split qurl-async's own; else None."""
    if (
        get(cfg, "async.max_staleness") == 0
        or cfg.cluster.learner_ranks != 1
        or cfg.cluster.rollout_gpus
        or get(cfg, "rollout.device") != "cpu"
        or not get(cfg, "cluster.lend_idle_cores")
        or "OMP_NUM_THREADS" in os.environ
    ):
        return None
    return str(os.cpu_count() or 1)


def node_gpus(cfg: DictConfig) -> tuple[int | None, list[str] | None]:
    """(GPUs this node has, the launcher's CUDA_VISIBLE_DEVICES list); (None, None) for a CPU config."""
    if not cfg.cluster.learner_gpus and not cfg.cluster.rollout_gpus:
        return None, None
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return torch.cuda.device_count(), [v.strip() for v in visible.split(",")] if visible else None


def build_children(
    cfg: DictConfig, config_path: str, out: str, available_gpus: int | None = None, visible: list[str] | None = None
) -> tuple[Child, list[Child]]:
    """The learner (it spawns its own ranks) and the rollout servers, as qurl.supervisor.layout.plan places them."""
    learner_plan, *server_plans = plan(cfg, available_gpus, visible)
    base_env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not cfg.cluster.learner_gpus:
        base_env["OMP_NUM_THREADS"] = threads_per_process(cfg, len(server_plans))
        lend = lend_cores(cfg)
        if lend is not None:
            learner_plan.env[LEND_CORES_ENV] = lend
    if get(cfg, "sync.transport") == "nccl":  # one NCCL setting on both ends of the weight broadcasts
        base_env.update({k: base_env.get(k, v) for k, v in NCCL_ENV.items()})
    logs = os.path.join(out, "logs")
    learner, *servers = [
        Child(
            p.name,
            _script(p.program) + ["--config", config_path],
            dict(base_env, **p.env),
            os.path.join(logs, f"{p.name}.log"),
        )
        for p in [learner_plan, *server_plans]
    ]
    for server in servers:
        server.heartbeat = server.env[HEARTBEAT_ENV] = os.path.join(logs, f"{server.name}.alive")
    return learner, servers


class ProgressBar:
    """One tqdm bar fed from metrics.jsonl: step / total, reward, tokens/s, version, staleness, accuracies."""

    def __init__(self, total: int, metrics_path: str, start: int = 0, reward: str = "math"):
        from tqdm import tqdm

        self.path, self.reward = metrics_path, reward
        self.bar = tqdm(total=total, initial=start, desc="qurl", unit="step", dynamic_ncols=True)
        self.no_signal_warned = self.no_answer_warned = self.reward_failure_warned = self.alarm_warned = False

    def _warn_reward_failures(self, train: list[dict]) -> bool:
        """Once, at the first failed score: how many failed so far, and the first one's type and message."""
        failed, seen, first = reward_failures(train)
        if not failed:
            return False
        kinds = ", ".join(f"{v} {k}" for k, v in sorted(failed.items()))
        self.bar.write(
            f"{PROG}: WARNING: the reward function failed on {sum(failed.values())} of {seen} scored samples so far "
            f"({kinds}; each scored 0); first: {first}; the run stops past reward.max_error_frac"
        )
        return True

    def update(self) -> None:
        """Show the newest training row (eval rows carry no reward) and the newest accuracies."""
        rows = read_metrics(self.path)
        train = [r for r in rows if "reward/mean" in r]
        if not train:
            return
        last = train[-1]
        self.bar.n = max(self.bar.n, int(last["step"]))  # rows are whole steps after the resume point: never backwards
        post = {
            "reward": last.get("reward/mean"),
            "tok/s": last.get("rollout/tokens_per_s"),
            "v": last.get("version"),
            "stale": last.get("staleness/mean"),
        }
        for key in ("eval/acc_quant", "eval/acc_fp"):
            acc = [r[key] for r in rows if key in r]
            if acc:
                post[key.split("/")[1]] = acc[-1]
        self.bar.set_postfix(
            {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in post.items() if v is not None}, refresh=False
        )
        self.bar.refresh()
        if not self.reward_failure_warned:
            self.reward_failure_warned = self._warn_reward_failures(train)
        alarm = next((r for r in train if r.get("mismatch/alarm")), None)
        if alarm is not None and not self.alarm_warned:
            self.alarm_warned = True
            self.bar.write(
                f"{PROG}: WARNING: the mismatch alarm fired at step {alarm['step']}: smoothed mismatch/kl_k3 "
                f"{alarm.get('mismatch/kl_k3_smoothed', float('nan')):.3g} above mismatch.max_kl for "
                "mismatch.alarm_steps steps; suspect the weight push (logs/learner.log has the line)"
            )
        streak = no_answer_streak(rows)
        if streak >= NO_ANSWER_STEPS and not self.no_answer_warned:
            self.no_answer_warned = True
            self.bar.write(f"{PROG}: WARNING: {no_answer_line(streak, self.reward)}")
        streak = no_signal_streak(rows)
        if streak >= NO_SIGNAL_STEPS and not self.no_signal_warned:
            self.no_signal_warned = True
            self.bar.write(
                f"{PROG}: WARNING: no reward signal for {streak} steps (every group's samples got the "
                "same reward, so every advantage and gradient is 0); check reward.name and the data's "
                "answers, or make the task easier or harder"
            )

    def close(self) -> None:
        self.bar.close()


def no_answer_line(steps: int, reward: str) -> str:
    """Why every reward is 0: no response had a final answer in a form the reward reads."""
    reads = f" (it reads {BUILTIN[reward].reads})" if reward in BUILTIN else ""
    return (
        f"no response in the last {steps} steps had an answer the reward could read: reward.name={reward}{reads}; "
        "make the prompts ask for that form (data.instruction) or choose the reward that reads the form they ask for"
    )


def main(argv: list[str] | None = None) -> int:
    """Check everything that would fail on every try, claim the run folder, run, report; return the exit code."""
    cfg = parse(PROG, argv)
    out = run_dir(cfg)
    config_path = os.path.join(out, "config.yaml")
    try:
        environment.check_driver(cfg)  # before counting GPUs: an old driver is why torch would see none
        learner, servers = build_children(cfg, config_path, out, *node_gpus(cfg))
        data = preflight.check(cfg)
        environment.check_room(cfg, out)
    except ConfigError as exc:
        print(f"{PROG}: config error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    try:
        lock = run_folder.claim(out, PROG)
    except run_folder.RunFolderBusy as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as exc:  # a read-only or missing parent, a full disk: before anything was written
        print(f"{PROG}: run.dir={out}: cannot create the run folder there: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_INPUT
    try:
        return _run(cfg, out, config_path, learner, servers, data)
    finally:
        lock.release()


def _run(cfg: DictConfig, out: str, config_path: str, learner: Child, servers: list[Child], data: dict) -> int:
    """The run itself, in a folder this launcher owns."""
    if run_folder.holds_run(out) and not get(cfg, "run.resume"):
        print(
            f"{PROG}: {out} already holds a run; pass run.resume=true to continue it, or choose another "
            f"run.name / run.dir",
            file=sys.stderr,
        )
        return EXIT_INPUT
    notes = _data_notes(data)
    if get(cfg, "run.resume"):
        try:
            resume = resume_point(os.path.join(out, "checkpoints"))
        except ConfigError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return EXIT_INPUT
        notes.update(resume)
        truncate_after(os.path.join(out, "metrics.jsonl"), resume["resume/step"])
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
    progress = ProgressBar(
        cfg.train.steps, os.path.join(out, "metrics.jsonl"), notes.get("resume/step", 0), get(cfg, "reward.name")
    )
    code = 0
    try:
        code = _supervise(cfg, learner, servers, progress, stop)
    finally:
        progress.close()
        _shutdown(learner, servers)
    wall = time.time() - started
    ledger = books.close_run(out, learner_ended_cleanly=learner.poll() == 0)
    summary = write_summary(
        out,
        config_yaml,
        wall,
        {
            "restarts": {s.name: s.restarts for s in servers},
            "exit_code": code,
            "books": ledger,
            "reward/name": get(cfg, "reward.name"),
            **notes,
        },
    )
    plot_curves(out)
    _print_summary(summary, out, code)
    return code


def resume_point(root: str) -> dict[str, Any]:
    """Where run.resume=true continues (said on the console); ConfigError if checkpoints exist but none is intact."""
    skipped = []
    for step, path in step_dirs(root):
        why, _ = checkpoint_files.problem(path)
        if not why:
            for line in skipped:
                print(f"{PROG}: skipping checkpoint {line}", file=sys.stderr)
            print(f"{PROG}: resuming from {path}", file=sys.stderr)
            return {"resume/step": step, "resume/from": path, "resume/skipped": skipped}
        skipped.append(f"{os.path.basename(path)}: {why}")
    if skipped:
        raise ConfigError(
            f"run.resume=true but no checkpoint in {root} is usable ({'; '.join(skipped)}); nothing was changed"
        )
    print(f"{PROG}: run.resume=true but {root} holds no checkpoint; starting from model.path (step 0)", file=sys.stderr)
    return {"resume/step": 0, "resume/from": None, "resume/skipped": []}


def _data_notes(data: dict) -> dict[str, Any]:
    """Skipped data rows: one console line per file set, and data/bad_rows for summary.json."""
    for key, counts in data.items():
        if counts["bad_rows"]:
            print(
                f"{PROG}: data.{key}_files: skipped {counts['bad_rows']} of {counts['rows']} rows; first: "
                f"{counts['first_bad'][0]}",
                file=sys.stderr,
            )
    return {
        "data/bad_rows": data["train"]["bad_rows"],
        "data/first_bad_rows": data["train"]["first_bad"],
        **({"data/eval_bad_rows": data["eval"]["bad_rows"]} if "eval" in data else {}),
    }


def reward_failures(train: list[dict]) -> tuple[Counter, int, str | None]:
    """(failed scores per status, scores seen, the first failure's "status: detail") over the training rows."""
    failed: Counter = Counter()
    seen, first = 0, None
    for r in train:
        for key, value in r.items():
            if key.startswith("reward/status_"):
                seen += value
                if key[len("reward/status_") :] in FAILED_STATUSES:
                    failed[key[len("reward/status_") :]] += value
        first = first or r.get("reward/first_failure")
    return failed, seen, first


def _supervise(cfg: DictConfig, learner: Child, servers: list[Child], progress: ProgressBar, stop: dict) -> int:
    max_restarts = get(cfg, "run.max_restarts")
    while True:
        time.sleep(0.5)
        progress.update()
        if stop["signal"] is not None:
            print(f"\n{PROG}: got signal {stop['signal']}; asking the learner to checkpoint and stop", file=sys.stderr)
            learner.signal(signal.SIGTERM)
            _wait(learner, timeout=120)
            return 0 if learner.poll() == 0 else 1
        code = learner.poll()
        if code is not None:
            progress.update()
            if code == 0:
                return 0
            if code in (EXIT_INPUT, EXIT_DIVERGED):  # its one line says what to fix; a resume would fail the same way
                print(f"\n{PROG}: the learner stopped (exit {code}): {learner.last_line()}", file=sys.stderr)
                return code
            line = learner.last_line()
            if line.startswith("qurl-learner: "):  # its own one-line verdict (a checkpoint it could not write)
                print(f"\n{PROG}: the learner stopped (exit {code}): {line}", file=sys.stderr)
                return EXIT_FAULT
            print(
                f"\n{PROG}: the learner exited with code {code}; last lines of its log:\n{learner.tail()}\n"
                f"resume with: {PROG} --config <your config> run.resume=true "
                f"(run.dir={cfg.run.dir})",
                file=sys.stderr,
            )
            return EXIT_FAULT
        for s in servers:
            code = s.poll()
            if code is None and _wedged(s, get(cfg, "run.server_silence_s")):
                code = s.poll()
            if code is None:
                continue
            if code == EXIT_INPUT:  # a start-up error that a restart would repeat
                print(f"\n{PROG}: {s.name} cannot start (exit {code}): {s.last_line()}", file=sys.stderr)
                learner.signal(signal.SIGTERM)
                _wait(learner, timeout=120)
                return EXIT_INPUT
            if s.restarts >= max_restarts:
                print(
                    f"\n{PROG}: {s.name} exited with code {code} and run.max_restarts={max_restarts} is used "
                    f"up; last lines of its log:\n{s.tail()}",
                    file=sys.stderr,
                )
                learner.signal(signal.SIGTERM)
                _wait(learner, timeout=120)
                return EXIT_FAULT
            s.restarts += 1
            print(
                f"\n{PROG}: {s.name} exited with code {code}; restarting it ({s.restarts}/{max_restarts})",
                file=sys.stderr,
            )
            s.env[REPLACES_ENV] = str(s.proc.pid)  # the new server's hello returns the dead one's budget share
            s.start()
            _write_pids(cfg.run.dir, [learner, *servers])


def _wedged(server: Child, limit: float) -> bool:
    """A server alive but silent past run.server_silence_s (stopped, deadlocked, stuck in a collective): say so and
    kill it, so that the crash path restarts it."""
    silent = server.silent_s()
    if not limit or silent is None or silent <= limit:
        return False
    print(
        f"\n{PROG}: {server.name} (pid {server.proc.pid}) is alive but sent no heartbeat for {silent:.0f} s "
        f"(run.server_silence_s={limit:g}): stopped, deadlocked or stuck in a collective; killing it",
        file=sys.stderr,
    )
    server.signal(signal.SIGKILL)
    _wait(server, timeout=30)
    return True


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


def _print_summary(summary: dict, out: str, code: int) -> None:
    lines = [
        f"{PROG}: {'finished' if code == 0 else 'FAILED'} after {summary['steps']} steps in {summary['wall_s']:.0f} s"
    ]
    first, last = summary.get("eval/acc_quant/first"), summary.get("eval/acc_quant/last")
    if first is not None:
        version = summary["eval/acc_quant/last_version"]
        change = f" -> {last:.3f} (version {version})" if version else ""
        unfinished = (
            ""
            if summary["eval/acc_quant/final"] is not None
            else (f"; the final weights (version {summary['version']}) were not evaluated")
        )
        lines.append(f"  held-out accuracy (quantized engine): {first:.3f}{change}{unfinished}")
    if summary.get("reward/no_answer_steps", 0) >= NO_ANSWER_STEPS:
        lines.append(f"  WARNING: {no_answer_line(summary['reward/no_answer_steps'], summary['reward/name'])}")
    if summary.get("reward/no_signal_steps", 0) >= NO_SIGNAL_STEPS:
        lines.append(
            f"  WARNING: {summary['reward/no_signal_steps']} steps in a row had no reward signal "
            "(every group all-equal)"
        )
    if summary.get("data/bad_rows"):
        lines.append(f"  data: {summary['data/bad_rows']} bad rows skipped (summary.json data/first_bad_rows)")
    b = summary["books"]
    lines.append(
        f"  books: {b['generated']} groups generated, {b['used']} used, {b['dropped_stale']} dropped stale; "
        + ("balanced" if b["balanced"] else "DO NOT BALANCE: " + "; ".join(b["problems"]))
    )
    written = [
        name
        for name in ("summary.json", "curves.png", "metrics.jsonl", "checkpoints/", "hf/")
        if os.path.exists(os.path.join(out, name.rstrip("/")))
    ]
    lines.append(f"  outputs: {', '.join(f'{out}/{name}' for name in written)}")
    print("\n".join(lines), file=sys.stderr)
