"""Synthetic arithmetic task of the CPU demo: problems, gold answers and a deterministic split.

Tasks:
- ``add``: ``What is 123+456?`` -> ``579`` (a, b uniform in 100..999).
- ``sum-steps``: ``What is 12+34+56+78?`` (terms in 10..99) -> one line per partial sum, then the answer alone on
  the last line (``12+34=46\\n46+56=102\\n102+78=180\\n180``), so responses are ~30 tokens long
  and sampler mismatch accumulates over a sequence.

Operands have a fixed width: a 2-layer model learns aligned digits far faster.
The gold ``answer`` is always a plain integer string and is the last line of the gold response,
which is what ``qurl.rewards.arith_reward`` (exact integer match of the last line) scores.
Held-out membership is a keyed hash of the problem text, so it never depends on the seed or on
the order problems are drawn in.
"""

from __future__ import annotations

import hashlib
import random
from typing import NamedTuple

TASKS = ("add", "sum-steps")
SPLITS = ("train", "heldout")
HELDOUT_BUCKETS = 16  # one problem in 16 belongs to the held-out side


class Example(NamedTuple):
    problem: str
    answer: str
    response: str  # the gold response the warm start imitates, without the end-of-turn token


def _operands(task: str, rng: random.Random) -> list[int]:
    if task == "add":
        return [rng.randint(100, 999), rng.randint(100, 999)]
    if task == "sum-steps":
        return [rng.randint(10, 99) for _ in range(4)]
    raise ValueError(f"task: unknown task {task!r}; allowed: {', '.join(TASKS)}")


def make_example(task: str, operands: list[int]) -> Example:
    """Problem text, gold answer and gold response for one operand list."""
    problem = "What is " + "+".join(map(str, operands)) + "?"
    total = sum(operands)
    if task == "add":
        return Example(problem, str(total), str(total))
    if task == "sum-steps":
        lines, partial = [], operands[0]
        for x in operands[1:]:
            lines.append(f"{partial}+{x}={partial + x}")
            partial += x
        return Example(problem, str(total), "\n".join(lines + [str(total)]))
    raise ValueError(f"task: unknown task {task!r}; allowed: {', '.join(TASKS)}")


def split_of(problem: str) -> str:
    """Which split a problem belongs to; a cryptographic hash keeps any answer digit from leaking."""
    h = int.from_bytes(hashlib.blake2b(problem.encode(), digest_size=8, person=b"qurl-split").digest(), "little")
    return "heldout" if h % HELDOUT_BUCKETS == 0 else "train"


def make_split(task: str, split: str, n: int, seed: int) -> list[Example]:
    """n distinct examples of one split, the same for the same (task, split, n, seed)."""
    if split not in SPLITS:
        raise ValueError(f"split: unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    rng = random.Random(f"{task}/{split}/{seed}")
    seen: set[str] = set()
    out: list[Example] = []
    while len(out) < n:
        ex = make_example(task, _operands(task, rng))
        if ex.problem not in seen and split_of(ex.problem) == split:
            seen.add(ex.problem)
            out.append(ex)
    return out
