"""Every shipped recipe against the data it names: a correct answer written the way that data's prompts ask scores 1
with the recipe's reward, a wrong one 0 (the DAPO recipe's `Answer: X` scored 0 with the `math` reward before).

The GPU recipes' data come from tests/fixtures/recipe_data.py (rows in each dataset's own format, and the verl parquet
built from them); the CPU recipes' from their preparation (the demo and the real track).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures import recipe_data

from qurl.config import load_config
from qurl.data import PromptDataset
from qurl.rewards import BUILTIN

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
# the GPU recipes' data files -> (fixture dataset, format); every file a shipped config names must be here
GPU_DATA = {
    "data/deepscaler/train.jsonl": "deepscaler",
    "data/aime24/test.jsonl": "aime24",
    "data/dapo-math-17k/train.parquet": "math_dapo",
    "data/aime24/test.parquet": "aime24",
}


def answer_in_asked_form(prompt: str, answer: str) -> str:
    """A response that ends with `answer` in the form the prompt asks for (or shows, in a one-shot example)."""
    if "<answer></answer>" in prompt:
        return f"<answer>{answer}</answer>"
    if "\\boxed{}" in prompt:
        return f"We work it out step by step.\nSo the final answer is $\\boxed{{{answer}}}$."
    if "Answer: $Answer" in prompt:
        return f"We work it out step by step.\nAnswer: {answer}"
    if "####" in prompt:
        return f"We work it out step by step.\n#### {answer}"
    return answer  # the demo's prompts ask for the sum alone


def gym_rows(rel: str, tmp: Path) -> str:
    """The real learning track's rows as `qurl-prepare-real --gym` writes them, from the shipped task recipe (fewer)."""
    from qurl.real.gym import GymRecipe, generate, load_recipe, write_rows

    shipped = load_recipe(REPO / "configs" / "tasks" / "gym-arith.yaml")
    train, heldout = generate(GymRecipe(tasks=shipped.tasks, train_size=10, heldout_size=10))
    path = tmp / rel
    write_rows(path, train if rel.endswith("train.jsonl") else heldout)
    return str(path)


def gold_text(reward: str, answer: str) -> str:
    """The answer as a response writes it: the gym reward's gold is the JSON of a reasoning-gym entry."""
    return json.loads(answer)["entry"]["answer"] if reward == "gym" else answer


def materialise(rel: str, tmp: Path) -> str:
    """A GPU recipe's data file, written from the fixture rows in the file's own format."""
    dataset, path = GPU_DATA[rel], tmp / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if rel.endswith(".jsonl"):  # DeepScaleR-style rows: problem, answer
        rows = recipe_data.DEEPSCALER if dataset == "deepscaler" else recipe_data.AIME_2024
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        table = pq.read_table(recipe_data.PARQUET)
        keep = [r for r in table.to_pylist() if r["data_source"] == dataset]
        pq.write_table(table.from_pylist(keep, schema=table.schema), path)
    return str(path)


@pytest.mark.parametrize("config", CONFIGS)
def test_each_recipe_scores_answers_written_as_its_data_asks(config, tmp_path, request):
    cfg = load_config(str(REPO / "configs" / config), check_paths=False)
    files = [*cfg.data.train_files, *cfg.data.eval_files]
    if any(f.startswith(".cache/qurl-demo") for f in files):
        request.getfixturevalue("demo_dir")
    if any(f.startswith(".cache/qurl-real/gsm") for f in files):
        request.getfixturevalue("real_dir")
    reward = BUILTIN[cfg.reward.name]
    for rel in files:
        if rel in GPU_DATA:
            path = materialise(rel, tmp_path)
        elif rel.startswith(".cache/qurl-real/gym/"):  # the warm start that comes with them takes minutes
            path = gym_rows(rel, tmp_path)
        else:
            path = str(REPO / rel)
        data = PromptDataset([path], instruction=cfg.data.instruction, shuffle=False)
        for i in range(min(len(data), 5)):
            example = data[i]
            prompt = "\n".join(m["content"] for m in example.messages)  # the form is asked in any turn
            right = answer_in_asked_form(prompt, gold_text(cfg.reward.name, example.answer))
            wrong = answer_in_asked_form(prompt, "987654")
            assert reward.final_answer(right) is not None, (config, rel, right)
            assert reward.score(right, example.answer) == 1.0, (config, rel, prompt[-200:], right)
            assert reward.score(wrong, example.answer) == 0.0, (config, rel, wrong)


def test_the_parquet_fixture_is_built_from_the_rows(tmp_path):
    fresh = tmp_path / "recipe_data.parquet"
    recipe_data.write_parquet(str(fresh))
    assert pq.read_table(fresh).to_pylist() == pq.read_table(recipe_data.PARQUET).to_pylist()


def test_every_gpu_recipe_data_file_has_fixture_rows():
    for config in CONFIGS:
        cfg = load_config(str(REPO / "configs" / config), check_paths=False)
        for rel in [*cfg.data.train_files, *cfg.data.eval_files]:
            assert rel.startswith(".cache/") or rel in GPU_DATA, (config, rel)
