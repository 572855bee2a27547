"""qurl/real/gym.py and the gym reward: reasoning-gym rows from a recipe, disjoint splits, the library's own verifier,
one-line errors (reasoning-gym is installed by `make test`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qurl.real import gym
from qurl.real.gsm import MissingPackageError
from qurl.real.prepare import main as prepare_main
from qurl.rewards import RewardPool, gym_final_answer, gym_reward

rg = pytest.importorskip("reasoning_gym")

SMALL = gym.GymRecipe(
    tasks={
        "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"]},
        "chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
    },
    train_size=200,
    heldout_size=40,
)


def write_recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_train_and_heldout_share_no_question_and_are_deterministic() -> None:
    train, held = gym.generate(SMALL)
    assert len(train) == 200 and len(held) == 40
    questions = lambda rows: [gym.gold(r)[1]["question"] for r in rows]  # noqa: E731
    # one-digit sums have ~200 distinct questions: the held-out ones really recur in the train seed's draws
    assert not set(questions(train)) & set(questions(held))
    assert {r["data_source"] for r in train} == {"reasoning_gym/basic_arithmetic", "reasoning_gym/chain_sum"}
    assert all(r["prompt"][0] == {"role": "system", "content": gym.INSTRUCTION} for r in train + held)
    for rows in (train[:20], held[:20]):  # tasks interleaved: a dev slice or eval.max_problems mixes them
        assert {r["data_source"] for r in rows} == {"reasoning_gym/basic_arithmetic", "reasoning_gym/chain_sum"}
    again, held_again = gym.generate(SMALL)
    assert again == train and held_again == held
    other, _ = gym.generate(gym.GymRecipe(**{**SMALL.__dict__, "seed": 1}))
    assert questions(other) != questions(train)


def test_the_held_out_draws_would_overlap_without_the_filter() -> None:
    """The filter is what keeps the splits apart: the raw train-seed draws do contain held-out questions."""
    kw = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    held = {e["question"] for e in rg.create_dataset("chain_sum", seed=1, size=20, **kw)}
    raw = {e["question"] for e in rg.create_dataset("chain_sum", seed=0, size=164, **kw)}
    assert held & raw


def test_gym_reward_is_full_marks_from_the_datasets_own_score_answer() -> None:
    _, held = gym.generate(SMALL)
    for r in held[:10] + held[-10:]:
        task, entry = gym.gold(r)
        score = rg.get_score_answer_fn(task)
        truth = r["reward_model"]["ground_truth"]
        answer = entry["answer"]
        for response, extracted in [
            (f"<answer>{answer}</answer>", answer),
            (f"<answer>{answer}.0</answer>", f"{answer}.0"),  # partial credit, as the library gives it
            (f"<answer>{int(answer) + 1}</answer>", str(int(answer) + 1)),
        ]:
            assert gym_final_answer(response) == extracted
            assert gym_reward(response, truth) == float(score(extracted, entry) == 1.0)
        assert gym_reward(f"<answer>{answer}</answer>", truth) == 1.0
        # the library's partial credit for an answer containing the gold one counts as wrong
        assert 0 < score(f"{answer}9", entry) < 1 and gym_reward(f"<answer>{answer}9</answer>", truth) == 0.0
        assert gym_reward("no idea", truth) == 0.0 and gym_final_answer("no idea") is None
        assert gym_final_answer(f"The sum is {answer}.") is None  # no fallback: outside the tags is no answer


def test_reward_pool_scores_gym_rows_in_its_workers() -> None:
    _, held = gym.generate(SMALL)
    items = [(f"<answer>{gym.gold(r)[1]['answer']}</answer>", r["reward_model"]["ground_truth"]) for r in held[:6]]
    truth = [r["reward_model"]["ground_truth"] for r in held]
    items += [("<answer>999</answer>", truth[0]), ("hmm", truth[1])]
    with RewardPool("gym", workers=1, timeout_s=10.0) as pool:
        results = pool.score(items)
    assert [r.reward for r in results] == [1.0] * 6 + [0.0, 0.0]
    assert [r.status for r in results[-2:]] == ["ok", "no_answer"]


def test_recipe_file_loads_and_bad_ones_are_one_line(tmp_path: Path) -> None:
    shipped = gym.load_recipe(Path(__file__).parent.parent / "configs" / "tasks" / "gym-arith.yaml")
    gym.check_recipe(shipped)
    assert set(shipped.tasks) == {"basic_arithmetic", "chain_sum"}
    cases = {
        "tasks: {no_such_task: {}}\n": "unknown reasoning-gym task 'no_such_task'",
        "tasks: {basic_arithmetic: {bogus: 1}}\n": "tasks.basic_arithmetic: the dataset refuses",
        "tasks: {basic_arithmetic: {min_terms: 5, max_terms: 2}}\n": "max_terms must be >= min_terms",
        "tasks: {basic_arithmetic: {}}\nepochs: 3\n": "unknown key(s) epochs",
        "tasks: []\n": "'tasks' must map",
        "tasks: {basic_arithmetic: {}}\ntrain_size: -1\n": "train_size must be a non-negative integer",
        "tasks: {basic_arithmetic: [1]\n": "cannot read the recipe",
    }
    for text, expected in cases.items():
        path = write_recipe(tmp_path, text)
        with pytest.raises(gym.GymError) as err:
            gym.check_recipe(gym.load_recipe(path))
        assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_unknown_task_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, real_dir: Path) -> None:
    path = write_recipe(tmp_path, "tasks: {basic_arithmetik: {}}\n")
    assert prepare_main(["--out", str(real_dir), "--gym", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qurl-prepare-real: tasks: unknown reasoning-gym task 'basic_arithmetik'; similar: basic_")
    assert "\n" not in err


def test_missing_reasoning_gym_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find = gym.importlib.util.find_spec
    missing = lambda n, *a: None if n == "reasoning_gym" else real_find(n, *a)  # noqa: E731
    monkeypatch.setattr(gym.importlib.util, "find_spec", missing)
    with pytest.raises(MissingPackageError, match="reasoning-gym is not installed; run `bash scripts/setup.sh real`"):
        gym.generate(SMALL)


def test_rows_are_read_back_by_the_data_loader(tmp_path: Path) -> None:
    from qurl.data import load_examples

    train, _ = gym.generate(SMALL)
    gym.write_rows(tmp_path / "train.jsonl", train)
    assert gym.read_rows(tmp_path / "train.jsonl") == train
    examples, report = load_examples([tmp_path / "train.jsonl"], strict=True)
    assert len(examples) == 200
    assert json.loads(examples[0].answer) == json.loads(train[0]["reward_model"]["ground_truth"])
