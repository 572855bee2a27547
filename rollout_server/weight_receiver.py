"""The server's one owner of weight apply: every WeightPush (zmq) and WeightRef (cuda-ipc, nccl) a server receives,
on the SUB socket or addressed to it over the control channel, is applied here in version order, counted here, and
refused through one path.

- WeightPush: a full push applies over any older version; a delta for version V only on exactly V - 1, and after a
  missed version or a checksum mismatch the receiver asks the learner for a full push (request_full, at most every
  REQUEST_S) until one arrives. Meanwhile the engine keeps generating with the last verified version.
- WeightRef over cuda-ipc: only the newest matters (its buffers hold that version whole).
- WeightRef over nccl: every ref is followed by broadcasts every replica must take in order, so every ref newer than
  the engine's version is applied, oldest first: a server that was busy while two versions went out takes each
  version's own bytes and ends on the newest with the labels to match.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from qurl.config import get
from qurl.wire import delta
from qurl.wire import sglang_payload as payload
from qurl.wire.frames import ProtocolError
from qurl.wire.protocol import WeightPush, WeightRef

log = logging.getLogger("rollout_server")

REQUEST_S = 1.0
COUNTERS = (
    "weight_pushes_applied",
    "weight_pushes_rejected",
    "weight_pushes_ignored",
    "weight_deltas_applied",
    "weight_checksum_mismatches",
    "weight_deltas_without_base",
    "weight_full_requests",
    "weight_apply_ms",  # wall milliseconds spent applying pushes
)
APPLY_ERRORS = (ProtocolError, ValueError, TypeError, KeyError, RuntimeError)


def join_update_group(engine: Any, cfg: Any, replica: int) -> None:
    """nccl: join this replica's TP ranks to learner rank 0's group (blocks until every member has joined)."""
    tp = get(cfg, "rollout.tp_size")
    world, offsets = payload.update_group_layout(len(get(cfg, "cluster.rollout_gpus")) // tp, tp)
    if not 0 <= replica < len(offsets):
        raise ValueError(f"replica {replica} is outside the {len(offsets)} replicas of cluster.rollout_gpus")
    host, port = payload.group_address(get(cfg, "sync.group_endpoint"))
    engine.init_update_group(host, port, offsets[replica], world)


class WeightReceiver:
    """Applies the weight messages drained from the sockets to one engine; owns its counters."""

    def __init__(self, engine: Any, scheme: str, request_full: Callable[[], None], replica: int = 0) -> None:
        self.engine, self.scheme, self.request_full = engine, scheme, request_full
        self.replica = replica  # which per-rank payloads of a cuda-ipc WeightRef are this server's
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.need_full = False
        self._requested_at = -float("inf")

    def apply(self, messages: list[WeightPush | WeightRef]) -> bool:
        """Bring the engine to the newest version these messages (in any order) reach; True when its version moved."""
        before = self.engine.version
        self._apply_pushes([m for m in messages if isinstance(m, WeightPush)])
        self._apply_refs([m for m in messages if isinstance(m, WeightRef)])
        self.tick()
        return self.engine.version != before

    def tick(self) -> None:
        """While a full push is needed, ask for one every REQUEST_S."""
        now = time.monotonic()
        if self.need_full and now - self._requested_at >= REQUEST_S:
            self._requested_at = now
            self.counters["weight_full_requests"] += 1
            self.request_full()

    # -- WeightPush ------------------------------------------------------------------------------

    def _apply_pushes(self, pushes: list[WeightPush]) -> None:
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
            elif not self._apply_push(push):
                break

    def _apply_push(self, push: WeightPush) -> bool:
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
        except APPLY_ERRORS as exc:
            self.need_full = self.need_full or push.mode == "delta"
            return self._reject(push, str(exc))
        self.counters["weight_deltas_applied"] += push.mode == "delta"
        self.need_full = False  # the engine holds a version the learner's checksum vouches for
        self._applied(push, started, f"{len(whole)} whole, {len(deltas)} delta tensors")
        return True

    # -- WeightRef ----------------------------------------------------------------------------------

    def _apply_refs(self, refs: list[WeightRef]) -> None:
        fresh = sorted((r for r in refs if r.version > self.engine.version), key=lambda r: r.version)
        if fresh and fresh[-1].transport == "cuda-ipc":  # the newest buffers hold that version whole
            fresh = fresh[-1:]
        self.counters["weight_pushes_ignored"] += len(refs) - len(fresh)
        for ref in fresh:
            started = time.perf_counter()
            try:
                self._check_scheme(ref)
                self._load_ref(ref)
            except APPLY_ERRORS as exc:
                self._reject(ref, str(exc))
                continue
            self._applied(ref, started, f"{len(ref.buckets)} buckets")

    def _load_ref(self, ref: WeightRef) -> None:
        """This replica's CUDA IPC payloads, or the broadcasts that follow an nccl ref."""
        if ref.transport == "nccl":
            self.engine.receive_broadcast(ref.buckets, ref.version)
            return
        tp = self.engine.tp_size
        if ref.ranks < (self.replica + 1) * tp:
            raise ValueError(
                f"cuda-ipc push carries {ref.ranks} per-rank payloads; replica {self.replica} with tp {tp} "
                f"needs ranks {self.replica * tp}..{(self.replica + 1) * tp - 1}"
            )
        self.engine.check_metas(ref.buckets)
        rank_slice = slice(self.replica * tp, (self.replica + 1) * tp)
        self.engine.apply_serialized([p[rank_slice] for p in ref.payloads], ref.version)

    # -- both ---------------------------------------------------------------------------------------

    def _check_scheme(self, message: WeightPush | WeightRef) -> None:
        if message.scheme != self.scheme:
            raise ValueError(f"scheme {message.scheme!r}, this engine holds {self.scheme!r}")

    def _applied(self, message: WeightPush | WeightRef, started: float, what: str) -> None:
        seconds = time.perf_counter() - started
        self.counters["weight_pushes_applied"] += 1
        self.counters["weight_apply_ms"] += round(1000 * seconds)
        kind = message.mode if isinstance(message, WeightPush) else f"{message.transport}"
        log.info("applied %s weights version %d (%s) in %.3f s", kind, message.version, what, seconds)

    def _reject(self, message: WeightPush | WeightRef, why: str) -> bool:
        self.counters["weight_pushes_rejected"] += 1
        kind = message.mode if isinstance(message, WeightPush) else message.transport
        log.error("rejected %s weight push version %d: %s", kind, message.version, " ".join(why.split())[:300])
        return False
