"""The weight push's one owner on the learner (rank 0): each version as the engine loads it, whole or as a delta of
the version before with the checksum of the result, sent through one transport; the version the servers are to hold;
and the current version again, addressed to one server that lags. The control plane reports what the servers say
(on_status); nothing else sends weights or holds the pushed version.

Verbs: `push` takes a version to the servers; a transport `send`s it; `resend` gives the current version to one
server again (a hello, a request, or a lag that outlasts the grace, never while it evaluates).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from learner.servers import ServerInfo, ServerRegistry
from qurl.quant import CODE_DTYPES, changed_fraction
from qurl.wire import delta
from qurl.wire.frames import from_torch
from qurl.wire.protocol import WeightPush, WeightRef

LAG_GRACE_S = 5.0  # a heartbeat may lag a push this long, plus the push's transfer time, before a resend
RESEND_BYTES_PER_S = 100e6  # the slowest transfer-and-apply a resend allows for: an 8.7 GB push gets 87 s more
RESEND_INTERVAL_S = 2.0  # at most one resend per server this often (or per grace, when that is longer)


@dataclass
class PushStats:
    seconds: float
    bytes: int  # of what was sent (delta or whole)
    changed_frac: float  # share of quantized codes changed since the version before
    full_bytes: int  # of a whole push of the same version
    mode: str  # full | delta | skipped


class WeightSync:
    """Rank 0: pushes versions through `transport` (learner/weight_sync/*_transport.py) and resends to laggards."""

    def __init__(
        self,
        transport,
        servers: ServerRegistry,
        scheme: str,
        full_every: int = 10,
        grace_s: float = LAG_GRACE_S,
    ) -> None:
        self.transport, self.servers, self.scheme = transport, servers, scheme
        self.full_every, self.grace_s = full_every, grace_s
        self.version = 0  # the version the servers are to hold
        self.resends = 0
        self.resend_bytes = 0
        self._sent: dict[str, torch.Tensor] = {}  # the current version's tensors: a delta's base
        self._codes: dict[str, torch.Tensor] = {}
        self._current: WeightPush | WeightRef | None = None  # what a lagging server gets again
        self._current_bytes = 0
        self._pushed_at = -float("inf")
        self._lock = threading.Lock()  # the control thread reads the current push

    def start(self, version: int, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """The version the servers start from; `tensors`, version 0's, so that the first push's changed_frac means
        something (the servers quantized the same checkpoint)."""
        self.version = version
        if tensors is not None:
            self._codes = _codes(tensors)

    def push(self, version: int, tensors: dict[str, torch.Tensor], gathered_s: float = 0.0) -> dict:
        """Take `version` to the servers; its sync/* metrics (`gathered_s`: the time making `tensors` took)."""
        started = time.perf_counter() - gathered_s
        codes = _codes(tensors)
        changed = _changed_frac(self._codes, codes)
        if self.transport.deltas:
            message, current = self._messages(version, tensors)
            self.transport.send(message)
            stats = PushStats(0.0, _nbytes(message), changed, _nbytes(current), message.mode)
        else:
            current = self.transport.send(version, tensors)
            if current is None:  # cuda-ipc: a server still reads the buffers; the servers keep the version before
                return self.metrics(PushStats(time.perf_counter() - started, 0, 0.0, 0, "skipped"))
            nbytes = sum(t.nbytes for t in tensors.values())
            stats = PushStats(0.0, nbytes, changed, nbytes, "full")
            current = current if self.transport.resendable else None
        with self._lock:
            self.version, self._current, self._pushed_at = version, current, time.monotonic()
            self._current_bytes = stats.full_bytes
        self._codes, self._sent = codes, tensors
        stats.seconds = time.perf_counter() - started
        return self.metrics(stats)

    def _messages(self, version: int, tensors: dict[str, torch.Tensor]) -> tuple[WeightPush, WeightPush]:
        """(what to send, the whole version): a delta of the version before, or whole when there is nothing to build
        on (start, resume), every full_every versions, and for schemes without codes."""
        check = delta.checksum(tensors)
        full = WeightPush(version=version, scheme=self.scheme, checksum=check, tensors=_wire(tensors))
        if self._sent and version == self.version + 1 and version % self.full_every and delta.checked_names(tensors):
            whole, deltas = delta.diff(self._sent, tensors)
            return delta.delta_push(version, self.scheme, whole, deltas, check), full
        return full, full

    def metrics(self, stats: PushStats | None = None) -> dict:
        """The step's sync/* metrics: the push (zeros for a step without one) and the resends so far."""
        stats = stats or PushStats(0.0, 0, 0.0, 0, "none")
        out = {
            "sync/seconds": stats.seconds,
            "sync/bytes": stats.bytes,
            "sync/changed_frac": stats.changed_frac,
            "sync/full_bytes": stats.full_bytes,
            "sync/delta": int(stats.mode == "delta"),
            "sync/repushes": self.resends,
            "sync/repush_bytes": self.resend_bytes,
        }
        if stats.mode == "skipped":
            out["sync/skipped"] = 1
        return out

    def on_status(self, kind: str, info: ServerInfo, now: float, send_to: Callable[[object], bool]) -> None:
        """The control thread's report of one server's hello, heartbeat or request: resend the current version to it
        alone (send_to) when it asks, says hello behind, or lags past the grace while not evaluating."""
        with self._lock:
            current, version, pushed_at, size = self._current, self.version, self._pushed_at, self._current_bytes
        if current is None or info.version >= version and kind != "resend_weights":
            return
        grace = self.grace_s + size / RESEND_BYTES_PER_S  # the push may still be on its way or being applied
        asked = kind in ("resend_weights", "hello")
        if not asked and (info.evaluating or now - pushed_at < grace):
            return
        if now - info.repushed_at < max(RESEND_INTERVAL_S, grace if not asked else 0.0):
            return
        if send_to(current):
            info.repushed_at = now
            self.resends += 1
            self.resend_bytes += _nbytes(current)


def _wire(tensors: dict[str, torch.Tensor]) -> dict:
    return {name: from_torch(t) for name, t in tensors.items()}


def _nbytes(message: WeightPush | WeightRef) -> int:
    """Bytes of a message's payload: its tensors, or a WeightRef's per-rank handles."""
    if isinstance(message, WeightRef):
        return sum(len(p) for bucket in message.payloads or [] for p in bucket)
    return sum(t.data.nbytes for t in message.tensors.values())


def _codes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if t.dtype in CODE_DTYPES}


def _changed_frac(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """Share of quantized codes that changed since the previous push, weighted by tensor size; 0 without codes."""
    total = sum(t.numel() for name, t in new.items() if name in old)
    if total == 0:
        return 0.0
    return sum(changed_fraction(old[name], t) * t.numel() for name, t in new.items() if name in old) / total
