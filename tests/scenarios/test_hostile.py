"""Hostile input and operator mistakes (docs/RELIABILITY.md §5), with real processes and real files: a second
launcher on a live run, non-finite settings and weights, damaged checkpoints, start-up errors that would recur,
and what the console must say. Each refusal is one line and a documented exit code (qurl/supervisor/cli.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from launch import QURL_ASYNC, ROOT, demo_overrides, finish, refusal, start, wait_for_step

from qurl.outputs import checkpoint_files
from qurl.outputs.report import read_metrics

EXIT_INPUT, EXIT_DIVERGED = 2, 3


def launch(demo_dir, run_dir, steps, *extra, timeout=300) -> tuple[int, str]:
    """One qurl-async run to its end: (exit code, console output)."""
    return finish(start(demo_dir, run_dir, steps, *extra), timeout=timeout)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: Path, at: int = -100) -> None:
    """Damage a file in place without changing its size (a disk or copy fault)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def snapshot(run_dir: Path) -> dict[str, str]:
    """Hash of every file in the run folder but the lock file and logs: what "touches nothing" compares."""
    return {
        str(p.relative_to(run_dir)): digest(p)
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".qurl-lock" and "logs" not in p.parts
    }


# -- two launchers, one run folder ---------------------------------------------------------------------------------


@pytest.mark.slow  # 20-50 s of processes: the default suite stays under 10 minutes
def test_a_second_launcher_on_a_live_run_is_refused_and_a_crashed_run_still_resumes(demo_dir, tmp_path):
    run_dir = tmp_path / "owned"
    first = start(demo_dir, run_dir, 40)
    try:
        wait_for_step(run_dir, 1)
        config = (run_dir / "config.yaml").read_text()
        rows = len(read_metrics(run_dir / "metrics.jsonl"))
        for extra in ([], ["run.resume=true"]):  # neither a fresh start nor a resume may touch a live run
            started = time.time()
            code, out = launch(demo_dir, run_dir, 40, *extra, timeout=60)
            line = refusal(out)
            assert code == EXIT_INPUT and time.time() - started < 30, out
            assert f"pid {first.pid} on " in line and "started 20" in line and "in use by qurl-async" in line, line
            print(f"refusal (exit {code}): {line}")
        assert (run_dir / "config.yaml").read_text() == config
        assert len(read_metrics(run_dir / "metrics.jsonl")) >= rows
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the launcher dies without any cleanup; its children follow it
        first.communicate(timeout=120)
    saved = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    code, out = launch(demo_dir, run_dir, saved + 1, "run.resume=true")  # the dead owner's lock went with it
    assert code == 0, out


