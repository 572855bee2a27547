"""reasoning-gym tasks as the real track's data: a recipe names tasks and difficulty, the library generates and scores.

A recipe (YAML, e.g. ``configs/tasks/gym-arith.yaml``)::

    tasks:                      # reasoning-gym dataset name -> its config's keyword arguments (difficulty)
      basic_arithmetic: {min_terms: 2, max_terms: 2, max_digits: 2, operators: ["+", "-"]}
    train_size: 8192            # problems, shared evenly between the tasks
    heldout_size: 256
    seed: 0

Train and held-out problems of task k come from ``create_dataset`` with the seeds ``4 * seed + 2k`` and
``4 * seed + 2k + 1`` (never equal), and any train problem whose question text is also a held-out question
is dropped, so no held-out problem is ever trained on. Rows are verl-style: ``INSTRUCTION`` as the system turn
(replacing the chat template's default system prompt, 18 of SmolLM2's 54 prompt tokens) and the question as the user
turn, ``data_source`` ``reasoning_gym/<task>``, and as ground truth the JSON of
``{"task", "entry"}``, which the ``gym`` reward (``qurl/rewards.py``) hands to the dataset's own ``score_answer``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from pathlib import Path
from random import Random
from typing import Any

import yaml

from qurl.real.gsm import MissingPackageError

INSTRUCTION = "Give only the final answer, inside <answer></answer> tags."
RECIPE_KEYS = ("tasks", "train_size", "heldout_size", "seed")


class GymError(ValueError):
    """A recipe that cannot generate: unknown task, bad difficulty setting, malformed file; one line."""


@dataclasses.dataclass(frozen=True)
class GymRecipe:
    """Which tasks, how hard, how many problems: everything that determines the generated rows."""

    tasks: dict[str, dict[str, Any]]
    train_size: int = 8192
    heldout_size: int = 256
    seed: int = 0

    def fingerprint(self) -> str:
        """Stable hash of the recipe: the cache key of the rows and of the warm start built on them."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def load_recipe(path: str | Path) -> GymRecipe:
    """The recipe in a YAML file; GymError names the file and what is wrong."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise GymError(f"{path}: cannot read the recipe: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise GymError(f"{path}: a recipe is a mapping with keys {', '.join(RECIPE_KEYS)}")
    unknown = sorted(set(raw) - set(RECIPE_KEYS))
    if unknown:
        raise GymError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(RECIPE_KEYS)}")
    tasks = raw.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise GymError(f"{path}: 'tasks' must map at least one reasoning-gym dataset name to its settings")
    for name, kw in tasks.items():
        if kw is not None and not isinstance(kw, dict):
            raise GymError(f"{path}: tasks.{name}: settings must be a mapping, got {type(kw).__name__}")
    for key in ("train_size", "heldout_size", "seed"):
        if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] < 0):
            raise GymError(f"{path}: {key} must be a non-negative integer, got {raw[key]!r}")
    recipe = GymRecipe(
        tasks={str(n): dict(kw or {}) for n, kw in tasks.items()}, **{k: raw[k] for k in RECIPE_KEYS[1:] if k in raw}
    )
    if recipe.train_size < len(recipe.tasks) or recipe.heldout_size < len(recipe.tasks):
        raise GymError(f"{path}: train_size and heldout_size need at least one problem per task")
    return recipe


def _library() -> Any:
    """reasoning_gym, or MissingPackageError saying how to install it (the real track's extra)."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise MissingPackageError("reasoning-gym is not installed; run `bash scripts/setup.sh real` (or `make real`)")
    try:
        import reasoning_gym
    except ImportError as e:  # installed without its own dependencies
        raise MissingPackageError(
            f"reasoning-gym cannot be imported ({e}); reinstall it with its dependencies: `bash scripts/setup.sh real`"
        ) from None
    return reasoning_gym


def check_recipe(recipe: GymRecipe) -> None:
    """GymError for an unknown task name or settings its dataset refuses, before anything is generated."""
    rg = _library()
    from reasoning_gym.factory import DATASETS

    for name, kw in recipe.tasks.items():
        if name not in DATASETS:
            close = [d for d in sorted(DATASETS) if name.split("_")[0] in d][:5]
            raise GymError(
                f"tasks: unknown reasoning-gym task {name!r}"
                + (f"; similar: {', '.join(close)}" if close else f"; {len(DATASETS)} tasks, e.g. basic_arithmetic")
            )
        try:
            rg.create_dataset(name, seed=0, size=1, **kw)
        except (TypeError, ValueError, AssertionError) as e:
            raise GymError(f"tasks.{name}: the dataset refuses {kw}: {type(e).__name__}: {e}") from None


def _split_sizes(total: int, n: int) -> list[int]:
    return [total // n + (k < total % n) for k in range(n)]


def generate(recipe: GymRecipe) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): per task from disjoint seeds, train rows never repeating a held-out question."""
    check_recipe(recipe)
    rg = _library()
    train: list[dict] = []
    heldout: list[dict] = []
    n = len(recipe.tasks)
    sizes = zip(_split_sizes(recipe.train_size, n), _split_sizes(recipe.heldout_size, n))
    for k, ((name, kw), (n_train, n_held)) in enumerate(zip(recipe.tasks.items(), sizes)):
        held = list(rg.create_dataset(name, seed=4 * recipe.seed + 2 * k + 1, size=n_held, **kw))
        seen = {e["question"] for e in held}
        # Draw extra so that dropping held-out questions still leaves n_train (small answer spaces repeat often).
        pool = rg.create_dataset(name, seed=4 * recipe.seed + 2 * k, size=2 * n_train + 64, **kw)
        kept = [e for e in pool if e["question"] not in seen][:n_train]
        if len(kept) < n_train:
            raise GymError(
                f"tasks.{name}: only {len(kept)} of {n_train} train problems differ from the held-out ones; "
                "raise the difficulty or lower train_size"
            )
        train += [row(name, e) for e in kept]
        heldout += [row(name, e) for e in held]
    # Tasks interleaved, so that any slice (the warm start's dev rows, eval.max_problems) mixes them as the whole does.
    Random(recipe.seed).shuffle(train)
    Random(recipe.seed + 1).shuffle(heldout)
    return train, heldout


def row(task: str, entry: dict) -> dict:
    """One verl-style row: the instruction as the system turn, the question as the user turn; the whole entry as
    ground truth."""
    return {
        "prompt": [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": entry["question"].rstrip()}],
        "reward_model": {"ground_truth": json.dumps({"task": task, "entry": entry}, sort_keys=True)},
        "data_source": f"reasoning_gym/{task}",
    }


def write_rows(path: Path, rows: list[dict]) -> None:
    """JSONL, one row per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_rows(path: Path) -> list[dict]:
    """The rows write_rows wrote."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gold(r: dict) -> tuple[str, dict]:
    """(task, entry) of a row."""
    truth = json.loads(r["reward_model"]["ground_truth"])
    return truth["task"], truth["entry"]
