"""sync.transport=nccl (SGLang replicas on other GPUs): learner rank 0 and every replica's TP ranks join one process
group at start; a push sends a WeightRef with the bucket metadata on PUB, then broadcasts each bucket flattened.

Every replica takes part in every broadcast, so versions go out strictly in order: a push's broadcasts run in a
thread of their own (training goes on) and the next push starts only when they have all been taken; the servers
apply refs in version order too (rollout_server/weight_receiver.py). At most `in_flight` buckets are queued on rank
0's device at once (each a flattened copy, UPDATE_BUCKET_BYTES): the oldest broadcast completes before another is
queued, so the transport holds in_flight x 256 MB (512 MB by default), not the whole push (8.7 GB at 7B FP8).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch
import torch.distributed as dist

from qurl.wire import sglang_payload as payload
from qurl.wire.protocol import WeightRef
from qurl.wire.transport import Sender

log = logging.getLogger("learner")


class NcclTransport:
    """A WeightRef, then one broadcast per bucket; the servers call SGLangEngine.receive_broadcast."""

    deltas = False
    resendable = False  # a broadcast cannot be replayed to one replica

    def __init__(
        self,
        pub: Sender,
        scheme: str,
        device: torch.device,
        endpoint: str,
        replicas: int,
        tp_size: int,
        bucket_bytes: int = payload.UPDATE_BUCKET_BYTES,
        timeout_s: float = 3600.0,
        in_flight: int = 2,
    ) -> None:
        self.pub, self.scheme, self.device, self.bucket_bytes = pub, scheme, device, bucket_bytes
        self.timeout_s, self.in_flight = timeout_s, in_flight
        self.address = payload.group_address(endpoint)
        self.world, _ = payload.update_group_layout(replicas, tp_size)
        self.group = None
        self.peak_queued = 0  # the most buckets this transport held queued at once
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    def open(self) -> None:
        """Join the update group as rank 0; returns once every replica's TP ranks have joined too."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        log.info(
            "waiting up to %.0f s for %d rollout ranks to join the %s weight group at %s:%d",
            self.timeout_s,
            self.world - 1,
            backend,
            *self.address,
        )
        self.group = payload.open_update_group(
            *self.address, self.world, payload.GROUP_NAME, backend, timeout_s=self.timeout_s
        )

    def send(self, version: int, tensors: dict[str, torch.Tensor]) -> WeightRef:
        """Send `version`'s ref, then its broadcasts from a thread of their own, so that training goes on while the
        servers drain them; the push before finishes first (every replica takes the versions in order)."""
        if self.group is None:
            raise RuntimeError("NcclTransport.open() must run before the first push")
        self.drain()
        buckets = payload.buckets(payload.named_tensors(tensors, self.scheme), self.bucket_bytes)
        ref = WeightRef(
            version=version, scheme=self.scheme, transport="nccl", buckets=[payload.bucket_meta(b) for b in buckets]
        )
        self.pub.send(ref)
        self._thread = threading.Thread(target=self._broadcast, args=(buckets,), name="qurl-nccl-push", daemon=True)
        self._thread.start()
        return ref

    def drain(self) -> None:
        """Wait until the last push's broadcasts have all been taken (raise what they raised)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _broadcast(self, buckets: list) -> None:
        """One broadcast per bucket, at most in_flight queued on the device: the oldest completes before another."""
        queued: deque = deque()
        try:
            for bucket in buckets:
                if len(queued) >= self.in_flight:
                    self._complete(queued.popleft())
                flat = payload.flatten(bucket).to(self.device)
                queued.append((dist.broadcast(flat, src=0, group=self.group, async_op=True), flat))
                self.peak_queued = max(self.peak_queued, len(queued))
            while queued:
                self._complete(queued.popleft())
        except Exception as exc:  # noqa: BLE001  (raised on the main thread by the next push or drain)
            self._error = exc

    def _complete(self, item: tuple) -> None:
        """The broadcast has reached every replica and its buffer may go (NCCL's wait orders streams only: sync)."""
        work, _ = item
        work.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