# -- non-finite settings and weights, damaged checkpoints ---------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lr=inf", "train.lr"),
        ("algo.eps_high=nan", "algo.eps_high"),
        ("reward.timeout_s=-inf", "reward.timeout_s"),
    ],
)
def test_a_non_finite_setting_is_a_config_error(demo_dir, tmp_path, override, key):
    code, out = finish(
        subprocess.Popen(
            [QURL_ASYNC, "--config", "configs/demo-cpu.yaml", *demo_overrides(demo_dir, tmp_path / "r", 2), override],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        timeout=60,
    )
    line = refusal(out)
    assert code == EXIT_INPUT and f"{key}=" in line and "not a finite number" in line, out
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # 30-60 s each on an AVX2-only EPYC; the default suite keeps under 10 minutes there (README)
def test_damaged_checkpoints_are_skipped_or_refused_and_diverging_weights_stop_before_any_write(demo_dir, tmp_path):
    run_dir = tmp_path / "ckpt"
    code, out = launch(demo_dir, run_dir, 4)
    assert code == 0, out
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_2", "step_4"]
    manifest = json.loads((ckpts / "step_4" / "manifest.json").read_text())
    assert len(manifest["files"]["model.safetensors"]["sha256"]) == 64

    # 1. step_4 damaged in place (same size): skipped, said on the console, the run continues from step_2
    weights = ckpts / "step_4" / "model.safetensors"
    size = weights.stat().st_size
    flip_byte(weights)
    assert weights.stat().st_size == size
    code, out = launch(demo_dir, run_dir, 4, "run.resume=true")
    assert code == 0, out
    assert "skipping checkpoint step_4: corrupt (model.safetensors does not match its sha256" in out, out
    assert f"resuming from {ckpts / 'step_2'}" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resume/from"] == str(ckpts / "step_2") and summary["resume/skipped"][0].startswith("step_4")
    assert summary["steps"] == 4 and summary["books"]["balanced"], summary

    # 2. the weights turn non-finite at step 5: exit 3, nothing pushed, checkpointed or exported after step 4
    hf = digest(run_dir / "hf" / "model.safetensors")
    good = {p.name: digest(p / "model.safetensors") for p in ckpts.glob("step_*")}
    # finite settings whose decay step overflows fp32 (weights above 1.13 times -3e38): a real divergence
    code, out = launch(demo_dir, run_dir, 6, "run.resume=true", "train.lr=1e38", "train.weight_decay=3")
    assert code == EXIT_DIVERGED, out
    line = next(line for line in out.splitlines() if "inf or NaN" in line)
    assert "step 5:" in line and f"last good checkpoint: {ckpts / 'step_4'}" in line and "resume with" not in out, out
    print(f"diverged (exit {code}): {line}")
    assert {p.name: digest(p / "model.safetensors") for p in ckpts.glob("step_*")} == good
    assert digest(run_dir / "hf" / "model.safetensors") == hf
    assert "version 5" not in (run_dir / "logs" / "rollout-0.log").read_text()

    # 3. every checkpoint damaged: refused in one line, and nothing in the run folder changes
    for p in ckpts.glob("step_*"):
        flip_byte(p / "model.safetensors")
    before = snapshot(run_dir)
    code, out = launch(demo_dir, run_dir, 6, "run.resume=true", timeout=60)
    line = refusal(out)
    assert code == EXIT_INPUT and "no checkpoint in" in line and "nothing was changed" in line, out
    print(f"refusal (exit {code}): {line}")
    assert snapshot(run_dir) == before


@pytest.mark.slow  # ~1 minute of processes
def test_updates_skipped_step_after_step_stop_the_run_with_exit_3_not_an_hour_long_wait(demo_dir, tmp_path):
    """A learning rate far too large: after step 1 the weights are finite but the forward overflows, so every
    later update is skipped for a non-finite loss. The servers keep their room (skipped steps still use their
    batches) and the run stops after train.max_skipped_steps in a row with exit 3 and one line naming the lr,
    instead of waiting async.wait_timeout_s for groups and exiting 1 ("resume"), which would repeat the stall."""
    run_dir = tmp_path / "skips"
    started = time.monotonic()
    code, out = launch(
        demo_dir, run_dir, 40, "train.lr=1e18", "train.max_skipped_steps=3", "async.wait_timeout_s=90", timeout=240
    )
    assert code == EXIT_DIVERGED, out
    line = next(line for line in out.splitlines() if "every update skipped" in line)
    assert "3 steps in a row" in line and "train.lr=1e+18" in line and "last good checkpoint" in line, line
    assert time.monotonic() - started < 90, "stopped by the wait timeout, not by the skipped steps"
    print(f"stalled run stopped (exit {code}, {time.monotonic() - started:.0f} s): {line}")


# -- start-up errors that would recur: once, fast, one line, before the folder is claimed --------------------------


def _model_without(demo_dir: Path, tmp_path: Path, drop: tuple[str, ...]) -> Path:
    model = tmp_path / "model"
    shutil.copytree(demo_dir / "model", model, ignore=shutil.ignore_patterns(*drop))
    return model


def _truncated_model(demo_dir: Path, tmp_path: Path) -> Path:
    model = _model_without(demo_dir, tmp_path, ())
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return model


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    (tmp_path / name).write_bytes(data)
    return tmp_path / name


START_ERRORS = {  # name: (overrides given the demo folder and tmp_path, words the one line must hold)
    "empty data file": (
        lambda d, t: [f"data.train_files=[{_file(t, 'e.jsonl', b'')}]"],
        ["data.train_files", "e.jsonl", "is empty"],
    ),
    "binary data file": (
        lambda d, t: [f"data.train_files=[{_file(t, 'b.jsonl', bytes(range(256)) * 4)}]"],
        ["data.train_files", "no usable rows", "b.jsonl:1"],
    ),
    "missing column": (
        lambda d, t: [f"data.train_files=[{_file(t, 'c.jsonl', json.dumps({'question': '1+1'}).encode())}]"],
        ["data.train_files", "c.jsonl", "missing column 'problem'"],
    ),
    "train_files as a string": (
        lambda d, t: [f"data.train_files={d}/train.jsonl"],
        ["data.train_files", "must be a list", "data.train_files=["],
    ),
    "reward module": (
        lambda d, t: ["reward.name=no_such_module:score"],
        ["reward.name", "no_such_module", "ModuleNotFoundError"],
    ),
    "cuda device": (lambda d, t: ["rollout.device=cuda"], ["rollout.device='cuda'", "no CUDA device"]),
    "read-only run.dir": (  # /sys refuses new folders even to root, as a read-only mount does
        lambda d, t: ["run.dir=/sys/qurl-run"],
        ["run.dir=/sys/qurl-run", "cannot create the run folder there", "(/sys: "],
    ),
    "no tokenizer": (
        lambda d, t: [f"model.path={_model_without(d, t, ('tokenizer*', 'chat_template*'))}"],
        ["model.path=", "no tokenizer files"],
    ),
    "truncated weights": (
        lambda d, t: [f"model.path={_truncated_model(d, t)}"],
        ["model.path", "model.safetensors is truncated"],
    ),
}


@pytest.mark.parametrize("case", list(START_ERRORS))
def test_a_start_up_error_that_would_recur_fails_once_in_one_line_before_the_folder_is_claimed(
    demo_dir, tmp_path, case
):
    overrides, words = START_ERRORS[case]
    run_dir = tmp_path / "run"
    started = time.time()
    code, out = finish(
        subprocess.Popen(
            [
                QURL_ASYNC,
                "--config",
                "configs/demo-cpu.yaml",
                *demo_overrides(demo_dir, run_dir, 2),
                *overrides(Path(demo_dir), tmp_path),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        timeout=60,
    )
    line = refusal(out)
    assert code == EXIT_INPUT and time.time() - started < 30, out
    assert all(w in line for w in words), line
    assert not run_dir.exists()  # nothing claimed: the same command runs once the input is fixed
    print(f"{case} (exit {code}): {line}")


@pytest.mark.slow  # ~1 minute of processes; needs a tmpfs mount (root in a container, as CI and this machine)
def test_a_disk_that_fills_during_a_checkpoint_is_one_line_naming_what_is_intact_and_resume_works(demo_dir, tmp_path):
    """The run folder on a small tmpfs; once checkpoints/step_2 is written a filler takes the rest of the disk, so a
    later checkpoint cannot be written: exit 1 and one line naming it, the free space and the newest intact one (it
    was a raw library line); with the filler gone, run.resume=true continues from that one to the end."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run_dir = disk / "run"
        proc = start(demo_dir, run_dir, 8, "checkpoint.every=2", "checkpoint.keep=2", "data.eval_files=[]")
        ckpts = run_dir / "checkpoints"
        deadline = time.time() + 180
        while not (ckpts / "step_2" / "manifest.json").exists():
            assert time.time() < deadline and proc.poll() is None, "no step_2 checkpoint"
            time.sleep(0.2)
        with open(disk / "filler", "wb", buffering=0) as f:  # the rest of the disk, then 256 KiB back for the logs
            try:
                while f.write(b"\0" * (1 << 20)):
                    pass
            except OSError:
                pass
            f.truncate(max(0, f.tell() - 256 * 1024))
        code, out = finish(proc, timeout=240)
        assert code == 1, out
        line = next(line for line in out.splitlines() if "cannot write checkpoint" in line)
        assert "the learner stopped (exit 1)" in line and "No space left on device" in line, line
        failed, intact = re.search(r"cannot write checkpoint (\S+): .*; (\S+) is intact", line).groups()
        assert "run.resume=true" in line and not Path(failed).exists() and Path(intact).parent == ckpts, line
        assert not checkpoint_files.problem(intact)[0]  # the one it names verifies
        assert not list(ckpts.glob(".tmp-step_*"))  # the partial copy is gone
        print(f"disk full (exit {code}): {line.strip()}")
        (disk / "filler").unlink()
        code, out = finish(start(demo_dir, run_dir, 8, "checkpoint.every=2", "data.eval_files=[]", "run.resume=true"))
        assert code == 0 and f"resuming from {intact}" in out, out
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_yaml_syntax_error_names_its_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: 1e-4\n steps: [\n")
    code, out = finish(
        subprocess.Popen(
            [QURL_ASYNC, "--config", str(bad)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ),
        timeout=60,
    )
    line = refusal(out)
    assert code == EXIT_INPUT and f"{bad}:3:2: not valid YAML" in line, line
    print(f"yaml (exit {code}): {line}")


@pytest.mark.slow  # 30-60 s each on an AVX2-only EPYC; the default suite keeps under 10 minutes there (README)
def test_a_server_that_cannot_start_is_not_restarted_names_the_key_and_leaves_a_folder_that_runs_when_fixed(
    demo_dir, tmp_path
):
    """rollout.max_seq_len below the prompts: found only once the tokenizer runs, in the server; no restarts."""
    run_dir = tmp_path / "seq"
    code, out = launch(
        demo_dir, run_dir, 2, "rollout.max_seq_len=16", "data.eval_files=[]", "run.max_restarts=3", timeout=120
    )
    assert code == EXIT_INPUT, out
    line = next(line for line in out.splitlines() if "cannot start" in line)
    assert "rollout-0 cannot start (exit 2)" in line and "rollout.max_seq_len=16 leaves 8 tokens" in line, line
    assert "restarting" not in out and "resume with" not in out, out
    assert json.loads((run_dir / "summary.json").read_text())["restarts"]["rollout-0"] == 0
    print(f"server (exit {code}): {line}")
    # what the learner leaves when it evaluates before the server fails: an eval row, no trained step, no
    # checkpoint; that is no run to protect, so the corrected command runs there and starts the rows afresh
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/acc_fp": 0.5, "eval/version": 0}) + "\n")
    code, out = launch(demo_dir, run_dir, 2, "data.eval_files=[]")
    assert code == 0, out
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and not any("eval/acc_fp" in r for r in rows), rows


# -- what matters reaches the console and summary.json -------------------------------------------------------------


def test_bad_rows_a_resume_from_scratch_and_a_reward_without_signal_are_said_on_the_console(
    demo_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(ROOT) / "tests"), os.environ.get("PYTHONPATH", "")]))
    data = tmp_path / "train.jsonl"
    data.write_text((Path(demo_dir) / "train.jsonl").read_text() + 'not json\n{"problem": "x"}\n')
    run_dir = tmp_path / "quiet"
    code, out = launch(
        demo_dir,
        run_dir,
        10,
        f"data.train_files=[{data}]",
        "reward.name=reward_fns:constant",
        "run.resume=true",
        "data.eval_files=[]",
        "checkpoint.every=0",
    )
    assert code == 0, out
    assert "skipped 2 of" in out and "bad JSON at column 1" in out, out
    assert "holds no checkpoint; starting from model.path (step 0)" in out, out
    assert "WARNING: no reward signal for 10 steps" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["data/bad_rows"] == 2 and len(summary["data/first_bad_rows"]) == 2
    assert summary["reward/no_signal_steps"] == 10 and summary["resume/from"] is None
    outputs = next(line for line in out.splitlines() if "outputs:" in line)
    assert "curves.png" in outputs and "hf/" in outputs


def test_rewards_that_never_found_an_answer_are_said_on_the_console(tmp_path, capsys):
    """All-zero rewards because no response had a final answer the reward reads (DAPO's `Answer: X` under a reward
    that reads only boxes, before): a warning of its own, once, and summary.json's count."""
    from qurl.outputs.report import no_answer_streak
    from qurl.supervisor.launcher import ProgressBar

    path = tmp_path / "metrics.jsonl"

    def step(i: int, no_answer: int, ok: int) -> dict:
        return {"step": i, "reward/mean": 0.0, "reward/status_no_answer": no_answer, "reward/status_ok": ok}

    rows = [step(1, 15, 1)] + [step(i, 16, 0) for i in range(2, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bar = ProgressBar(10, str(path), reward="math")
    try:
        bar.update()
        assert "no response" not in capsys.readouterr().out  # 4 steps, and one answer was read before them
        with path.open("a") as f:
            f.write(json.dumps(step(6, 16, 0)) + "\n")
        bar.update()
        bar.update()
        out = capsys.readouterr().out
        assert out.count("WARNING: no response in the last 5 steps had an answer the reward could read") == 1, out
        assert "reward.name=math (it reads \\boxed{X}, 'Answer: X'" in out, out
    finally:
        bar.close()
    assert no_answer_streak(read_metrics(path)) == 5


def test_the_progress_bar_keeps_the_reward_under_an_eval_row_and_never_runs_backwards(tmp_path):
    from qurl.supervisor.launcher import ProgressBar

    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 4, "reward/mean": 0.5, "loss/policy": 0.1, "version": 4},
        {"step": 4, "eval/acc_fp": 0.3, "eval/version": 4},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bar = ProgressBar(10, str(path), start=4)  # resumed at step 4
    try:
        bar.update()
        assert bar.bar.n == 4 and "reward=0.5" in str(bar.bar) and "acc_fp=0.3" in str(bar.bar), str(bar.bar)
        path.write_text(json.dumps(rows[0]) + "\n")  # the learner trims rows after its checkpoint: no step back
        bar.update()
        assert bar.bar.n == 4
        with path.open("a") as f:
            f.write(json.dumps({"step": 5, "reward/mean": 0.75, "loss/policy": 0.1, "version": 5}) + "\n")
        bar.update()
        assert bar.bar.n == 5 and "reward=0.75" in str(bar.bar), str(bar.bar)
    finally:
        bar.close()


@pytest.mark.slow  # the same guard as the divergence above, at start; the default suite keeps that one
def test_a_model_with_nan_weights_stops_before_its_first_push(demo_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model = _model_without(Path(demo_dir), tmp_path, ())
    tensors = load_file(model / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name][0] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    run_dir = tmp_path / "nan"
    code, out = launch(demo_dir, run_dir, 2, f"model.path={model}", "data.eval_files=[]", timeout=120)
    assert code == EXIT_DIVERGED, out
    line = next(line for line in out.splitlines() if "inf or NaN" in line)
    assert f"the weights loaded from model.path='{model}' hold inf or NaN" in line, line
    assert not (run_dir / "hf").exists() and not (run_dir / "checkpoints").exists()
    print(f"nan model (exit {code}): {line}")
