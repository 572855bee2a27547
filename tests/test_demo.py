"""The CPU demo: task splits, Qwen2-style tokenizer, warm-started model folder and its cache."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from qurl.demo import task as tasks
from qurl.demo.prepare import Recipe, default_root, greedy_accuracy, main, prepare, read_info
from qurl.demo.tokenizer import CHAT_TEMPLATE, IM_END, IM_START, PAD, save_tokenizer, train_tokenizer
from qurl.rewards import arith_reward

TINY = Recipe(
    train_size=256,
    heldout_size=32,
    dev_size=16,
    hidden=32,
    intermediate=64,
    layers=1,
    heads=2,
    kv_heads=1,
    batch=16,
    max_steps=4,
    eval_every=2,
)
TEXTS = [
    "What is 123+456?",
    "  two  spaces, a tab\tand\n\nnewlines\r\n end ",
    "Ünïcödé ✓ 数学 and \\boxed{42}",
    f"{IM_START}user\nWhat is 1+2?{IM_END}\n{IM_START}assistant\n3{IM_END}",
    "0123456789",
]


def _corpus() -> list[str]:
    return [
        f"{IM_START}user\n{e.problem}{IM_END}\n{IM_START}assistant\n{e.response}{IM_END}\n"
        for t in tasks.TASKS
        for e in tasks.make_split(t, "train", 200, 0)
    ]


@pytest.fixture(scope="module")
def hf_tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer folder next to a qwen2 config, the way a model folder holds it."""
    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(_corpus()), folder)
    Qwen2Config(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(folder)
    return folder


def test_autotokenizer_round_trips_like_the_tokenizers_library(hf_tok_dir: Path) -> None:
    raw = train_tokenizer(_corpus())
    auto = AutoTokenizer.from_pretrained(hf_tok_dir)
    assert 300 <= len(auto) <= 512
    for text in TEXTS:
        ids = auto.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text).ids, text
        assert auto.decode(ids) == text
    digits = auto.encode("0123456789", add_special_tokens=False)
    assert [auto.decode([i]) for i in digits] == list("0123456789")
    specials = auto.encode(f"{IM_START}{IM_END}{PAD}", add_special_tokens=False)
    assert specials == [auto.convert_tokens_to_ids(t) for t in (IM_START, IM_END, PAD)]
    assert auto.eos_token == IM_END and auto.pad_token == PAD


def test_tokenizer_training_is_deterministic() -> None:
    assert train_tokenizer(_corpus()).to_str() == train_tokenizer(_corpus()).to_str()
    merges = json.loads(train_tokenizer(_corpus()).to_str())["model"]["merges"]
    assert not any("<|" in "".join(m) for m in merges), "special tokens leaked into BPE merges"


def test_chat_template_is_qwen_style(hf_tok_dir: Path) -> None:
    auto = AutoTokenizer.from_pretrained(hf_tok_dir)
    assert auto.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "What is 1+2?"}]
    text = auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == f"{IM_START}user\nWhat is 1+2?{IM_END}\n{IM_START}assistant\n"
    ids = auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == auto.encode(text, add_special_tokens=False)
    assert ids.count(auto.convert_tokens_to_ids(IM_START)) == 2
    turn = msgs + [{"role": "assistant", "content": "3"}]
    assert auto.apply_chat_template(turn, tokenize=False) == text + f"3{IM_END}\n"


