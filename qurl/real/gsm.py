"""GSM-Symbolic problems from reasoning-gym's generators, loaded from their files without the package's heavy __init__.

reasoning-gym 0.1.25 ships ~100 generators built from GSM8K test templates; the ~85 its authors mark
working (``tasks_ok`` in ``gsm_symbolic.py``) are used here. Each generator needs only the standard
library and ``reasoning_gym/utils.py``; ``import reasoning_gym`` would pull optional heavy packages, so
the two generator modules are executed from their file paths with ``utils.py`` registered under its
own name for the duration. Held-out problems come from templates that training never sees.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from random import Random
from types import ModuleType
from typing import Any

GENERATOR_FILES = ("generators_00_49.py", "generators_50_99.py")
HELDOUT_EVERY = 6  # every 6th working template (by position in tasks_ok) is held out


class MissingPackageError(RuntimeError):
    """A registry package the real track needs is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Problem:
    template: int
    question: str
    answer: str  # exact value as text: an integer or a short decimal
    solution: str  # worked solution ending in "#### N"


def package_dir() -> Path:
    """reasoning_gym's folder, found without executing its __init__."""
    spec = importlib.util.find_spec("reasoning_gym")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError("reasoning-gym is not installed; run `bash scripts/setup.sh real` (or `make real`)")
    return Path(next(iter(spec.submodule_search_locations)))


def _exec_file(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_loader(name, importlib.machinery.SourceFileLoader(name, str(path)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def working_templates(root: Path) -> list[int]:
    """The template indices reasoning-gym marks working, read from gsm_symbolic.py's source (not imported)."""
    tree = ast.parse((root / "arithmetic" / "gsm_symbolic" / "gsm_symbolic.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "tasks_ok" for t in node.targets):
            return sorted(ast.literal_eval(node.value))
    raise MissingPackageError(f"{root}: gsm_symbolic.py has no tasks_ok list (not reasoning-gym 0.1.25?)")


def load_generators() -> dict[int, Callable[[Random, float], dict[str, Any]]]:
    """Working template index -> generator(rng, difficulty)."""
    root = package_dir()
    had_utils = sys.modules.get("reasoning_gym.utils")
    sys.modules["reasoning_gym.utils"] = _exec_file("reasoning_gym.utils", root / "utils.py")
    try:
        modules = [
            _exec_file(f"_qurl_gsm_{i}", root / "arithmetic" / "gsm_symbolic" / f)
            for i, f in enumerate(GENERATOR_FILES)
        ]
    finally:
        if had_utils is None:
            del sys.modules["reasoning_gym.utils"]
        else:
            sys.modules["reasoning_gym.utils"] = had_utils
    found = {int(n[len("generate_") :]): getattr(m, n) for m in modules for n in dir(m) if n.startswith("generate_")}
    return {t: found[t] for t in working_templates(root) if t in found}


def solution_steps(generator: Callable[[Random, float], dict[str, Any]]) -> int:
    """Worked-solution lines before the "#### N" line, the most over three draws: the template's length in steps."""
    return max(len(generator(Random(i), 1.0)["metadata"]["answer_cot"].splitlines()) - 1 for i in range(3))


def split_templates(templates: list[int]) -> tuple[list[int], list[int]]:
    """(train templates, held-out templates): disjoint, fixed by position in the sorted list."""
    held = [t for i, t in enumerate(sorted(templates)) if i % HELDOUT_EVERY == HELDOUT_EVERY // 2]
    return [t for t in sorted(templates) if t not in held], held


def make_problems(generators: dict[int, Callable], templates: list[int], n: int, seed: int) -> list[Problem]:
    """n problems cycling over the templates in a seeded order, each instance drawn with its own seeded rng.

    Instances of one template differ in names, objects and numbers (the rng picks them); problems drawn
    with different seeds or indices are different draws, so a fixed (seed, n) always gives the same file.
    """
    if not templates:
        raise ValueError("make_problems: no templates")
    order = Random(seed).sample(templates, len(templates))
    out = []
    for i in range(n):
        template = order[i % len(order)]
        ex = generators[template](Random(seed * 1_000_003 + i), 1.0)
        out.append(Problem(template, ex["question"], str(ex["answer"]), ex["metadata"]["answer_cot"]))
    return out
