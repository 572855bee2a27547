"""What a weight push puts on the wire: the engine's tensors whole every `sync.full_every` versions and, for a
quantized scheme, every tensor as a delta of the previous version between (qurl/delta.py), or a WeightRef whose
bytes travel by CUDA IPC or NCCL; and the push's statistics (bytes, share of codes changed). The control plane
sends it and keeps it for laggards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from learner.control_plane import ControlPlane
from qurl import delta
from qurl.frames import from_torch
from qurl.protocol import WeightPush, WeightRef
from qurl.quant import CODE_DTYPES, changed_fraction


@dataclass
class PushStats:
    seconds: float
    bytes: int  # of the push as sent (delta or full)
    changed_frac: float
    full_bytes: int  # of a full push of the same version
    mode: str


class WeightSender:
    """Builds each version's push (delta or whole) against the last one and hands it to the control plane."""

    def __init__(self, plane: ControlPlane, scheme: str, full_every: int = 1) -> None:
        self.plane = plane
        self.scheme = scheme
        self.full_every = full_every
        self._sent: dict[str, torch.Tensor] = {}  # the tensors of the last version built (a delta's base)
        self._codes: dict[str, torch.Tensor] = {}

    def set_baseline(self, tensors: dict[str, torch.Tensor]) -> None:
        """The codes the servers start from (version 0), so the first push's changed_frac means something."""
        self._codes = _codes(tensors)

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> PushStats:
        """Send `tensors` (quantize_state_dict's output) as version `version`; remember them for late joiners."""
        started = time.perf_counter()
        push, stats = self.build(version, tensors)
        self.send(push)
        stats.seconds = time.perf_counter() - started
        return stats

    def build(self, version: int, tensors: dict[str, torch.Tensor]) -> tuple[WeightPush, PushStats]:
        """Version `version` as a delta of the previous one or whole, and adopt it as current (not sent yet).

        Whole when there is no previous version to build on (start, resume), every full_every versions, and
        for schemes without codes.
        """
        started = time.perf_counter()
        check = delta.checksum(tensors)
        full = WeightPush(
            version=version,
            scheme=self.scheme,
            checksum=check,
            tensors={name: from_torch(t) for name, t in tensors.items()},
        )
        push = full
        if (
            self._sent
            and version == self.plane.version + 1
            and version % self.full_every
            and delta.checked_names(tensors)
        ):
            whole, deltas = delta.diff(self._sent, tensors)
            push = delta.delta_push(version, self.scheme, whole, deltas, check)
        codes = _codes(tensors)
        stats = PushStats(0.0, _nbytes(push), _changed_frac(self._codes, codes), _nbytes(full), push.mode)
        self.plane.adopt(version, full)
        self._codes, self._sent = codes, tensors
        stats.seconds = time.perf_counter() - started
        return push, stats

    def send(self, push: WeightPush) -> None:
        """Publish one push to every server."""
        self.plane.send(push)

    def announce(self, version: int, ref: WeightRef, tensors: dict[str, torch.Tensor], repush: bool) -> PushStats:
        """Send a WeightRef (the bytes travel by CUDA IPC or NCCL); repush=False: lagging servers get nothing again."""
        started = time.perf_counter()
        codes = _codes(tensors)
        changed = _changed_frac(self._codes, codes)
        self.plane.announce(version, ref, repush)
        self._codes = codes
        nbytes = sum(t.nbytes for t in tensors.values())
        return PushStats(time.perf_counter() - started, nbytes, changed, nbytes, "full")


def _nbytes(push: WeightPush) -> int:
    return sum(t.data.nbytes for t in push.tensors.values())


def _codes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if t.dtype in CODE_DTYPES}


def _changed_frac(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """Share of quantized codes that changed since the previous push, weighted by tensor size; 0 without codes."""
    total = sum(t.numel() for name, t in new.items() if name in old)
    if total == 0:
        return 0.0
    return sum(changed_fraction(old[name], t) * t.numel() for name, t in new.items() if name in old) / total