def test_splits_are_deterministic_disjoint_and_balanced() -> None:
    held = tasks.make_split("add", "heldout", 512, 0)
    train = tasks.make_split("add", "train", 4096, 0)
    assert held == tasks.make_split("add", "heldout", 512, 0)
    assert len({e.problem for e in held}) == 512
    assert not {e.problem for e in held} & {e.problem for e in train}
    assert all(tasks.split_of(e.problem) == "heldout" for e in held)
    for examples in (held, train):  # a weak hash once sent every answer ending in 0 to held-out
        counts = Counter(e.answer[-1] for e in examples)
        assert set(counts) == set("0123456789")
        assert all(0.05 < c / len(examples) < 0.15 for c in counts.values()), counts
    by_digit = Counter()
    held_by_digit = Counter()
    for a in range(100, 1000, 7):
        for b in range(100, 1000, 3):
            ex = tasks.make_example("add", [a, b])
            by_digit[ex.answer[-1]] += 1
            held_by_digit[ex.answer[-1]] += tasks.split_of(ex.problem) == "heldout"
    for d in by_digit:
        assert 0.03 < held_by_digit[d] / by_digit[d] < 0.10, (d, held_by_digit[d], by_digit[d])


def test_examples_and_gold_answers() -> None:
    ex = tasks.make_example("add", [123, 456])
    assert ex == tasks.Example("What is 123+456?", "579", "579")
    ex = tasks.make_example("sum-steps", [12, 34, 56, 78])
    assert ex.problem == "What is 12+34+56+78?"
    assert ex.response == "12+34=46\n46+56=102\n102+78=180\n180" and ex.answer == "180"
    for ex in tasks.make_split("sum-steps", "train", 200, 3):
        terms = [int(x) for x in ex.problem[len("What is ") : -1].split("+")]
        lines = ex.response.splitlines()
        partial = terms[0]
        for line, x in zip(lines[:-1], terms[1:]):
            assert line == f"{partial}+{x}={partial + x}"
            partial += x
        assert lines[-1] == ex.answer == str(sum(terms))
        assert arith_reward(ex.response, ex.answer) == 1.0
        assert arith_reward(ex.response + "1", ex.answer) == 0.0
    with pytest.raises(ValueError, match="task: unknown task 'mul'"):
        tasks.make_split("mul", "train", 1, 0)
    with pytest.raises(ValueError, match="split: unknown split 'test'"):
        tasks.make_split("add", "test", 1, 0)


