"""Why the learner stops before or while it trains: the exceptions main.py turns into exit codes, each one line."""

from __future__ import annotations

import torch
import torch.distributed as dist


class StartError(RuntimeError):
    """The learner cannot start (model.path unusable, an endpoint taken); one line naming the setting."""


class Diverged(RuntimeError):
    """Training cannot go on: the weights hold inf or NaN, or update after update is skipped for a non-finite loss;
    one line naming the step, the learning rate and the last good checkpoint (empty off rank 0)."""


class MismatchStop(Diverged):
    """The mismatch alarm fired with mismatch.stop: the rollout engine no longer samples the learner's policy; one line
    naming the steps and the ceiling (empty off rank 0)."""


class BadRewards(RuntimeError):
    """Too many recent scores failed (the reward function raised, timed out, returned NaN); one line naming it
    (empty off rank 0)."""


def all_started(problem: StartError | None, is_main: bool) -> None:
    """Collective: when any rank failed to start, every rank raises; one line says why (rank 0's if it has one)."""
    flags = torch.tensor([int(problem is not None and is_main), int(problem is not None)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[1].item():
        raise problem if problem is not None and (is_main or not flags[0].item()) else StartError("")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
