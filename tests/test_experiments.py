"""Experiment tooling (issue 9): the quant.weight_bits stress knob end to end, and the resumable ablation driver."""

import json
import os
import subprocess
import sys

import pytest
import torch

from qurl.config import ConfigError, load_config
from qurl.outputs.report import read_metrics
from qurl.quant import quantize_int8, quantize_state_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import demo_runs  # noqa: E402

QURL_ASYNC = os.path.join(os.path.dirname(sys.executable), "qurl-async")
SMALL = ["train.batch_prompts=4", "rollout.n_samples=4", "eval.max_problems=32", "log.interval_s=2"]


def test_weight_bits_narrow_the_int_grid_and_8_is_the_default_path():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    codes8, scale8 = quantize_int8(w)
    codes, scale = quantize_int8(w, bits=8)
    assert torch.equal(codes, codes8) and torch.equal(scale, scale8)
    codes4, scale4 = quantize_int8(w, bits=4)
    assert codes4.dtype == torch.int8 and codes4.abs().max() == 7
    assert torch.equal(codes4.abs().amax(dim=1), torch.full((64,), 7, dtype=torch.int8))  # every row reaches +-7
    assert torch.allclose(scale4 * 7, scale8 * 127)  # same abs-max, coarser step
    assert (codes4.float() * scale4 - w).abs().max() <= scale4.max() / 2 + 1e-6
    with pytest.raises(ValueError, match="bits"):
        quantize_int8(w, bits=3)
    with pytest.raises(ValueError, match="weight_bits=4 needs scheme 'int8'"):
        quantize_state_dict({"model.layers.0.mlp.up_proj.weight": w}, "fp8-block", weight_bits=4)


def test_weight_bits_config_check(demo_dir):
    paths = [f"model.path={demo_dir}/model", f"data.train_files=[{demo_dir}/train.jsonl]"]
    assert load_config(None, [*paths, "rollout.quant=int8", "quant.weight_bits=4"]).quant.weight_bits == 4
    assert load_config(None, paths).quant.weight_bits == 8
    for bad in (
        ["rollout.quant=fp8", "quant.weight_bits=4"],
        ["rollout.quant=none", "quant.weight_bits=6"],
        ["rollout.quant=int8", "quant.weight_bits=3"],
        ["rollout.quant=int8", "quant.weight_bits=9"],
    ):
        with pytest.raises(ConfigError, match="quant.weight_bits=.* is not allowed"):
            load_config(None, [*paths, *bad])


def test_int8_lm_head_config_check(demo_dir):
    paths = [f"model.path={demo_dir}/model", f"data.train_files=[{demo_dir}/train.jsonl]"]
    assert load_config(None, [*paths, "quant.lm_head=true"]).quant.lm_head is True  # the demo rolls out int8
    for bad in (["rollout.quant=none"], ["rollout.quant=fp8"]):
        with pytest.raises(ConfigError, match="quant.lm_head=true needs rollout.quant=int8 and rollout.engine=torch"):
            load_config(None, [*paths, "quant.lm_head=true", *bad])


def test_engine_loads_4_bit_codes_equal_to_quantize(demo_dir):
    from rollout_server.engines import load_engine
    from rollout_server.engines.model import ModelConfig, load_safetensors

    path = str(demo_dir / "model")
    engine = load_engine(path, quant="int8", max_batch=2, max_seq_len=32, weight_bits=4)
    want = quantize_state_dict(load_safetensors(path, ModelConfig.from_dir(path).tensor_shapes()), "int8", 4)
    codes = {n: t for n, t in engine.weights.items() if t.dtype == torch.int8}
    assert codes and all(t.abs().max() <= 7 for t in codes.values())
    assert max(t.abs().max().item() for t in codes.values()) == 7
    for name, t in codes.items():
        assert torch.equal(t, want[name]), name
        assert torch.equal(engine.weights[name + "_scale"].float(), want[name + "_scale"].float()), name
    with pytest.raises(ValueError, match="weight_bits=4 needs engine 'torch'"):
        load_engine(path, engine="sglang", quant="int8", weight_bits=4)


