"""The publisher's last leg: how rank 0's weight push reaches the rollout engines (config `sync.transport`).

zmq: quantized tensors in a WeightPush over the PUB socket (any engine, CPU or GPU). cuda-ipc (SGLang replicas on
this node): the buckets live in CUDA buffers on rank 0's GPU, allocated at the first push and rewritten in place,
and a WeightRef carries per-rank handles (serialize_named of views into them). Two sets alternate and are never
freed, so torch's IPC refcounts never matter; a set is rewritten only once every live server reports the version it
holds applied, else that push is skipped. nccl (SGLang replicas on other GPUs): rank 0 and every replica's TP
ranks join one process group at start; a push sends a WeightRef with the bucket metadata, then broadcasts each
bucket flattened.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from omegaconf import DictConfig

from learner.weight_sender import PushStats, WeightSender
from qurl import sglang_payload as payload
from qurl.protocol import WeightRef

log = logging.getLogger("learner")

IPC_ACK_TIMEOUT_S = 300.0  # how long a cuda-ipc push waits for servers still loading the previous one


class ZmqPush:
    """Tensors over ZeroMQ: the servers call engine.update_weights."""

    def __init__(self, sender: WeightSender) -> None:
        self.sender = sender

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> PushStats:
        return self.sender.publish(version, tensors)


class IpcPush:
    """CUDA IPC handles to persistent buckets on this GPU: the servers call SGLangEngine.apply_serialized.

    Two sets of buffers alternate, so push N+1 never touches the bytes of push N. Before a set is rewritten
    (push N+2 over N) every live server must report version N applied; one that has not within ack_timeout_s
    would still read those bytes and label N+2's weights as N, so that push is skipped instead (the servers keep
    N+1, the next push tries again).
    """

    def __init__(
        self,
        sender: WeightSender,
        scheme: str,
        device: torch.device,
        ranks: int,
        bucket_bytes: int = payload.UPDATE_BUCKET_BYTES,
        ack_timeout_s: float = IPC_ACK_TIMEOUT_S,
    ) -> None:
        self.sender, self.scheme, self.device, self.ranks = sender, scheme, device, ranks
        self.bucket_bytes, self.ack_timeout_s = bucket_bytes, ack_timeout_s
        self.metas: list | None = None
        self.sets: list[list[torch.Tensor]] = []  # two sets of per-bucket uint8 buffers
        self.versions: list[int | None] = [None, None]  # the version each set holds
        self.skipped = 0

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> PushStats | None:
        """Announce `version`; None when it was skipped because a server still reads the set it would overwrite."""
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
            behind = self.sender.plane.wait_applied(held, self.ack_timeout_s)
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
        return self.sender.announce(version, ref, tensors, repush=True)


class NcclPush:
    """One broadcast per bucket from rank 0 to every replica: the servers call SGLangEngine.receive_broadcast."""

    def __init__(
        self,
        sender: WeightSender,
        scheme: str,
        device: torch.device,
        endpoint: str,
        replicas: int,
        tp_size: int,
        bucket_bytes: int = payload.UPDATE_BUCKET_BYTES,
        timeout_s: float = 3600.0,
    ) -> None:
        self.sender, self.scheme, self.device, self.bucket_bytes = sender, scheme, device, bucket_bytes
        self.timeout_s = timeout_s
        self.address = payload.group_address(endpoint)
        self.world, _ = payload.update_group_layout(replicas, tp_size)
        self.group = None

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

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> PushStats:
        if self.group is None:
            raise RuntimeError("NcclPush.open() must run before the first push")
        buckets = payload.buckets(payload.named_tensors(tensors, self.scheme), self.bucket_bytes)
        ref = WeightRef(
            version=version, scheme=self.scheme, transport="nccl", buckets=[payload.bucket_meta(b) for b in buckets]
        )
        stats = self.sender.announce(version, ref, tensors, repush=False)
        started = time.perf_counter()
        payload.broadcast_buckets(buckets, self.group, self.device)
        return dataclasses.replace(stats, seconds=stats.seconds + time.perf_counter() - started)


def build(cfg: DictConfig, sender: WeightSender, scheme: str, device: torch.device):
    """The transport sync.transport names; nccl also joins the update group (blocks until the replicas join)."""
    kind = cfg.sync.transport
    if kind == "zmq":
        return ZmqPush(sender)
    tp = cfg.rollout.tp_size
    replicas = len(cfg.cluster.rollout_gpus) // tp
    if kind == "cuda-ipc":
        return IpcPush(sender, scheme, device, replicas * tp)
    push = NcclPush(sender, scheme, device, cfg.sync.group_endpoint, replicas, tp, timeout_s=cfg.sync.group_timeout_s)
    push.open()
    return push
