"""The rank-0 hub (design.md §3, step 2, and §5): the learner's three bound sockets, the trajectory buffer, and
the broadcast that hands every rank the same batch.

Rank 0 alone owns the sockets (trajectory PULL, weight PUB, control ROUTER); the buffer receives on a thread,
rank 0 takes batches from it between the collectives that keep every rank in step, broadcasts each batch as
tensors, and describes the batch for the metrics (`batch_info`). The other ranks take part in the collectives only.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
import zmq
from omegaconf import DictConfig

from learner.batch import Batch, collate, min_version
from learner.budget import Budget
from learner.buffer import TrajectoryBuffer
from learner.control_plane import ControlPlane
from learner.errors import StartError, first_line
from learner.policy_step import DistEnv
from learner.reward_health import RewardHealth
from learner.servers import ServerRegistry
from learner.weight_sync import WeightSync
from qurl.wire import transport
from qurl.wire.protocol import CONTROL_MAX_BYTES, TRAJECTORY_MAX_BYTES

log = logging.getLogger("learner")

WAIT_TICK_MS = 500  # rank 0 waits this long for a batch between the collectives that keep every rank in step
CLOSE_LINGER_MS = 2000  # at exit, give the last weight push and replies this long to leave
WAIT, BATCH = 0, 1


class Hub:
    """Batches in (`next_batch`, a collective on every rank); on rank 0 also the sockets, the buffer and the
    control plane, once `open` has bound them."""

    def __init__(
        self,
        env: DistEnv,
        pad_id: int,
        batch_prompts: int,
        async_cfg: DictConfig,
        log_interval_s: float,
        rewards: RewardHealth,
    ) -> None:
        self.env, self.pad_id, self.batch_prompts = env, pad_id, batch_prompts
        self.async_cfg, self.log_interval_s = async_cfg, log_interval_s
        self.is_main = env.rank == 0
        self.timed_out = False  # no group arrived for async.wait_timeout_s
        self.rewards = rewards  # rank 0: the share of failed scores
        self.reward_problem: str | None = None  # rank 0: why the rewards stop the run (all ranks stop on it)
        self.stopped_for_rewards = False
        self.ctx: zmq.Context | None = None
        self.buffer: TrajectoryBuffer | None = None
        self.servers = ServerRegistry()
        self.plane: ControlPlane | None = None
        self._tokens_mark = 0

    def open(
        self,
        transport_cfg: DictConfig,
        dynamic_sampling: bool,
        vocab_size: int,
        make_weights: Callable[[transport.Sender, ServerRegistry], WeightSync],
    ) -> WeightSync:
        """Rank 0 binds PULL (trajectories), PUB (weights) and ROUTER (control); `auto` picks free loopback ports.
        make_weights(pub, servers) builds the weight sync over the PUB socket; the control plane reports to it."""
        secret = transport_cfg.secret.encode() if transport_cfg.secret else None
        self.ctx = zmq.Context()
        socks = {}
        for name, kind, max_bytes, hwm in (
            ("trajectories", zmq.PULL, TRAJECTORY_MAX_BYTES, 1000),
            ("weights", zmq.PUB, CONTROL_MAX_BYTES, 4),
            ("control", zmq.ROUTER, CONTROL_MAX_BYTES, 1000),
        ):
            endpoint = transport_cfg[name]
            if endpoint == "auto":
                endpoint = "tcp://127.0.0.1:*"
            try:
                socks[name] = transport.bind(self.ctx, kind, endpoint, secret=secret, max_bytes=max_bytes, hwm=hwm)
            except (zmq.ZMQError, ValueError) as exc:
                raise StartError(f"transport.{name}={transport_cfg[name]!r}: cannot bind: {first_line(exc)}") from None
            log.info("transport.%s bound at %s", name, socks[name].getsockopt(zmq.LAST_ENDPOINT).decode())
        sender_id = f"learner-{os.getpid()}"
        receiver = transport.Receiver(
            socks["trajectories"], secret=secret, max_bytes=TRAJECTORY_MAX_BYTES, kinds=("trajectory_group",)
        )
        max_staleness = self.async_cfg.max_staleness
        self.buffer = TrajectoryBuffer(
            receiver,
            batch_prompts=self.batch_prompts,
            max_staleness=max_staleness,
            dynamic_sampling=dynamic_sampling,
            vocab_size=vocab_size,
        )
        weights = make_weights(transport.Sender(socks["weights"], sender_id, secret=secret), self.servers)
        self.plane = ControlPlane(
            transport.Receiver(socks["control"], secret=secret, max_bytes=CONTROL_MAX_BYTES, kinds=("status",)),
            transport.Sender(socks["control"], sender_id, secret=secret),
            Budget(max_staleness, self.batch_prompts, self.buffer.snapshot),
            self.servers,
            weights,
        )
        return weights

    def restore(self, buffer_state: dict, reports: dict) -> None:
        """Rank 0, on resume: the buffer's counters and the servers' last reports as the checkpoint holds them."""
        self.buffer.restore(buffer_state)
        self.plane.reports = dict(reports)
        self.plane.life = self.buffer.life
        self._tokens_mark = self.buffer.response_tokens

    def ledger(self) -> dict:
        """Rank 0's side of the run's books (qurl.outputs.books): buffer and wire counters, servers' last reports."""
        return {"buffer": self.buffer.counters(), "reports": dict(self.plane.reports)}

    def next_batch(self, version: int, stop_requested: Callable[[], bool]) -> tuple[Batch | None, dict]:
        """Collective: the next batch on every rank, or None when a stop was asked for on any rank."""
        waited_from = last_line = time.monotonic()
        timeout = self.async_cfg.wait_timeout_s
        while True:
            idle = time.monotonic() - max(waited_from, self.buffer.last_arrival) if self.is_main else 0.0
            stop = torch.tensor(
                [int(stop_requested()), int(bool(timeout) and idle > timeout), int(self.reward_problem is not None)]
            )
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.any():
                self.timed_out, self.stopped_for_rewards = bool(stop[1].item()), bool(stop[2].item())
                return None, {}
            groups, header = None, torch.zeros(3, dtype=torch.int64)
            if self.is_main:
                groups = self.buffer.take(version, wait_ms=WAIT_TICK_MS)
                if groups is not None:
                    batch = collate(groups, self.pad_id)
                    header = torch.tensor([BATCH, *batch.input_ids.shape])
                elif time.monotonic() - last_line >= self.log_interval_s:
                    last_line = time.monotonic()
                    dropped = self.buffer.dropped
                    log.info(
                        "waiting for trajectories (%.0f s): have %d/%d groups, received %d, dropped %d stale, "
                        "%d filtered, %d invalid; servers: %s",
                        last_line - waited_from,
                        len(self.buffer.groups),
                        self.batch_prompts,
                        self.buffer.received,
                        dropped["stale"],
                        dropped["filter"],
                        dropped["invalid"],
                        self.servers.status_line(),
                    )
            dist.broadcast(header, src=0)
            if header[0].item() == WAIT:
                continue
            n, length = int(header[1]), int(header[2])
            if not self.is_main:
                batch = Batch(
                    torch.empty(n, length, dtype=torch.int64),
                    torch.empty(n, dtype=torch.int64),
                    torch.empty(n, dtype=torch.int64),
                    torch.empty(n, length, dtype=torch.float32),
                    torch.empty(n, dtype=torch.float32),
                    torch.empty(n, dtype=torch.int64),
                )
            for t in (batch.input_ids, batch.prompt_len, batch.total_len, batch.behav_logp, batch.rewards, batch.group):
                dist.broadcast(t, src=0)
            info = self.batch_info(groups, version, time.monotonic() - waited_from) if self.is_main else {}
            return batch, info

    def step_done(self, version: int) -> None:
        """Rank 0: a step ended with weights `version`; servers holding them may fill its room (learner/budget.py)."""
        if self.is_main:
            self.buffer.step_done(version)

    def batch_info(self, groups: list, version: int, waited_s: float) -> dict:
        """Rank 0's view of the batch: rewards, staleness, lengths, reward statuses, buffer and server counters."""
        rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
        stale = torch.tensor([version - min_version(g) for g in groups], dtype=torch.float64)
        lengths = torch.tensor([len(s.token_ids) for g in groups for s in g.samples], dtype=torch.float64)
        details = [s.reward_details for g in groups for s in g.samples]
        statuses = Counter(str(d.get("status", "ok")) for d in details)
        first_failure = self.rewards.observe(details)
        self.reward_problem = self.rewards.problem()
        with_signal = sum(len({s.reward for s in g.samples}) > 1 for g in groups)  # all-equal groups: advantage 0
        info = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(unbiased=False).item(),
            "reward/groups_with_signal": with_signal,
            "staleness/mean": stale.mean().item(),
            "staleness/max": stale.max().item(),
            "rollout/response_len_mean": lengths.mean().item(),
            "time/wait_s": waited_s,
            "buffer/size": len(self.buffer.groups),
            "buffer/received": self.buffer.received,
            "buffer/dropped_stale": self.buffer.dropped["stale"],
            "buffer/dropped_filter": self.buffer.dropped["filter"],
            "buffer/dropped_invalid": self.buffer.dropped["invalid"],
            "buffer/bad_messages": sum(self.buffer.receiver.rejected.values()),
            **self.plane.budget.take_window(),
        }
        info.update({f"reward/status_{k}": v for k, v in statuses.items()})
        if first_failure is not None:  # once: the console's warning quotes it
            info["reward/first_failure"] = first_failure
        server_totals: Counter = Counter()
        for server in list(self.servers.values()):
            server_totals.update({k: v for k, v in server.counters.items() if isinstance(v, (int, float))})
        info.update({f"servers/{k}": v for k, v in server_totals.items()})
        return info

    def rollout_rates(self, wall_s: float) -> dict:
        """Response tokens received since the last call, and their rate over `wall_s`."""
        tokens = self.buffer.response_tokens - self._tokens_mark
        self._tokens_mark = self.buffer.response_tokens
        return {"rollout/tokens": tokens, "rollout/tokens_per_s": tokens / max(wall_s, 1e-9)}

    def start(self) -> None:
        """Rank 0, once the resume point is restored: serve the control channel and receive groups, each on a thread."""
        self.plane.start()
        self.buffer.start()

    def close(self) -> None:
        if self.plane is not None:
            self.plane.close()
        if self.buffer is not None:
            self.buffer.close()
        if self.ctx is not None:
            self.ctx.destroy(linger=CLOSE_LINGER_MS)
