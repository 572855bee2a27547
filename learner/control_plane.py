"""The control plane (rank 0): the rollout servers' hello / heartbeat / bye on the ROUTER socket, the server
registry, the staleness budget's grants, evaluation routing, and the repush policy that keeps every server, late
or restarted, on the current weights.

A server that lags, restarts or finds a checksum mismatch asks (or is seen to lag) and gets the whole current
version again (learner/weight_sender.py builds what goes out). The control channel is served by a thread so that
heartbeats are answered during long train steps; the PUB socket is shared with it under a lock (a lock is the
full memory barrier zmq asks for).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import zmq

from learner.budget import SERVER_GONE_S, Budget
from qurl import books
from qurl.protocol import Status, WeightPush, WeightRef
from qurl.transport import Receiver, Sender

log = logging.getLogger("learner")

REPUSH_INTERVAL_S = 2.0  # a lagging server gets the current weights again at most this often
LAG_GRACE_S = 5.0  # a heartbeat may lag this long after a push (in flight, being applied) before a full repush
POLL_MS = 100


@dataclass
class ServerInfo:
    """What the last hello / heartbeat of one server said."""

    version: int
    running: int
    queued: int
    seen: float
    counters: dict = field(default_factory=dict)
    repushed_at: float = -float("inf")


class ControlPlane:
    """Answers hello / heartbeat with (version, the server's grant), routes evaluations, repushes to laggards."""

    def __init__(self, pub: Sender, control: Receiver, control_tx: Sender, budget: Budget, version: int = 0) -> None:
        self.pub = pub
        self.control = control
        self.control_tx = control_tx
        self.budget = budget  # the global staleness budget, granted per server
        self.version = version
        self.servers: dict[str, ServerInfo] = {}
        self.reports: dict[str, dict] = {}  # server id -> its last book counters (qurl.books), kept after its bye
        self.life = 1  # the learner life (1 + resumes) the reports are stamped with
        self.pushes = 0
        self.repushes = 0
        # the current version, whole (or its cuda-ipc WeightRef): what lagging servers get; None: nothing to re-send
        self._full: WeightPush | WeightRef | None = None
        self._built_at = -float("inf")  # monotonic time the current version was built
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

    def adopt(self, version: int, current: WeightPush | WeightRef | None) -> None:
        """`version` is the learner's now; `current` (its whole push, None: nothing) is what lagging servers get."""
        with self._lock:
            self._full, self.version, self._built_at = current, version, time.monotonic()

    def send(self, msg: WeightPush | WeightRef) -> None:
        """Publish one weight message to every server."""
        with self._lock:
            self.pub.send(msg)
            self.pushes += 1

    def announce(self, version: int, ref: WeightRef, repush: bool) -> None:
        """Adopt and publish a WeightRef at once; repush=False: lagging servers get nothing again."""
        with self._lock:
            self._full, self.version, self._built_at = (ref if repush else None), version, time.monotonic()
            self.pub.send(ref)
            self.pushes += 1

    def wait_applied(self, version: int, timeout_s: float) -> list[str]:
        """Wait until every server heard from lately reports `version` or newer; return those still behind."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            behind = [
                sid for sid, s in list(self.servers.items()) if now - s.seen < SERVER_GONE_S and s.version < version
            ]
            if not behind or now >= deadline:
                return behind
            time.sleep(0.05)

    def request_eval(self, version: int) -> None:
        """Ask one rollout server to evaluate `version` (or newer) with its quantized engine."""
        with self._lock:
            self._eval_wanted = version

    def take_eval_results(self) -> list[tuple[int, dict]]:
        """(version, counters with `acc`) of every eval_result received since the last call."""
        with self._lock:
            out, self._eval_results = self._eval_results, []
        return out

    def status_line(self) -> str:
        """'rollout-0-123 v3 running 8 queued 2, ...' for the servers heard from recently."""
        now = time.monotonic()
        live = [(sid, s) for sid, s in list(self.servers.items()) if now - s.seen < SERVER_GONE_S]
        if not live:
            return (
                "no rollout server has said hello yet" if not self.servers else "no rollout server heard from for 30 s"
            )
        return ", ".join(f"{sid} v{s.version} running {s.running} queued {s.queued}" for sid, s in live)

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
        with self._lock:
            version, push = self.version, self._full
        grant = self.budget.grant(msg.server_id, version, info.version, info.counters, now)
        with self._lock:
            reply = Status(type="reply", server_id=msg.server_id, version=version, budget=grant)
            try:
                self.control_tx.send(reply, to=ident, flags=zmq.NOBLOCK)
            except zmq.Again:  # the server is gone or not reading; its next heartbeat gets an answer
                pass
            if self._eval_wanted is not None and msg.type in ("hello", "heartbeat"):
                request = Status(type="eval_request", server_id=msg.server_id, version=self._eval_wanted)
                try:
                    self.control_tx.send(request, to=ident, flags=zmq.NOBLOCK)
                    self._eval_holder, self._eval_wanted = (msg.server_id, self._eval_wanted), None
                except zmq.Again:
                    pass
            # a heartbeat sent before the newest push arrived is not yet lagging: a full repush would undo a
            # delta's savings
            lagging = (
                msg.type == "resend_weights"
                or msg.version < version
                and (msg.type == "hello" or now - self._built_at >= LAG_GRACE_S)
            )
            if push is not None and lagging and now - info.repushed_at >= REPUSH_INTERVAL_S:
                info.repushed_at = now
                self.pub.send(push)
                self.repushes += 1
