"""sync.transport=cuda-ipc (SGLang replicas on this node): the buckets live in CUDA buffers on rank 0's GPU, rewritten
in place, and a WeightRef carries per-rank handles to them (serialize_named of views into the buffers).

Two sets of buffers alternate, so push N+1 never touches the bytes of push N; before a set is rewritten (push N+2
over N) every live server must report version N applied. One that has not within `ack_timeout_s` would still read
those bytes and label N+2's weights as N, so that push is skipped instead (the servers keep N+1, the next push tries
again), and at once when a server behind says it is evaluating. The sets are allocated at the first push and never
freed, so torch's IPC refcounts never matter: two whole pushes of GPU memory for the run (17 GB at 7B FP8), the price
of letting servers load while the learner trains on.
"""

from __future__ import annotations

import logging

import torch

from learner.servers import ServerRegistry
from qurl.wire import sglang_payload as payload
from qurl.wire.protocol import WeightRef
from qurl.wire.transport import Sender

log = logging.getLogger("learner")

IPC_ACK_TIMEOUT_S = 300.0  # how long a push waits for servers still loading the push before last


class IpcTransport:
    """WeightRefs of CUDA IPC handles; the servers call SGLangEngine.apply_serialized."""

    deltas = False
    resendable = True  # a lagging server can open the current handles again

    def __init__(
        self,
        pub: Sender,
        scheme: str,
        device: torch.device,
        ranks: int,
        servers: ServerRegistry,
        bucket_bytes: int = payload.UPDATE_BUCKET_BYTES,
        ack_timeout_s: float = IPC_ACK_TIMEOUT_S,
    ) -> None:
        self.pub, self.scheme, self.device, self.ranks, self.servers = pub, scheme, device, ranks, servers
        self.bucket_bytes, self.ack_timeout_s = bucket_bytes, ack_timeout_s
        self.metas: list | None = None
        self.sets: list[list[torch.Tensor]] = []  # two sets of per-bucket uint8 buffers
        self.versions: list[int | None] = [None, None]  # the version each set holds
        self.skipped = 0

    def send(self, version: int, tensors: dict[str, torch.Tensor]) -> WeightRef | None:
        """Write `version` into the set not holding the newer version and send its ref; None when skipped."""
        buckets = payload.buckets(payload.named_tensors(tensors, self.scheme), self.bucket_bytes)
        metas = [payload.bucket_meta(b) for b in buckets]
        if self.metas is None:
            self.metas = metas
            self.sets = [
                [
                    torch.empty(sum(t.numel() * t.element_size() for _, t in b), dtype=torch.uint8, device=self.device)
                    for b in buckets
                ]
                for _ in range(2)
            ]
        elif metas != self.metas:
            raise ValueError("sync.transport=cuda-ipc: a push changed the tensors' names, dtypes or shapes")
        target = (
            0
            if self.versions[0] is None or (self.versions[1] is not None and self.versions[0] < self.versions[1])
            else 1
        )
        held = self.versions[target]
        if held is not None:
            # a server that evaluates takes no weights until it is done (minutes): skip at once rather than hold
            # every rank for the ack timeout; otherwise wait for the servers still loading
            evaluating = [sid for sid in self.servers.behind(held) if self.servers[sid].evaluating]
            behind = evaluating or self.servers.wait_applied(held, self.ack_timeout_s)
            if behind:
                self.skipped += 1
                log.warning(
                    "cuda-ipc push %d skipped: %s did not report version %d applied within %.0f s and may "
                    "still read its buffers",
                    version,
                    ", ".join(behind),
                    held,
                    self.ack_timeout_s,
                )
                return None
        buffers = self.sets[target]
        for flat, bucket in zip(buffers, buckets):
            flat.copy_(payload.flatten(bucket))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the bytes are in place before any server can read them
        self.versions[target] = version
        payloads = [
            payload.serialize_named(payload.views(flat, meta), self.ranks) for flat, meta in zip(buffers, metas)
        ]
        ref = WeightRef(version=version, scheme=self.scheme, transport="cuda-ipc", buckets=metas, payloads=payloads)
        self.pub.send(ref)
        return ref
