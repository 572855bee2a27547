"""The control plane (rank 0): the rollout servers' hello / heartbeat / bye on the ROUTER socket, the server registry
(learner/servers.py), the staleness budget's grants and evaluation routing.

It answers each server with the version the weight sync holds (`weights.version`) and the server's grant, and hands
every hello, heartbeat and request to the weight sync (`weights.on_status`), which may resend the current version
to that server alone, over this socket. The control channel is served by a thread so that heartbeats are answered
during long train steps; its socket is used under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from learner.budget import SERVER_GONE_S, Budget
from learner.servers import ServerInfo, ServerRegistry
from qurl.outputs import books
from qurl.wire.protocol import Status
from qurl.wire.transport import Receiver, Sender

log = logging.getLogger("learner")

POLL_MS = 100


class ControlPlane:
    """Answers hello / heartbeat with (version, the server's grant), routes evaluations, reports to the weight sync."""

    def __init__(
        self, control: Receiver, control_tx: Sender, budget: Budget, servers: ServerRegistry, weights: Any
    ) -> None:
        self.control = control
        self.control_tx = control_tx
        self.budget = budget  # the global staleness budget, granted per server
        self.servers = servers
        self.weights = weights  # learner/weight_sync: .version, .on_status(kind, info, now, send_to)
        self.reports: dict[str, dict] = {}  # server id -> its last book counters (qurl.outputs.books), kept after bye
        self.life = 1  # the learner life (1 + resumes) the reports are stamped with
        self._eval_wanted: int | None = None  # handed to the next server that checks in
        self._eval_holder: tuple[str, int] | None = None  # (server id, version) asked and not answered yet
        self._eval_results: list[tuple[int, dict]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="qurl-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def request_eval(self, version: int) -> None:
        """Ask one rollout server to evaluate `version` (or newer) with its quantized engine."""
        with self._lock:
            self._eval_wanted = version

    def servers_idle(self) -> bool:
        """No server has work: no evaluation asked or unanswered, and nothing for it to generate (Budget.idle)."""
        with self._lock:
            if self._eval_wanted is not None or self._eval_holder is not None:
                return False
        return self.budget.idle(self.weights.version)

    def take_eval_results(self) -> list[tuple[int, dict]]:
        """(version, counters with `acc`) of every eval_result received since the last call."""
        with self._lock:
            out, self._eval_results = self._eval_results, []
        return out

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.control.recv_routed(timeout_ms=POLL_MS)
            except zmq.ZMQError:  # the context was closed under us at shutdown
                return
            for sid in self.budget.expire(time.monotonic()):
                log.warning(
                    "rollout server %s silent for %.0f s: presumed gone, its budget returned", sid, SERVER_GONE_S
                )
                self._requeue_eval(sid)
            if got is None:
                continue
            ident, msg = got
            if isinstance(msg, Status):
                self._answer(ident, msg)

    def _requeue_eval(self, server_id: str) -> None:
        """A server died or left before answering its eval request: the next server to check in gets it."""
        with self._lock:
            if self._eval_holder is None or self._eval_holder[0] != server_id:
                return
            version, self._eval_holder = self._eval_holder[1], None
            if self._eval_wanted is None or self._eval_wanted < version:
                self._eval_wanted = version
        log.warning("rollout server %s left before evaluating version %d: asking the next one", server_id, version)

    def _send_to(self, ident: bytes, msg: object) -> bool:
        """One message to one server; False when its queue is full (it is gone or not reading)."""
        with self._lock:
            try:
                self.control_tx.send(msg, to=ident, flags=zmq.NOBLOCK)
            except zmq.Again:
                return False
        return True

    def _answer(self, ident: bytes, msg: Status) -> None:
        now = time.monotonic()
        if msg.type in ("hello", "heartbeat", "bye"):
            self.reports[msg.server_id] = books.report(msg.counters, final=msg.type == "bye", life=self.life)
        if msg.type == "bye":
            self.servers.pop(msg.server_id, None)
            self.budget.bye(msg.server_id, msg.counters)
            log.info("rollout server %s says bye", msg.server_id)
            self._requeue_eval(msg.server_id)
            return
        if msg.type == "eval_result":
            with self._lock:
                self._eval_results.append((msg.version, dict(msg.counters)))
                if self._eval_holder is not None and self._eval_holder[0] == msg.server_id:
                    self._eval_holder = None
            return
        if msg.type not in ("hello", "heartbeat", "resend_weights", "resend_status"):
            return
        info = self.servers.get(msg.server_id)
        if info is None:
            info = self.servers[msg.server_id] = ServerInfo(msg.version, msg.running, msg.queued, now)
            log.info(
                "rollout server %s says %s (engine %s, quant %s, version %d)",
                msg.server_id,
                msg.type,
                msg.engine,
                msg.quant,
                msg.version,
            )
        if msg.type == "hello" and msg.counters.get("replaces_pid"):  # a restart: the old process is gone
            dead = f"{msg.server_id.rsplit('-', 1)[0]}-{int(msg.counters['replaces_pid'])}"
            self.servers.pop(dead, None)
            if self.budget.release(dead):
                log.info("rollout server %s replaces %s: its budget share is returned", msg.server_id, dead)
            self._requeue_eval(dead)
        if msg.type != "resend_weights":
            info.version, info.running, info.queued, info.seen = msg.version, msg.running, msg.queued, now
            info.counters = dict(msg.counters)
        version = self.weights.version
        grant = self.budget.grant(msg.server_id, version, info.version, info.counters, now)
        self._send_to(ident, Status(type="reply", server_id=msg.server_id, version=version, budget=grant))
        with self._lock:
            wanted = self._eval_wanted if msg.type in ("hello", "heartbeat") else None
        if wanted is not None and self._send_to(
            ident, Status(type="eval_request", server_id=msg.server_id, version=wanted)
        ):
            with self._lock:
                self._eval_holder, self._eval_wanted = (msg.server_id, wanted), None
        self.weights.on_status(msg.type, info, now, lambda weights: self._send_to(ident, weights))