@pytest.mark.slow  # 20-50 s of processes: the default suite stays under 10 minutes
def test_step1_mismatch_is_larger_at_4_bits(demo_dir, tmp_path):
    """A real measured difference: behaviour logprobs of the 4-bit engine disagree more with the fp learner."""
    procs = {}
    for bits in (4, 8):
        cmd = [
            QURL_ASYNC,
            "--config",
            "configs/demo-cpu.yaml",
            f"model.path={demo_dir}/model",
            f"data.train_files=[{demo_dir}/train.jsonl]",
            f"data.eval_files=[{demo_dir}/heldout.jsonl]",
            f"run.dir={tmp_path / str(bits)}",
            "train.steps=1",
            "quant.invariant_scaling.s=1.0",
            f"quant.weight_bits={bits}",
            *SMALL,
        ]
        procs[bits] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kl = {}
    for bits, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        row = next(
            r
            for r in read_metrics(tmp_path / str(bits) / "metrics.jsonl")
            if r.get("step") == 1 and "mismatch/kl_k3" in r
        )
        assert row["staleness/max"] == 0  # step 1 trains on version-0 samples: pure quantization mismatch
        kl[bits] = row["mismatch/kl_k3"]
    print("step-1 mismatch/kl_k3 by weight bits:", kl)
    assert kl[4] > 3 * kl[8] > 0, kl


def test_run_state_and_settings_guard(tmp_path):
    run = demo_runs.Run("int8-acr", 0, ["rollout.quant=int8"], 5, str(tmp_path / "r"))
    assert demo_runs.state(run) == "new"
    demo_runs._claim(run)
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1, "loss/policy": 0.1}\n{"step": 2, "loss/policy": 0.1}\n')
    assert demo_runs.state(run) == "resume"
    stopped = demo_runs.read_run(run)  # stopped before summary.json: reported up to its last step, not as done
    assert stopped["steps"] == 2 and not stopped["ok"] and stopped["curves"]["step"] == [1, 2]
    (tmp_path / "r" / "summary.json").write_text(json.dumps({"steps": 3, "exit_code": 0}))
    assert demo_runs.state(run) == "resume"  # finished fewer steps than asked: continue it
    (tmp_path / "r" / "summary.json").write_text(json.dumps({"steps": 5, "exit_code": 0}))
    assert demo_runs.state(run) == "done"
    other = demo_runs.Run("int8-acr", 0, ["rollout.quant=none"], 5, run.dir)
    with pytest.raises(SystemExit, match="other settings"):
        demo_runs._claim(other)


def test_every_real_learning_config_is_a_valid_config():
    """Each comparison run is the recipe with a few keys changed: all of them must pass the config checks (the bf16
    and fp32 runs once kept the recipe's int8 lm_head and stopped at start)."""
    import real_learning

    for name, overrides in real_learning.CONFIGS.items():
        cfg = load_config(real_learning.CONFIG, [*overrides, *real_learning.QUIET], check_paths=False)
        assert cfg.rollout.quant == ("none" if name.split("-")[0] in ("bf16", "fp32") else "int8"), name
        assert (cfg.async_.max_staleness == 0) == name.endswith("-sync"), name
        assert (cfg.train.mini_batches == 2) == name.endswith("-mb2"), name


