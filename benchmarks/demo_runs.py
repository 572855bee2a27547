"""Resumable qurl-async runs of the CPU demo, several at once under one progress bar.

Shared by ablation.py, scaling_study.py and pipeline.py. A run is identified by its config name and seed
and lives in its own folder; a run whose summary says it finished its steps is skipped, a started one is
continued with run.resume=true (the learner resumes from its newest checkpoint), so Ctrl-C and re-running
the same command loses at most the steps since the last checkpoint. `run_rounds` advances many long runs
round-robin in short segments, each under the shared CPU lock, so that they all reach about the same
horizon by any stop (the real-model ablation).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from qurl.outputs.report import _moving_mean, read_metrics  # noqa: E402

QURL_ASYNC = os.path.join(os.path.dirname(sys.executable), "qurl-async")
DEMO_CONFIG = str(ROOT / "configs" / "demo-cpu.yaml")
QUICK = ["train.batch_prompts=4", "rollout.n_samples=4", "eval.max_problems=32", "log.interval_s=2"]
SETTINGS = "bench_run.json"  # in each run folder: what defines the run, and the wall time of each attempt
CURVE_KEYS = (
    "reward/mean",
    "mismatch/kl_k3",
    "mismatch/kl_k1",
    "mismatch/rho_max",
    "reward/groups_with_signal",
    "sync/changed_frac",
    "tis/truncated_frac",
    "acr/widened_frac",
    "actor/clipfrac",
    "rollout_corr/log_ppl_abs_diff",
    "rollout_corr/rollout_is_ratio_fraction_high",
    "rollout_corr/rollout_rs_masked_fraction",
    "rollout_corr/rollout_rs_seq_masked_fraction",
    "staleness/mean",
    "time/step_s",
    "time/wait_s",
    "sync/seconds",
    "servers/engine_ms",
    "rollout/response_len_mean",
    "actor/tokens",
    "perf/cores_lent_frac",
)
EVAL_KEYS = ("eval/acc_fp", "eval/acc_quant")
LOCK_YIELD_S = 5.0  # run_rounds: pause between segments, so jobs waiting for the CPU lock get it in between


@dataclass
class Run:
    """One qurl-async run: `overrides` define it; `extra` only depend on its length (eval and checkpoint cadence)."""

    name: str
    seed: int
    overrides: list[str]
    steps: int
    dir: str
    extra: list[str] = field(default_factory=list)
    config: str = DEMO_CONFIG  # the qurl-async --config the overrides apply to

    @property
    def key(self) -> str:
        return f"{self.name}-seed{self.seed}"


def add_common_args(p: argparse.ArgumentParser, steps: int, seeds: list[int], out: str) -> None:
    """The flags every demo experiment takes."""
    p.add_argument("--steps", type=int, default=steps, help=f"learner steps per run (default {steps})")
    p.add_argument("--seeds", type=int, nargs="+", default=seeds, help="run.seed values")
    p.add_argument("--out", default=out, help="folder for the JSON and the plot")
    p.add_argument("--runs-dir", default=None, help="folder for the run folders (default runs/<benchmark>/...)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (each is two processes)")
    p.add_argument("--task", default="add", choices=("add", "sum-steps"), help="demo task (qurl/demo/task.py)")
    p.add_argument(
        "--weight-bits",
        type=int,
        default=8,
        choices=(4, 5, 6, 7, 8),
        help="quant.weight_bits for the int8 configurations (below 8: mismatch stress, not speed)",
    )
    p.add_argument(
        "--mini-batches",
        type=int,
        default=1,
        help="train.mini_batches, optimizer updates per learner step (the demo's 1 keeps the PPO ratio at 1, "
        "so clipping and ACR's widening never act)",
    )
    p.add_argument("--demo-dir", default=None, help="prepared demo (default: qurl-prepare-demo's folder for --task)")
    p.add_argument("--quick", action="store_true", help="tiny smoke version (2 steps, small batches, 1 seed)")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.steps < 1:
        p.error(f"--steps: must be >= 1, got {args.steps}")
    if args.parallel < 1:
        p.error(f"--parallel: must be >= 1, got {args.parallel}")
    if args.mini_batches < 1:
        p.error(f"--mini-batches: must be >= 1, got {args.mini_batches}")


def demo(task: str, demo_dir: str | None = None) -> tuple[str, dict]:
    """The prepared demo folder for `task` (built on first use, which takes minutes) and its prepare.json."""
    from qurl.demo.prepare import Recipe, default_root, prepare, read_info

    root = Path(demo_dir) if demo_dir else default_root(task)
    info = read_info(root)
    if info is not None and info["recipe"]["task"] != task:
        raise SystemExit(f"--demo-dir {root} holds the {info['recipe']['task']!r} task, not {task!r}")
    if info is None:
        print(f"preparing the {task} demo under {root} (once; about 15-30 minutes on 2 cores)", file=sys.stderr)
        info = prepare(root, Recipe(task=task))
    return str(root), info


def demo_overrides(root: str, info: dict) -> list[str]:
    """Point the demo config at a prepared folder; tasks other than `add` get room for their longer answers."""
    out = [
        f"model.path={root}/model",
        f"data.train_files=[{root}/train.jsonl]",
        f"data.eval_files=[{root}/heldout.jsonl]",
    ]
    if info["recipe"]["task"] != "add":
        max_new = int(info["max_new_tokens"])
        out += [f"rollout.sampling.max_new_tokens={max_new}", f"rollout.max_seq_len={64 + max_new}"]
    return out


def cadence(steps: int, quick: bool) -> list[str]:
    """About 10 evaluations per run, checkpoints often enough that an interrupted run loses little."""
    if quick:
        return ["eval.every=0", "checkpoint.every=1"]
    return [f"eval.every={max(1, steps // 10)}", f"checkpoint.every={max(1, min(50, steps // 4))}"]


def _json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def state(run: Run) -> str:
    """done (finished its steps), resume (started) or new."""
    summary = _json(os.path.join(run.dir, "summary.json"))
    if summary and summary.get("exit_code") == 0 and summary.get("steps", 0) >= run.steps:
        return "done"
    return "resume" if os.path.exists(os.path.join(run.dir, "metrics.jsonl")) else "new"


def _claim(run: Run) -> dict:
    """The run folder's settings file; a folder made with other settings is an error, never silently mixed."""
    path = os.path.join(run.dir, SETTINGS)
    want = {"name": run.name, "seed": run.seed, "overrides": run.overrides}
    have = _json(path)
    if have is not None:
        if {k: have.get(k) for k in want} != want:
            raise SystemExit(
                f"{run.dir} holds a run made with other settings ({have.get('overrides')}); "
                "remove it or pass another --runs-dir"
            )
        return have
    os.makedirs(run.dir, exist_ok=True)
    have = {**want, "walls": []}
    _write(path, have)
    return have


