"""qurl-async end to end on the demo model: outputs, on-policy mode, and supervision under faults."""

import json
import os
import signal

import pytest
from launch import ROOT, descendants_alive, finish, start, wait_for_step

from qurl.outputs.metrics import CONTRACT_KEYS
from qurl.outputs.report import read_metrics


def test_demo_run_writes_every_output(demo_dir, tmp_path):
    run_dir = tmp_path / "run"
    code, out = finish(start(demo_dir, run_dir, 4))
    assert code == 0, out
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert set(CONTRACT_KEYS) <= set(row), set(CONTRACT_KEYS) - set(row)
    # the server waits for weights most of each demo step: the learner trains on its core meanwhile
    if "OMP_NUM_THREADS" not in os.environ:
        assert all(0 <= r["perf/cores_lent_frac"] <= 1 for r in rows)
        assert max(r["perf/cores_lent_frac"] for r in rows) > 0.1
    evals = read_metrics(run_dir / "metrics.jsonl")
    assert any("eval/acc_fp" in r for r in evals) and any("eval/acc_quant" in r for r in evals)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["exit_code"] == 0
    assert summary["eval/acc_quant/first"] is not None and summary["eval/acc_quant/final"] is not None
    assert (run_dir / "curves.png").stat().st_size > 10_000
    events = [f for f in os.listdir(run_dir / "tensorboard") if f.startswith("events")]
    tags = b"".join((run_dir / "tensorboard" / f).read_bytes() for f in events)
    for key in ("rollout_corr/k3_kl", "rollout_corr/chi2_seq", "rollout_corr/rollout_is_eff_sample_size"):
        assert key.encode() in tags, key  # the mismatch metrics reach TensorBoard, not only metrics.jsonl
    assert (run_dir / "checkpoints" / "step_4" / "manifest.json").exists()
    assert {"learner.log", "rollout-0.log"} <= set(os.listdir(run_dir / "logs"))
    # versions 2.. travel as deltas (sync.full_every=10), and the server's checksums all match
    assert [r["sync/delta"] for r in rows] == [0, 1, 1, 1]
    server_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "applied delta weights version 4" in server_log and "'weight_checksum_mismatches': 0" in server_log
    assert "weight push version" not in server_log  # no push was rejected
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_dir / "hf") is not None


@pytest.mark.slow  # 20-40 s of processes: the default suite stays under 10 minutes
def test_synchronous_mode_is_on_policy(demo_dir, tmp_path):
    run_dir = tmp_path / "sync"
    code, out = finish(start(demo_dir, run_dir, 3, "async.max_staleness=0"))
    assert code == 0, out
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r]
    assert len(rows) == 3 and all(r["staleness/max"] == 0 for r in rows)


@pytest.mark.parametrize(
    "variant",
    [
        # 10-20 s each: the default suite runs the fp8 one
        pytest.param(["rollout.quant=none", "algo.loss=ppo"], marks=pytest.mark.slow),
        pytest.param(["algo.loss=decoupled"], marks=pytest.mark.slow),
        ["rollout.quant=fp8", "algo.loss=tis"],
    ],
)
def test_demo_variants_run(demo_dir, tmp_path, variant):
    """The README's switches: full-precision and FP8 rollout, every loss mode (acr is the default run's)."""
    run_dir = tmp_path / "variant"
    code, out = finish(start(demo_dir, run_dir, 2, *variant))
    assert code == 0, out
    from omegaconf import OmegaConf

    saved = OmegaConf.load(run_dir / "config.yaml")
    for override in variant:
        key, value = override.split("=")
        assert OmegaConf.select(saved, key) == value
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss/policy"] == r["loss/policy"] for r in rows)
    if (
        "rollout.quant=none" in variant
    ):  # step 1 trains on version-0 samples only: fp32 engine and learner agree to float noise
        assert rows[0]["staleness/max"] == 0 and rows[0]["mismatch/kl_k3"] < 1e-6, rows[0]


@pytest.mark.slow  # the default suite's quick fault soak (test_soak.py) SIGKILLs the server too: it stays under 10 min
def test_killed_rollout_server_is_restarted(demo_dir, tmp_path):
    run_dir = tmp_path / "kill"
    # 12 steps: with max_staleness=2 the learner can hold about three steps' groups, so after a kill at step 2 it
    # cannot finish from what it holds (6 steps could, on a fast machine, before the launcher saw the death)
    proc = start(demo_dir, run_dir, 12)
    wait_for_step(run_dir, 2)
    pids = open(run_dir / "logs" / "pids.json").read()
    os.kill(json.loads(pids)["rollout-0"], signal.SIGKILL)
    code, out = finish(proc)
    assert code == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["restarts"]["rollout-0"] == 1


@pytest.mark.slow  # ~25 s; resume is also checked exactly in test_learner.py: the default suite stays under 10 minutes
def test_sigint_is_a_clean_stop_and_resume_finishes(demo_dir, tmp_path):
    run_dir = tmp_path / "int"
    proc = start(demo_dir, run_dir, 40)
    wait_for_step(run_dir, 2)
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=120)
    assert code == 0, out
    assert not descendants_alive(proc.pid)
    steps = sorted(int(d.split("_")[1]) for d in os.listdir(run_dir / "checkpoints") if d.startswith("step_"))
    assert steps and steps[-1] >= 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval/acc_quant/first"] is not None and summary["eval/acc_quant/final"] is None, summary
    assert "were not evaluated" in out, out  # the step-0 accuracy is not reported as the final one
    code, out = finish(start(demo_dir, run_dir, steps[-1] + 2, "run.resume=true"))
    assert code == 0, out
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r]
    assert rows[-1]["step"] == steps[-1] + 2


@pytest.mark.slow
def test_resume_after_learner_sigkill(demo_dir, tmp_path):
    run_dir = tmp_path / "lk"
    proc = start(demo_dir, run_dir, 30)
    wait_for_step(run_dir, 3)
    os.kill(json.loads(open(run_dir / "logs" / "pids.json").read())["learner"], signal.SIGKILL)
    code, out = finish(proc)
    assert code != 0 and "run.resume=true" in out
    # the learner may have checkpointed past step 3 before the kill landed: resume to 4 steps beyond what it saved
    saved = max(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    code, out = finish(start(demo_dir, run_dir, saved + 4, "run.resume=true"))
    assert code == 0, out
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{saved}'}" in out
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == saved + 4


@pytest.mark.parametrize(
    "staleness, ranks, servers, want",
    [(0, 1, 1, "8"), (1, 1, 1, "4"), (0, 2, 1, "4"), (0, 1, 2, "4"), (2, 2, 2, "2"), (0, 1, 16, "1")],
)
def test_sync_processes_take_turns_so_each_side_gets_the_cores(monkeypatch, staleness, ranks, servers, want):
    """With max_staleness 0 the learner and the servers never compute at once: splitting the cores among all of
    them left half the machine idle in every synchronous run (benchmarks/pipeline.py --workload real)."""
    from qurl.config import load_config
    from qurl.supervisor.launcher import threads_per_process

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = load_config(
        os.path.join(ROOT, "configs/demo-cpu.yaml"),
        [f"async.max_staleness={staleness}", f"cluster.learner_ranks={ranks}"],
        check_paths=False,
    )
    assert threads_per_process(cfg, servers, cores=8) == want
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_process(cfg, servers, cores=8) == "3"  # the user's setting wins