def test_real_learning_clock_counts_the_wait_for_rollouts(tmp_path):
    import real_learning

    rows = [{"step": 1, "loss/policy": 0.1, "time/wait_s": 90.0, "time/step_s": 30.0}, {"step": 1, "eval/acc_fp": 0.5}]
    rows.append({"step": 2, "loss/policy": 0.1, "time/wait_s": 5.0, "time/step_s": 25.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert real_learning.clock(str(tmp_path)) == {1: 120.0, 2: 150.0}


def test_real_learning_throughput_leaves_the_inline_evaluations_out(tmp_path):
    """Steps and trained tokens per hour of the clock less time/eval_s (the same evaluation work in every config),
    up to the horizon; runs from before time/eval_s count no evaluation."""
    import real_learning

    rows = [
        {"step": 1, "loss/policy": 0.1, "time/wait_s": 2.0, "time/step_s": 4.0, "actor/tokens": 500.0},
        {"step": 2, "loss/policy": 0.1, "time/wait_s": 0.0, "time/step_s": 40.0, "time/eval_s": 36.0},
        {"step": 2, "eval/acc_fp": 0.5},
        {"step": 3, "loss/policy": 0.1, "time/wait_s": 9.0, "time/step_s": 9.0, "actor/tokens": 900.0},
    ]
    rows[1]["actor/tokens"] = 700.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = real_learning.throughput(str(tmp_path), steps=2)
    assert got == {"clock_s": 46.0, "eval_s": 36.0, "train_s": 10.0, "steps_per_hour": 720.0, "tokens_per_hour": 432000}


def test_rounds_advance_the_run_furthest_behind_to_common_segment_ends():
    done = {"a": 0, "b": 0, "c": 0}
    order = []
    while (nxt := demo_runs.next_segment(done, horizon=7, segment=3)) is not None:
        key, end = nxt
        order.append((key, end))
        done[key] = end
    assert order == [("a", 3), ("b", 3), ("c", 3), ("a", 6), ("b", 6), ("c", 6), ("a", 7), ("b", 7), ("c", 7)]
    # a run left mid-segment (a crash, a Ctrl-C) is finished to the common end first
    assert demo_runs.next_segment({"a": 6, "b": 4, "c": 6}, horizon=12, segment=3) == ("b", 6)
    assert demo_runs.next_segment({}, horizon=12, segment=3) is None


def test_real_ablation_table_has_a_row_per_config_and_dashes_for_missing_evals():
    import ablation

    rows = [
        {
            "config": config,
            "seed": 0,
            "steps": 2,
            "first_acc": 0.25,
            "last_acc": last,
            "best_acc": last,
            "first_acc_quant": 0.125,
            "last_acc_quant": None,
            "wall_s": 100.0,
            "curves": {k: [0.01, 0.03] for k in demo_runs.CURVE_KEYS},
        }
        for config, last in (("fp32", 0.5), ("int8-acr", None))
    ]
    lines = ablation.markdown_table(ablation.aggregate_real(rows)).splitlines()
    assert len(lines) == 4 and all(line.count("|") == 14 for line in lines)
    assert lines[2].startswith("| fp32 | 1 | 2 | 100 | 50 | 0.250 -> 0.500 (0.500) | 0.125 -> - | 0.020 / 0.020 |")
    assert "0.250 -> - (-)" in lines[3]


def run_benchmark(script: str, tmp_path, *flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """benchmarks/SCRIPT with its run folders under tmp_path; a failure shows the tail of its stderr."""
    cmd = [sys.executable, f"benchmarks/{script}", *flags, "--runs-dir", str(tmp_path / "runs")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_ablation_quick_writes_rows_and_plot_and_skips_finished_runs(demo_dir, tmp_path):
    flags = ("--quick", "--out", str(tmp_path), "--demo-dir", str(demo_dir))
    run_benchmark("ablation.py", tmp_path, *flags, timeout=300)
    result = json.loads((tmp_path / "ablation.json").read_text())
    assert result["benchmark"] == "ablation" and {"cpu", "cores", "torch"} <= set(result["machine"])
    (row,) = result["rows"]
    assert row["config"] == "int8-acr" and row["seed"] == 0 and row["steps"] == 2 and row["ok"]
    assert 0 <= row["final_acc"] <= 1 and row["best_acc"] >= row["final_acc"] and row["wall_s"] > 0
    assert row["curves"]["step"] == [1, 2] and len(row["curves"]["mismatch/kl_k3"]) == 2
    assert all(0 <= v <= 1 for v in row["curves"]["reward/mean"]) and row["evals"]["eval/acc_fp"]
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
    second = run_benchmark("ablation.py", tmp_path, *flags, timeout=120)
    assert "1 of 1 runs already finished, skipped" in second.stderr
    again = json.loads((tmp_path / "ablation.json").read_text())
    assert again["rows"][0]["wall_s"] == row["wall_s"]  # no new attempt was made


@pytest.mark.slow
def test_stress_ablation_quick_runs_fp32_and_the_int_configs_at_4_bits(tmp_path):
    from qurl.demo.prepare import Recipe, default_root, prepare

    root = default_root("sum-steps")
    prepare(root, Recipe(task="sum-steps"), progress=False)  # cached after the first time (about 20 min)
    run_benchmark("ablation.py", tmp_path, "--stress", "--quick", "--out", str(tmp_path))
    result = json.loads((tmp_path / "ablation-stress.json").read_text())
    assert result["benchmark"] == "ablation-stress" and result["task"] == "sum-steps" and result["weight_bits"] == 4
    assert [r["config"] for r in result["rows"]] == ["fp32", "int8-ppo", "int8-tis", "int8-acr", "int8-acr-s1.5"]
    assert all(r["ok"] and r["steps"] == 2 for r in result["rows"])
    for row in result["rows"]:
        bits = [o for o in row["overrides"] if o.startswith("quant.weight_bits=")]
        assert bits == ([] if row["config"] == "fp32" else ["quant.weight_bits=4"]), row["overrides"]
        assert any(o.startswith("rollout.sampling.max_new_tokens=") for o in row["overrides"])
    assert (tmp_path / "ablation-stress.png").stat().st_size > 10_000


@pytest.mark.slow
def test_scaling_study_quick_reports_changed_codes_per_config(demo_dir, tmp_path):
    run_benchmark("scaling_study.py", tmp_path, "--quick", "--out", str(tmp_path), "--demo-dir", str(demo_dir))
    result = json.loads((tmp_path / "scaling.json").read_text())
    by = {a["config"]: a for a in result["summary"]}
    assert set(by) == {"s1.0", "s1.5", "s2.0", "s1.5-mlp", "lr1.5x"}
    assert all(0 < a["changed_frac_mean"] < 1 and a["n"] == 1 for a in by.values())
    assert by["s1.0"]["changed_frac_factor"] == 1.0 and by["lr1.5x"]["expected_factor"] == 1.5
    assert 1.0 < by["s1.5"]["expected_factor"] < by["s2.0"]["expected_factor"] < 2.0
    assert (tmp_path / "scaling.png").stat().st_size > 10_000


@pytest.mark.slow
def test_pipeline_quick_reports_rates_shares_and_async_ratio(demo_dir, tmp_path):
    out = tmp_path / "pipeline.json"
    run_benchmark("pipeline.py", tmp_path, "--quick", "--out", str(out), "--demo-dir", str(demo_dir), timeout=300)
    result = json.loads(out.read_text())
    assert [(r["quant"], r["max_staleness"]) for r in result["rows"]] == [("int8", 0), ("int8", 1)]
    for row in result["rows"]:
        assert row["ok"] and row["measured_steps"] == 3 and row["steps_per_hour"] > 0
        assert abs(row["rollout_share"] + row["push_share"] + row["train_share"] - 1) < 1e-9
    assert result["ratios"]["async_over_sync"]["int8/staleness1"] > 0


@pytest.mark.slow
def test_pipeline_quick_on_the_real_workload_times_the_rollout_server(real_dir, tmp_path):
    out = tmp_path / "pipeline.json"
    run_benchmark("pipeline.py", tmp_path, "--workload", "real", "--quick", "--out", str(out), timeout=600)
    result = json.loads(out.read_text())
    assert result["workload"] == "real"
    assert [(r["quant"], r["dtype"], r["max_staleness"]) for r in result["rows"]] == [
        ("int8", "float32", 0),
        ("int8", "float32", 1),
    ]
    for row in result["rows"]:
        assert row["ok"] and row["measured_steps"] == 3 and row["steps_per_hour"] > 0
        assert 0 < row["engine_s_per_step"] and 0 < row["rollout_share"] < 1 and row["response_len_mean"] <= 16
        # tokens per hour counts the tokens trained: the quick shape's 2 samples a step at their mean length
        assert row["response_tokens"] == pytest.approx(2 * row["measured_steps"] * row["response_len_mean"])


def test_summary_tables_present_results_and_names_missing_ones(tmp_path):
    import summary

    rows = [{"engine": "torch", "dtype": "int8", "tokens_per_s": 1234.5678, "repeats": 3, "detail": {"x": 1}}]
    (tmp_path / "rollout_throughput.json").write_text(
        json.dumps({"benchmark": "rollout_throughput", "machine": {"cpu": "TestCPU", "cores": 2}, "rows": rows})
    )
    (tmp_path / "pipeline.json").write_text(
        json.dumps(
            {
                "benchmark": "pipeline",
                "machine": {"cpu": "TestCPU"},
                "rows": [{"quant": "int8", "max_staleness": 1}],
                "ratios": {"async_over_sync": {"int8/staleness1": 1.4}},
            }
        )
    )
    out = tmp_path / "RESULTS.md"
    assert summary.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| engine | dtype | tokens_per_s | repeats |" in text and "| torch | int8 | 1235 | 3 |" in text
    assert "Machine: cpu TestCPU, cores 2" in text and '"int8/staleness1": 1.4' in text
    assert f"Not run yet: `python benchmarks/wire.py --out {tmp_path}/wire.json`" in text
