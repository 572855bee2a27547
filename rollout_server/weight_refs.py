"""Weight pushes whose bytes travel outside ZeroMQ (sync.transport cuda-ipc / nccl), applied to an SGLang engine."""

from __future__ import annotations

from typing import Any

from qurl import sglang_payload as payload
from qurl.config import get
from qurl.protocol import WeightRef


def join_update_group(engine: Any, cfg: Any, replica: int) -> None:
    """nccl: join this replica's TP ranks to learner rank 0's group (blocks until every member has joined)."""
    tp = get(cfg, "rollout.tp_size")
    world, offsets = payload.update_group_layout(len(get(cfg, "cluster.rollout_gpus")) // tp, tp)
    if not 0 <= replica < len(offsets):
        raise ValueError(f"replica {replica} is outside the {len(offsets)} replicas of cluster.rollout_gpus")
    host, port = payload.group_address(get(cfg, "sync.group_endpoint"))
    engine.init_update_group(host, port, offsets[replica], world)


def apply_ref(engine: Any, ref: WeightRef, replica: int) -> None:
    """Load the push `ref` describes: this replica's CUDA IPC payloads, or the broadcasts that follow it."""
    if ref.transport == "nccl":
        engine.receive_broadcast(ref.buckets, ref.version)
        return
    tp = engine.tp_size
    if ref.ranks < (replica + 1) * tp:
        raise ValueError(
            f"cuda-ipc push carries {ref.ranks} per-rank payloads; replica {replica} with tp {tp} "
            f"needs ranks {replica * tp}..{(replica + 1) * tp - 1}"
        )
    engine.check_metas(ref.buckets)
    engine.apply_serialized([p[replica * tp : (replica + 1) * tp] for p in ref.payloads], ref.version)