def test_tiny_prepare_layout_loads_caches_and_rebuilds(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    info = prepare(root, TINY, threads=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no temp folder left behind
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (root / "model" / name).is_file(), name
    for name, size, split in (("train.jsonl", 256, "train"), ("heldout.jsonl", 32, "heldout")):
        rows = [json.loads(line) for line in (root / name).read_text().splitlines()]
        assert len(rows) == size and all(set(r) == {"problem", "answer"} for r in rows)
        assert all(tasks.split_of(r["problem"]) == split and r["answer"].isdigit() for r in rows)
    assert read_info(root) == info
    assert info["fingerprint"] == TINY.fingerprint() and info["steps"] == 4
    assert info["param_count"] > 0 and 300 <= info["vocab_size"] <= 512 and 0.0 <= info["base_acc_heldout"] <= 1.0

    model = AutoModelForCausalLM.from_pretrained(root / "model")
    tok = AutoTokenizer.from_pretrained(root / "model")
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == info["param_count"]
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert model.config.eos_token_id == im_end == model.generation_config.eos_token_id == info["eos_token_id"]
    assert model.config.vocab_size == len(tok) == info["vocab_size"]
    raw = Tokenizer.from_file(str(root / "model" / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == raw.encode(text).ids

    stamp = (root.stat().st_ino, (root / "model" / "model.safetensors").stat().st_mtime_ns)
    assert prepare(root, TINY, threads=1, progress=False) == info
    assert (root.stat().st_ino, (root / "model" / "model.safetensors").stat().st_mtime_ns) == stamp

    changed = dataclasses.replace(TINY, seed=1)
    info2 = prepare(root, changed, threads=1, progress=False)
    assert info2["fingerprint"] == changed.fingerprint() != info["fingerprint"]
    assert read_info(root) == info2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_warm_start_threads_follow_the_tasks_runnable_now(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale 1-minute load average (what `make lint`'s compiles leave behind) no longer holds the warm start to one
    thread; a task runnable now does, and without /proc/loadavg the 1-minute average decides."""
    from qurl.demo import prepare as prep

    monkeypatch.setattr(prep.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(prep.os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    monkeypatch.setattr(prep, "LOADAVG", tmp_path / "loadavg")
    prep.LOADAVG.write_text("3.00 2.50 1.00 1/300 12345\n")  # only this process runs
    assert prep.default_threads() == 2
    prep.LOADAVG.write_text("3.00 2.50 1.00 2/300 12345\n")  # and one other task
    assert prep.default_threads() == 1
    prep.LOADAVG.unlink()
    assert prep.default_threads() == 1


def test_default_root_and_cli_errors(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("QURL_DEMO_DIR", raising=False)
    assert default_root() == Path(".cache/qurl-demo")
    monkeypatch.setenv("QURL_DEMO_DIR", "/x/demo")
    assert default_root("add") == Path("/x/demo")
    assert default_root("sum-steps") == Path("/x/demo-sum-steps")
    for argv, word in (
        (["--max-steps", "0"], "--max-steps"),
        (["--task", "mul"], "--task"),
        (["--target-acc", "2"], "--target-acc"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert word in capsys.readouterr().err


def test_base_model_accuracy_in_band(demo_dir: Path) -> None:
    info = read_info(demo_dir)
    assert info["fingerprint"] == Recipe().fingerprint()
    assert 0.1 <= info["base_acc_heldout"] <= 0.6
    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model")
    tok = AutoTokenizer.from_pretrained(demo_dir / "model")
    rows = [json.loads(line) for line in (demo_dir / "heldout.jsonl").read_text().splitlines()]
    acc = greedy_accuracy(model, tok, [r["problem"] for r in rows], [r["answer"] for r in rows])
    assert abs(acc - info["base_acc_heldout"]) <= 0.01  # thread counts may flip a rare argmax


def test_greedy_accuracy_left_padding_matches_unpadded(demo_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model")
    tok = AutoTokenizer.from_pretrained(demo_dir / "model")
    rows = [json.loads(line) for line in (demo_dir / "heldout.jsonl").read_text().splitlines()][:64]
    longer = tasks.make_split("sum-steps", "heldout", 16, 0)  # longer prompts: the sums get left-padded
    p_add, a_add = [r["problem"] for r in rows], [r["answer"] for r in rows]
    p_long, a_long = [e.problem for e in longer], [e.answer for e in longer]
    assert len({len(ids) for ids in tok(p_add)["input_ids"]}) == 1  # alone, the sums need no padding
    acc_add = greedy_accuracy(model, tok, p_add, a_add, max_new_tokens=8)
    acc_long = greedy_accuracy(model, tok, p_long, a_long, max_new_tokens=8)
    acc_mixed = greedy_accuracy(model, tok, p_long + p_add, a_long + a_add, max_new_tokens=8)
    assert acc_add > 0.0
    assert round(acc_mixed * 80) == round(acc_add * 64 + acc_long * 16)
    with pytest.raises(ValueError, match="problems/answers"):
        greedy_accuracy(model, tok, p_add, a_add[:-1])


@pytest.mark.slow
def test_sum_steps_prepare_runs(tmp_path: Path) -> None:
    info = prepare(tmp_path / "demo", Recipe(task="sum-steps"), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "demo" / "heldout.jsonl").read_text().splitlines()]
    assert len(rows) == 512 and rows[0]["problem"].count("+") == 3
    assert info["reached_target"] and 0.1 <= info["base_acc_heldout"] <= 0.6


def test_cached_cli_answers_without_importing_torch(demo_dir: Path) -> None:
    code = (
        "import sys; from qurl.demo.prepare import main; main(['--out', sys.argv[1]]); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code, str(demo_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "(cached)" in out.stdout and "base greedy held-out accuracy" in out.stdout
