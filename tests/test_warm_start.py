"""qurl/real/warm_start.py at toy sizes: a one-layer Llama with SmolLM2's tokenizer on reasoning-gym rows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from qurl.real import gym
from qurl.real.prepare import MODEL_DIR
from qurl.real.warm_start import WarmStart, response_loss, sft_tensors, target_text, train

pytest.importorskip("reasoning_gym")

RECIPE = gym.GymRecipe(
    tasks={"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"]}},
    train_size=48,
    heldout_size=8,
)


@pytest.fixture(scope="module")
def tiny_dir(real_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Llama (hidden 16) with the real tokenizer, saved as a Hugging Face folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(real_dir / MODEL_DIR)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    out = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_labels_cover_the_tagged_answer_and_its_end_token_only(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    rows, _ = gym.generate(RECIPE)
    ids, labels, lengths = sft_tensors(tok, rows[:4])
    for i, r in enumerate(rows[:4]):
        taught = labels[i][labels[i] != -100].tolist()
        assert tok.decode(taught[:-1]) == target_text(gym.gold(r)[1]) and taught[-1] == tok.eos_token_id
        assert int(lengths[i]) == int((labels[i] != -100).nonzero().max()) + 1


def test_response_loss_equals_the_models_own_loss(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    rows, _ = gym.generate(RECIPE)
    ids, labels, _ = sft_tensors(tok, rows[:6])
    torch.testing.assert_close(response_loss(model, ids, labels), model(input_ids=ids, labels=labels).loss)


def test_warm_start_learns_saves_and_reports(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    rows, held = gym.generate(RECIPE)
    ws = WarmStart(max_steps=30, batch=8, lr=1e-2, warmup=1, eval_every=15, dev_size=8, target_acc=1.1)
    info = train(tiny_dir, tmp_path / "warm", rows, held, ws, progress=False)
    assert info["steps"] == 30 and not info["reached_target"]
    assert [h[0] for h in info["history"]] == [0, 15, 30]
    assert 0.0 <= info["heldout_acc"] <= 1.0 and info["heldout_size"] == 8
    before = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "warm", dtype=torch.float32)
    from transformers import AutoTokenizer

    ids, labels, _ = sft_tensors(AutoTokenizer.from_pretrained(tmp_path / "warm"), rows[:16])
    with torch.no_grad():
        assert response_loss(after, ids, labels) < 0.7 * response_loss(before, ids, labels)
    json.dumps(info)  # what gym.json stores


def test_warm_start_checks_every_step_once_close_to_the_target(tiny_dir: Path, tmp_path: Path) -> None:
    rows, held = gym.generate(RECIPE)

    def checked_at(ws: WarmStart) -> list[int]:
        return [h[0] for h in train(tiny_dir, tmp_path / "warm", rows, held, ws, progress=False)["history"]]

    far = WarmStart(max_steps=4, batch=8, eval_every=15, dev_size=8, target_acc=1.1, close_margin=0.0)
    assert checked_at(far) == [0, 4]
    assert checked_at(dataclasses.replace(far, close_margin=1.1)) == [0, 1, 2, 3, 4]  # any accuracy is within 1.1


def test_warm_start_stops_at_once_when_the_model_already_reaches_the_target(tiny_dir: Path, tmp_path: Path) -> None:
    rows, held = gym.generate(RECIPE)
    ws = WarmStart(max_steps=30, batch=8, eval_every=5, dev_size=8, target_acc=0.0)
    info = train(tiny_dir, tmp_path / "warm", rows, held, ws, progress=False)
    assert info["steps"] == 0 and info["reached_target"] and (tmp_path / "warm" / "config.json").is_file()
