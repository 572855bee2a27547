"""The server's weight receiver: pushes applied in version order, deltas only on their exact base, checksums proven.

A full push applies over any older version. A delta for version V applies only when the engine holds exactly
V - 1; otherwise (a push was missed: SUB dropped it, or the server was busy or restarting) and after a checksum
mismatch the receiver asks the learner for a full push over the control channel, at most every REQUEST_S,
until one arrives. Meanwhile the engine keeps generating with the last verified version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from qurl import delta
from qurl.frames import ProtocolError
from qurl.protocol import WeightPush

log = logging.getLogger("rollout_server")

REQUEST_S = 1.0
COUNTERS = ("weight_deltas_applied", "weight_checksum_mismatches", "weight_deltas_without_base", "weight_full_requests")


class WeightReceiver:
    """Applies the pushes drained from SUB to one engine; counts into the server's counters."""

    def __init__(self, engine: Any, scheme: str, counters: dict[str, int], request_full: Callable[[], None]) -> None:
        self.engine, self.scheme, self.counters, self.request_full = engine, scheme, counters, request_full
        for key in COUNTERS:
            counters.setdefault(key, 0)
        self.need_full = False
        self._requested_at = -float("inf")

    def apply(self, pushes: list[WeightPush]) -> None:
        """Bring the engine to the newest version these pushes (in any order) reach from what it holds."""
        current = self.engine.version
        fresh = [p for p in pushes if p.version > current]
        fulls = [p for p in fresh if p.mode == "full"]
        if fulls:  # the newest full push makes everything older pointless
            start = max(fulls, key=lambda p: p.version)
            fresh = [start] + [p for p in fresh if p.mode == "delta" and p.version > start.version]
        fresh.sort(key=lambda p: p.version)
        self.counters["weight_pushes_ignored"] += len(pushes) - len(fresh)
        for push in fresh:
            if push.version <= self.engine.version:  # a second delta of one version
                self.counters["weight_pushes_ignored"] += 1
            elif not self._apply(push):
                break
        self.tick()

    def tick(self) -> None:
        """While a full push is needed, ask for one every REQUEST_S."""
        now = time.monotonic()
        if self.need_full and now - self._requested_at >= REQUEST_S:
            self._requested_at = now
            self.counters["weight_full_requests"] += 1
            self.request_full()

    def _apply(self, push: WeightPush) -> bool:
        if push.scheme != self.scheme:
            return self._reject(push, f"scheme {push.scheme!r}, this engine holds {self.scheme!r}")
        if push.mode == "delta" and push.version != self.engine.version + 1:
            self.counters["weight_deltas_without_base"] += 1
            log.warning(
                "delta push version %d needs version %d, the engine holds %d: asking for a full push",
                push.version,
                push.version - 1,
                self.engine.version,
            )
            self.need_full = True
            return False
        started = time.perf_counter()
        try:
            whole, deltas = delta.split_push(push)
            if push.mode == "full":
                if push.checksum is not None and delta.checksum(whole) != push.checksum:
                    raise delta.ChecksumMismatch(
                        f"the full push has {delta.checksum(whole)}, its header says {push.checksum}"
                    )
                self.engine.update_weights(whole, push.version)
            else:
                self.engine.apply_delta(whole, deltas, push.version, push.checksum)
        except delta.ChecksumMismatch as exc:
            self.counters["weight_checksum_mismatches"] += 1
            self.need_full = True
            return self._reject(push, str(exc))
        except (ProtocolError, ValueError, TypeError, KeyError, RuntimeError) as exc:
            self.need_full = self.need_full or push.mode == "delta"
            return self._reject(push, str(exc))
        self.counters["weight_pushes_applied"] += 1
        self.counters["weight_deltas_applied"] += push.mode == "delta"
        self.need_full = False  # the engine holds a version the learner's checksum vouches for
        log.info(
            "applied %s weights version %d (%d whole, %d delta tensors) in %.3f s",
            push.mode,
            push.version,
            len(whole),
            len(deltas),
            time.perf_counter() - started,
        )
        return True

    def _reject(self, push: WeightPush, why: str) -> bool:
        self.counters["weight_pushes_rejected"] += 1
        log.error("rejected %s weight push version %d: %s", push.mode, push.version, " ".join(why.split())[:300])
        return False
