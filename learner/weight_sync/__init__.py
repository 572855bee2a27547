"""The weight push on the learner, one owner (sync.py: WeightSync) over one transport per file (zmq, cuda-ipc,
nccl) and the tensors the engine loads (tensors.py); build() picks the transport sync.transport names."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from learner.servers import ServerRegistry
from learner.weight_sync.ipc_transport import IpcTransport
from learner.weight_sync.nccl_transport import NcclTransport
from learner.weight_sync.sync import WeightSync
from learner.weight_sync.zmq_transport import ZmqTransport
from qurl.wire.transport import Sender


def build(cfg: DictConfig, pub: Sender, servers: ServerRegistry, scheme: str, device: torch.device) -> WeightSync:
    """The weight sync over the transport sync.transport names; nccl also joins the update group (blocks until the
    replicas join, at most sync.group_timeout_s)."""
    kind = cfg.sync.transport
    if kind == "zmq":
        transport = ZmqTransport(pub)
    else:
        tp = cfg.rollout.tp_size
        replicas = len(cfg.cluster.rollout_gpus) // tp
        if kind == "cuda-ipc":
            transport = IpcTransport(pub, scheme, device, replicas * tp, servers)
        else:
            transport = NcclTransport(
                pub,
                scheme,
                device,
                cfg.sync.group_endpoint,
                replicas,
                tp,
                timeout_s=cfg.sync.group_timeout_s,
                in_flight=cfg.sync.buckets_in_flight,
            )
            transport.open()
    return WeightSync(transport, servers, scheme, full_every=cfg.sync.full_every)