def _write(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _steps_done(run: Run) -> int:
    steps = [r["step"] for r in read_metrics(os.path.join(run.dir, "metrics.jsonl")) if "loss/policy" in r]
    return max(steps, default=0)


def _launch(run: Run, log) -> subprocess.Popen:
    cmd = [
        QURL_ASYNC,
        "--config",
        run.config,
        *run.overrides,
        *run.extra,
        f"run.seed={run.seed}",
        f"train.steps={run.steps}",
        f"run.dir={run.dir}",
        f"run.name={run.key}",
    ]
    if state(run) == "resume":
        cmd.append("run.resume=true")
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_all(runs: list[Run], parallel: int = 1, desc: str = "runs", lock: str | None = None) -> list[str]:
    """Run every unfinished run, `parallel` at a time, under one tqdm bar of learner steps; return failed keys.

    lock: a file to hold an exclusive flock on while runs are going (taken per run when parallel is 1), so that
    runs on a machine shared with other jobs are timed alone and other jobs get the cores in between."""
    from tqdm import tqdm

    for run in runs:
        _claim(run)
    todo = [r for r in runs if state(r) != "done"]
    done_steps = {r.key: (r.steps if state(r) == "done" else _steps_done(r)) for r in runs}
    bar = tqdm(
        total=sum(r.steps for r in runs), initial=sum(done_steps.values()), desc=desc, unit="step", dynamic_ncols=True
    )
    if len(todo) < len(runs):
        _note(bar, f"{desc}: {len(runs) - len(todo)} of {len(runs)} runs already finished, skipped")
    running: dict[str, tuple[Run, subprocess.Popen, float, Any]] = {}
    failed: list[str] = []
    held = None
    try:
        while todo or running:
            while todo and len(running) < parallel:
                run = todo.pop(0)
                if lock is not None and not running:
                    held = _take(lock)
                log = open(os.path.join(run.dir, "bench.log"), "a")
                running[run.key] = (run, _launch(run, log), time.time(), log)
            time.sleep(1.0)
            for key, (run, proc, started, log) in list(running.items()):
                done_steps[key] = _steps_done(run)
                if proc.poll() is None:
                    continue
                log.close()
                del running[key]
                _record_wall(run, time.time() - started)
                if held is not None and not running:
                    held.close()  # releases the flock
                    held = None
                if proc.returncode != 0 or state(run) != "done":
                    failed.append(key)
                    _note(bar, f"{desc}: {key} FAILED (exit {proc.returncode}); see {run.dir}/bench.log and logs/")
            bar.n = sum(done_steps.values())
            bar.set_postfix_str(f"running {', '.join(running) or '-'}; {len(todo)} queued")
            bar.refresh()
    except KeyboardInterrupt:
        _note(bar, f"{desc}: interrupted; stopping the running runs cleanly (they checkpoint; re-run to resume)")
        for key, (run, proc, started, log) in running.items():
            os.killpg(proc.pid, signal.SIGINT)
        for key, (run, proc, started, log) in running.items():
            proc.wait()
            log.close()
            _record_wall(run, time.time() - started)
        raise
    finally:
        bar.close()
        if held is not None:
            held.close()
    return failed


def _take(lock: str):
    """An open file holding an exclusive flock on `lock` (blocks until it is free); closing it releases it."""
    f = open(lock, "a")
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def next_segment(done: dict[str, int], horizon: int, segment: int) -> tuple[str, int] | None:
    """The run furthest behind (first in order on ties) and the step its next segment ends at; None when all are
    at the horizon. Ends are multiples of `segment`, so every run stops at the same steps."""
    if not done or min(done.values()) >= horizon:
        return None
    key = min(done, key=lambda k: done[k])  # dicts keep order: ties go to the earlier run
    return key, min(horizon, (done[key] // segment + 1) * segment)


def run_rounds(runs: list[Run], horizon: int, segment: int, until: float, lock: str, desc: str = "runs") -> list[str]:
    """Advance the runs round-robin, `segment` steps at a time, each segment under flock(`lock`), until every run
    has `horizon` steps or the next segment would end after the epoch time `until`; return the failed keys.

    A segment is one resumed qurl-async with train.steps at the segment's end; rerunning continues where the
    last finished segment stopped. A segment's wall time (waiting for the lock excluded) is recorded per run.
    """
    for run in runs:
        _claim(run)
    by_key = {r.key: r for r in runs}
    failed: list[str] = []
    per_segment: list[float] = []  # wall of each segment of this invocation, for the deadline check
    while True:
        done = {k: _steps_done(r) for k, r in by_key.items() if k not in failed}
        nxt = next_segment(done, horizon, segment)
        if nxt is None:
            return failed
        key, end = nxt
        guess = max(per_segment, default=0.0)
        if time.time() + guess > until:
            print(f"{desc}: stopping before the deadline; steps so far {done}", file=sys.stderr, flush=True)
            return failed
        with _take(lock):
            if time.time() + guess > until:  # the wait for the lock may have used the time up
                continue
            started = time.time()
            print(
                f"{desc}: {key} steps {done[key]} -> {end} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True
            )
            bad = run_all([dataclasses.replace(by_key[key], steps=end)], desc=f"{desc} {key}")
        per_segment.append(time.time() - started)
        failed += bad
        time.sleep(LOCK_YIELD_S)


def _note(bar, text: str) -> None:
    """A line above the bar, on stderr (stdout carries the JSON)."""
    bar.write(text, file=sys.stderr)


def _record_wall(run: Run, wall_s: float) -> None:
    path = os.path.join(run.dir, SETTINGS)
    settings = _json(path)
    settings["walls"].append(round(wall_s, 2))
    _write(path, settings)


def read_run(run: Run) -> dict:
    """One result row: identity, accuracies from summary.json, total wall, and per-step curves from metrics.jsonl.

    A run stopped before it wrote summary.json counts up to its last logged learner step (ok stays False)."""
    rows = read_metrics(os.path.join(run.dir, "metrics.jsonl"))
    train = [r for r in rows if "loss/policy" in r]
    summary = _json(os.path.join(run.dir, "summary.json")) or {}
    settings = _json(os.path.join(run.dir, SETTINGS)) or {}
    return {
        "config": run.name,
        "seed": run.seed,
        "steps": summary.get("steps", max((r["step"] for r in train), default=0)),
        "ok": state(run) == "done",
        "final_acc": summary.get("eval/acc_fp/final"),
        "best_acc": summary.get("eval/acc_fp/best"),
        "first_acc": summary.get("eval/acc_fp/first"),
        "final_acc_quant": summary.get("eval/acc_quant/final"),
        "first_acc_quant": summary.get("eval/acc_quant/first"),
        "last_acc": summary.get("eval/acc_fp/last"),  # of the newest evaluated weights, when a run stopped after it
        "last_acc_quant": summary.get("eval/acc_quant/last"),
        "wall_s": round(sum(settings.get("walls", [])), 1),
        "overrides": run.overrides,
        "run_dir": run.dir,
        "curves": {"step": [r["step"] for r in train], **{k: [r.get(k) for r in train] for k in CURVE_KEYS}},
        # [weights version, accuracy]: a server's eval/acc_quant is logged at a later step than the weights it scored
        "evals": {
            k: [[r.get("eval/version", r["step"]), r[k]] for r in rows if isinstance(r.get(k), (int, float))]
            for k in EVAL_KEYS
        },
    }


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (0 for one value), ignoring missing values."""
    import numpy as np

    vals = np.array([v for v in values if v is not None], dtype=float)
    if vals.size == 0:
        return None, None
    return float(vals.mean()), float(vals.std(ddof=1)) if vals.size > 1 else 0.0


def plot_curve(ax, rows: list[dict], key: str, title: str) -> None:
    """Mean +- std over seeds of one per-step curve, per config, smoothed by a trailing mean."""
    import numpy as np

    for config in dict.fromkeys(r["config"] for r in rows):
        series = [_fill(r["curves"][key]) for r in rows if r["config"] == config]
        n = min(len(s) for s in series)
        if n == 0:
            continue
        window = max(1, n // 30)
        data = np.array([_moving_mean(tuple(s[:n]), window) for s in series])
        mean, std = data.mean(axis=0), data.std(axis=0)
        steps = np.arange(1, n + 1)
        ax.plot(steps, mean, label=f"{config} (n={len(series)})")
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
    ax.set_title(title)
    ax.set_xlabel("learner step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _fill(values: list) -> list[float]:
    """Missing points (a skipped step logs null) take the previous value, so a trailing mean stays defined."""
    out, last = [], 0.0
    for v in values:
        last = v if v is not None else last
        out.append(last)
    return out


def strip_curves(result: dict) -> dict:
    """The result without per-step curves, for printing."""
    return {**result, "rows": [{k: v for k, v in r.items() if k not in ("curves", "evals")} for r in result["rows"]]}


def write_result(out_dir: str, name: str, result: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    _write(path, result)
    return path
