"""Rank 0's trajectory buffer: pull scored groups, drop stale or uninformative ones (counted), assemble batches.

Groups are received on a thread of its own (`start`), during train steps too: a group dropped on arrival (stale, or
unanimous under dynamic sampling) counts as received at once, so the staleness budget returns its room to the
servers while the learner trains, not after the step (learner/budget.py grants by what was received). When the
main thread alone received, between steps, a dynamic-sampling recipe's server spent most of each step idle at
its grant (RESULTS §13).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, deque

import torch
import zmq

from learner.batch import min_version
from qurl.algorithms import filter_groups
from qurl.wire.protocol import TrajectoryGroup
from qurl.wire.transport import Receiver

log = logging.getLogger("learner")

INTAKE_POLL_MS = 100  # the intake thread checks for a stop this often


def json_copy(tree: dict) -> dict:
    """A deep copy of a JSON-able dict (the books travel in checkpoints as JSON)."""
    return json.loads(json.dumps(tree))


class TrajectoryBuffer:
    """FIFO of groups received on the PULL socket; every group that is not used is counted by reason."""

    def __init__(
        self, receiver: Receiver, *, batch_prompts: int, max_staleness: int, dynamic_sampling: bool, vocab_size: int
    ) -> None:
        self.receiver = receiver
        self.batch_prompts = batch_prompts
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self.vocab_size = vocab_size
        self.groups: deque[TrajectoryGroup] = deque()
        self.received = 0
        self.received_from: Counter[str] = Counter()
        self.used = 0
        self.used_from: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()  # stale, filter (all rewards equal), invalid, restart
        self.response_tokens = 0  # every response token received, used or not
        self.last_arrival = time.monotonic()
        self.life = 1  # learner lives: 1 + resumes
        # the books' wire evidence:
        # server id -> {"sessions": {session: [accepted, highest seq]}, "life", "restart_gaps"}
        self.wire: dict[str, dict] = {}
        self._used_by: dict[int, int] = {0: 0}  # weights version -> groups used by the steps that made it and before
        self._resumed_sessions: set[tuple[str, str]] = set()  # checkpointed sessions not heard from since the resume
        self._lock = threading.Lock()  # the control thread reads (A, U, received per server) as one snapshot
        self._arrived = threading.Condition(self._lock)  # notified for every group accepted into the buffer
        self.version = 0  # the learner's weights version (step_done): what the intake thread judges staleness by
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Receive on a thread from now on; `take(wait_ms=...)` then waits for it."""
        self._thread = threading.Thread(target=self._intake, name="qurl-intake", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the intake thread (before the socket's context is destroyed)."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)

    def _intake(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(INTAKE_POLL_MS)
            except zmq.ZMQError:  # the context was closed under us at shutdown
                return

    @property
    def accepted_total(self) -> int:
        """A of the control replies: groups used or waiting in the buffer, over the whole run."""
        return self.used + len(self.groups)

    def snapshot(self, version: int) -> tuple[int, int, dict[str, int]]:
        """(accepted_total, groups used by the steps that made weights `version`, groups received per server id),
        consistent with each other (learner/budget.py). A server holding `version` gets room counted from there: a
        batch still in training, or a newer version it has not loaded, is not room for it, since work it started
        now would be stale when taken."""
        with self._lock:
            made = [v for v in self._used_by if v <= version]
            return self.accepted_total, self._used_by[max(made)] if made else 0, dict(self.received_from)

    def step_done(self, version: int) -> None:
        """A step ended with weights `version` (new, or the same when its update was skipped): its groups count as
        used for servers that hold that version. Called before the push, so a server never holds it first."""
        with self._lock:
            self.version = version
            self._used_by[version] = self.used
            for old in [v for v in self._used_by if v < version - self.max_staleness - 1]:
                del self._used_by[old]

    def counters(self) -> dict:
        """The buffer's cursor: what a resumed learner continues counting from."""
        with self._lock:  # one consistent cursor while the intake thread counts
            return self._counters()

    def _counters(self) -> dict:
        return {
            "received": self.received,
            "received_from": dict(self.received_from),
            "used": self.used,
            "used_from": dict(self.used_from),
            "dropped": dict(self.dropped),
            "response_tokens": self.response_tokens,
            "buffered": len(self.groups),
            "life": self.life,
            "wire": json_copy(self.wire),
        }

    def restore(self, counters: dict) -> None:
        """Continue the counts of a checkpoint; the groups that sat in the buffer are not kept (servers make new
        ones) and are booked as dropped_at_restart."""
        self.received = int(counters["received"])
        self.received_from = Counter({k: int(v) for k, v in counters["received_from"].items()})
        self.used = int(counters["used"])
        self.used_from = Counter({k: int(v) for k, v in counters.get("used_from", {}).items()})
        self.dropped = Counter({k: int(v) for k, v in counters["dropped"].items()})
        self.dropped["restart"] += int(counters.get("buffered", 0))
        self.response_tokens = int(counters["response_tokens"])
        self.life = int(counters.get("life", 1)) + 1
        self.wire = json_copy(counters.get("wire", {}))
        self._resumed_sessions = {(sid, session) for sid, w in self.wire.items() for session in w["sessions"]}
        self._used_by = {}  # the resumed learner records its version (step_done)

    def poll(self, timeout_ms: int, version: int | None = None) -> int:
        """Take every group waiting on the socket (waiting up to timeout_ms for the first); return how many. Each is
        judged against `version`, or against the learner's version when it arrives (the intake thread)."""
        n = 0
        ready = self.receiver.sock.poll(timeout_ms)
        while ready:
            msg = self.receiver.recv(timeout_ms=0)  # None when the message was bad (logged and counted there)
            if isinstance(msg, TrajectoryGroup):
                with self._lock:
                    self._tally(*self.receiver.guard.last_stamp)
                    self._add(msg, self.version if version is None else version)
                    self._arrived.notify_all()
                n += 1
            ready = self.receiver.sock.poll(0)
        return n

    def _tally(self, sender: str, session: str, seq: int) -> None:
        """Book one accepted message by its stamp; a resumed session's skipped seq numbers went to the dead learner."""
        w = self.wire.setdefault(sender, {"sessions": {}, "life": self.life, "restart_gaps": 0})
        w["life"] = self.life
        count, high = w["sessions"].get(session, (0, -1))
        if (sender, session) in self._resumed_sessions:
            self._resumed_sessions.discard((sender, session))
            w["restart_gaps"] += seq - high - 1
        w["sessions"][session] = [count + 1, max(high, seq)]

    def _add(self, group: TrajectoryGroup, version: int) -> None:
        self.received += 1
        self.received_from[group.server_id] += 1
        self.response_tokens += sum(len(s.token_ids) for s in group.samples)
        self.last_arrival = time.monotonic()
        problem = self._invalid(group, version)
        if problem:
            self.dropped["invalid"] += 1
            log.warning("dropped group %s from %s: %s", group.group_id, group.server_id, problem)
        elif version - min_version(group) > self.max_staleness:
            self.dropped["stale"] += 1
        elif self.dynamic_sampling and self._uninformative(group):
            self.dropped["filter"] += 1
        else:
            self.groups.append(group)

    def _invalid(self, group: TrajectoryGroup, version: int) -> str | None:
        top = max(int(group.prompt_ids.max()), *(int(s.token_ids.max()) for s in group.samples))
        if top >= self.vocab_size:
            return f"token id {top} is outside the model's vocabulary ({self.vocab_size})"
        newest = max(int(s.versions.max()) for s in group.samples)
        if newest > version:
            return f"made by weights version {newest}, newer than the learner's {version} (another run?)"
        return None

    @staticmethod
    def _uninformative(group: TrajectoryGroup) -> bool:
        rewards = torch.tensor([s.reward for s in group.samples], dtype=torch.float32)
        _, n_dropped = filter_groups(rewards, torch.zeros(len(rewards), dtype=torch.int64))
        return n_dropped > 0

    def take(self, version: int, wait_ms: int = 0) -> list[TrajectoryGroup] | None:
        """The oldest batch_prompts groups once enough fresh ones wait (waiting up to wait_ms for the intake thread);
        groups now too stale are dropped first."""
        with self._lock:
            if wait_ms:
                self._arrived.wait_for(lambda: len(self.groups) >= self.batch_prompts, wait_ms / 1000)
            fresh = deque(g for g in self.groups if version - min_version(g) <= self.max_staleness)
            if len(fresh) < len(self.groups):
                self.dropped["stale"] += len(self.groups) - len(fresh)
                self.groups = fresh
            if len(self.groups) < self.batch_prompts:
                return None
            batch = [self.groups.popleft() for _ in range(self.batch_prompts)]
            self.used += len(batch)
            self.used_from.update(g.server_id for g in batch)
            return batch
