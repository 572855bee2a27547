"""Cores lent by idle rollout servers: asynchronous on one CPU machine, the learner trains on them while the servers
have nothing to generate.

qurl-async splits a CPU machine's cores among the processes that compute at once (qurl/supervisor/launcher.py). With
a bounded staleness the servers finish the next batch part way through a learner step, then wait for the weights
with their cores idle, while the learner, held to its own share, sets the pace (the GSM-shaped pipeline on two
cores: servers busy 10-16 s of a 23-25 s learner step, RESULTS §13). The learner raises its intra-op threads to every
core while no server has work (learner/control_plane.py `servers_idle`: every grant received, no room for another,
no evaluation asked) and returns to its share as soon as one has. It checks at each decoder layer's forward and
backward, at most every CHECK_S; a server learns of new room at its next heartbeat, about a second later, so the
learner is back on its share before the server computes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from torch import nn

from qurl.supervisor.layout import LEND_CORES_ENV

CHECK_S = 0.02  # a decoder layer's forward at the CPU recipes' shapes takes 5-100 ms


class CoreLending:
    """Sets torch's intra-op threads to `cores` while idle() holds, else to `own`; metrics() says how long it lent."""

    def __init__(self, own: int, cores: int, idle: Callable[[], bool]) -> None:
        self.own, self.cores, self.idle = own, cores, idle
        self._checked = 0.0
        self._lent_since: float | None = None  # when the learner last took the servers' cores, while it holds them
        self._lent_s = 0.0
        self._mark = time.monotonic()

    def attach(self, layers: nn.ModuleList) -> None:
        """Check before each layer's forward and before its backward (a hook on its output's gradient)."""
        for layer in layers:
            layer.register_forward_pre_hook(lambda _module, _args: self.check())
            layer.register_forward_hook(self._on_output)

    def _on_output(self, _module: nn.Module, _args: tuple, output: torch.Tensor | tuple) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda _grad: self.check())

    def check(self) -> None:
        """Lend or return the cores, as the servers' state asks now."""
        now = time.monotonic()
        if now - self._checked < CHECK_S:
            return
        self._checked = now
        lend = self.idle()
        if lend and self._lent_since is None:
            torch.set_num_threads(self.cores)
            self._lent_since = now
        elif not lend:
            self.give_back()

    def give_back(self) -> None:
        """Back to the learner's own share now (its evaluation runs beside the servers'); the next check may lend."""
        if self._lent_since is not None:
            torch.set_num_threads(self.own)
            self._lent_s += time.monotonic() - self._lent_since
            self._lent_since = None

    def metrics(self) -> dict[str, float]:
        """perf/cores_lent_frac: the share of the time since the last call that the learner held the servers' cores."""
        now = time.monotonic()
        lent = self._lent_s + (now - self._lent_since if self._lent_since is not None else 0.0)
        if self._lent_since is not None:
            self._lent_since = now
        frac = lent / max(now - self._mark, 1e-9)
        self._lent_s, self._mark = 0.0, now
        return {"perf/cores_lent_frac": frac}


def from_env(idle: Callable[[], bool]) -> CoreLending | None:
    """The lending qurl-async asked for ($QURL_LEND_CORES, more cores than this process's threads), or None."""
    cores = int(os.environ.get(LEND_CORES_ENV) or 0)
    own = torch.get_num_threads()
    return CoreLending(own, cores, idle) if cores > own else None
