"""Which process qurl-async starts on which GPUs: a pure plan, checked before anything starts.

CPU: one learner (it spawns cluster.learner_ranks ranks itself) and cluster.rollout_servers servers.
GPUs: the learner sees exactly cluster.learner_gpus (CUDA_VISIBLE_DEVICES; its ranks take LOCAL_RANK's GPU and
NCCL). rollout.engine=sglang: one server per replica (len(cluster.rollout_gpus) // rollout.tp_size), told its
index by QURL_SERVER_INDEX; SGLang places its TP ranks itself (base_gpu_id), so a server keeps the launcher's
GPU numbering. The embedded torch engine gets its slice of cluster.rollout_gpus as CUDA_VISIBLE_DEVICES.
GPU indices are as the launcher sees them (through its own CUDA_VISIBLE_DEVICES, if set).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qurl.config import ConfigError, get

SERVER_INDEX_ENV = "QURL_SERVER_INDEX"
REPLACES_ENV = "QURL_REPLACES_PID"  # set on a restarted server: its dead predecessor's pid (its budget returns at once)
HEARTBEAT_ENV = "QURL_HEARTBEAT_FILE"  # touched by a server's loop every heartbeat; qurl-async's watchdog reads it
LEND_CORES_ENV = "QURL_LEND_CORES"  # the CPU learner's: every core, taken while its servers wait (core_lending.py)


@dataclass
class ProcessPlan:
    """One child of qurl-async: its console script, what it adds to the environment, and its GPUs."""

    name: str
    program: str
    env: dict[str, str] = field(default_factory=dict)
    gpus: list[int] = field(default_factory=list)


def plan(cfg: Any, available_gpus: int | None = None, visible: list[str] | None = None) -> list[ProcessPlan]:
    """The learner, then the rollout servers; ConfigError (one line) for a layout that cannot run.

    available_gpus: GPUs this node has (None: not checked); visible: the launcher's own CUDA_VISIBLE_DEVICES.
    """
    learner_gpus, rollout_gpus = list(get(cfg, "cluster.learner_gpus")), list(get(cfg, "cluster.rollout_gpus"))
    engine, tp = get(cfg, "rollout.engine"), get(cfg, "rollout.tp_size")
    _check_gpus(cfg, learner_gpus, rollout_gpus, available_gpus, visible)

    def devices(gpus: list[int]) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(visible[g] if visible else str(g) for g in gpus)}

    learner = ProcessPlan("learner", "qurl-learner", devices(learner_gpus) if learner_gpus else {}, learner_gpus)
    if engine == "sglang" and (learner_gpus or rollout_gpus):
        if not rollout_gpus:
            raise ConfigError("rollout.engine=sglang needs cluster.rollout_gpus (the GPUs of its replicas)")
        if len(rollout_gpus) % tp:
            raise ConfigError(
                f"cluster.rollout_gpus has {len(rollout_gpus)} GPUs, not a multiple of rollout.tp_size={tp}"
            )
        replicas = len(rollout_gpus) // tp
        if get(cfg, "cluster.rollout_servers") != replicas:
            raise ConfigError(
                f"cluster.rollout_servers={get(cfg, 'cluster.rollout_servers')}, but rollout.engine=sglang "
                f"runs one server per replica: len(cluster.rollout_gpus) // rollout.tp_size = {replicas}"
            )
        servers = [
            ProcessPlan(
                f"rollout-{i}", "qurl-rollout-server", {SERVER_INDEX_ENV: str(i)}, rollout_gpus[i * tp : (i + 1) * tp]
            )
            for i in range(replicas)
        ]
        return [learner, *servers]
    n = get(cfg, "cluster.rollout_servers")
    if tp != 1:
        raise ConfigError(f"rollout.tp_size={tp} needs rollout.engine=sglang; the torch engine runs on one device")
    per_server = max(1, len(rollout_gpus) // n) if rollout_gpus else 0
    servers = []
    for i in range(n):
        gpus = rollout_gpus[i * per_server : (i + 1) * per_server]
        env = {SERVER_INDEX_ENV: str(i), **(devices(gpus) if gpus else {})}
        servers.append(ProcessPlan(f"rollout-{i}", "qurl-rollout-server", env, gpus))
    return [learner, *servers]


def _check_gpus(
    cfg: Any, learner_gpus: list[int], rollout_gpus: list[int], available: int | None, visible: list[str] | None
) -> None:
    for key, gpus in (("cluster.learner_gpus", learner_gpus), ("cluster.rollout_gpus", rollout_gpus)):
        repeated = sorted({g for g in gpus if gpus.count(g) > 1})
        if repeated:
            raise ConfigError(f"{key}={gpus} lists GPU {repeated[0]} twice")
        count = len(visible) if visible else available
        if any(g < 0 for g in gpus) or (count is not None and any(g >= count for g in gpus)):
            bad = next(g for g in gpus if g < 0 or g >= (count or 0))
            raise ConfigError(f"{key}={gpus} names GPU {bad}, but this node has {count} GPUs (0..{(count or 1) - 1})")
    ranks = get(cfg, "cluster.learner_ranks")
    if learner_gpus and len(learner_gpus) != ranks:
        raise ConfigError(
            f"cluster.learner_gpus lists {len(learner_gpus)} GPUs for cluster.learner_ranks={ranks}; "
            "give one GPU per rank"
        )
    shared = sorted(set(learner_gpus) & set(rollout_gpus))
    if shared:
        if get(cfg, "sync.transport") != "cuda-ipc":
            raise ConfigError(
                f"cluster.learner_gpus and cluster.rollout_gpus share GPUs {shared}; give them "
                "disjoint GPUs, or colocate with sync.transport=cuda-ipc and rollout.mem_fraction"
            )
        if get(cfg, "rollout.mem_fraction") is None:
            raise ConfigError(
                f"colocated on GPUs {shared}: set rollout.mem_fraction (e.g. 0.4) so that SGLang "
                "leaves memory for the learner"
            )
