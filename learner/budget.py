"""The global staleness budget (design.md §3.5): grants that keep N rollout servers within one bound together.

The bound: groups accepted (used or buffered, A) plus groups in flight at every server never exceed
L = (max_staleness + 1) * batch_prompts + U, U the groups used by the learner steps that made the weights version
the asking server holds: room for max_staleness + 1 batches beyond them, so whatever it starts is fresh when taken.
A batch in training, or a version the server has not loaded yet, is not room for it: work started with the old
weights would be stale on arrival (in synchronous mode the server would generate a whole batch beside the learner,
on the same cores, and the learner would drop it). While every step updates the weights, U = w * batch_prompts (w
the server's version), so L = (max_staleness + w + 1) * batch_prompts; a step whose update is skipped (non-finite
loss) still uses its batch once it ends, so the room it leaves the servers never shrinks, and its groups' staleness
in versions only gets smaller.
Each server gets a cumulative grant G_i: it may have admitted
at most G_i groups in its life (rollout_server/admission.py), and grants never shrink, so a grant in a
delayed or lost reply can never be taken back. Server i holds at most G_i - R_i - bad_i groups not yet
received (R_i: received from it, bad_i: groups its codec refused, which never arrive), its reservation. The
learner raises a grant only by what is free:

    A + sum_i reservation_i <= L                                          (the invariant)

Receiving a group moves it from a reservation into A (or drops it), a step raises L, so the invariant holds
between grants too; and the groups truly accepted or in flight are A + sum_i (admitted_i - R_i - bad_i),
at most the left side. New room is split evenly: a live server's reservation is raised to at most
ceil((L - A) / live servers). A server whose weights lag more than max_staleness versions gets nothing new
until it reports the current version (its work would be dropped as stale). A server that says bye keeps
only the groups it sent that have not arrived; one that qurl-async restarted is released when its
replacement says hello (which names its pid); one silent for SERVER_GONE_S is presumed dead and its
reservation is returned (if it was only paused and comes back, what it still holds counts again; groups a
killed server had handed to the network before it died are not reserved once it is presumed dead). A server
that outlives a learner life (the learner resumed) starts over at its own admitted count; what it sent and
the resumed learner never received went to the dead life and is not reserved.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

SERVER_GONE_S = 30.0  # a server silent this long is presumed dead: its reservation is returned
LIVE_S = 3.0  # a server heard from within this long (heartbeats are ~1 s apart) shares new room


@dataclass
class Holder:
    """One server's grant and what its last report said."""

    grant: int  # cumulative: groups it may have admitted in its life
    admitted: int  # its last report
    bad: int  # groups its codec refused (they never arrive)
    seen: float
    sent_final: int | None = None  # set by its bye: it sends no more than this
    lost: int = 0  # sent to an earlier learner life and not received by this one: never arrives here


class Budget:
    """Grants per server id; snapshot(weights version) gives (A, U at that version, groups received per server id)."""

    def __init__(
        self, max_staleness: int, batch_prompts: int, snapshot: Callable[[int], tuple[int, int, dict[str, int]]]
    ) -> None:
        self.max_staleness, self.batch_prompts, self.snapshot = max_staleness, batch_prompts, snapshot
        self.holders: dict[str, Holder] = {}
        self.version = 0  # the newest weights version at the last grant: the global bound admission/* reports
        self.violations = 0  # reports of more groups admitted than granted
        self.expired: set[str] = set()  # presumed dead in this learner life: if one comes back, its groups count again
        self._lock = threading.Lock()
        self._window: dict[str, float] = {}

    def limit(self, used: int) -> int:
        """L once the learner's steps have used `used` groups."""
        return (self.max_staleness + 1) * self.batch_prompts + used

    def grant(self, sid: str, version: int, server_version: int, counters: dict, now: float) -> int:
        """Take a hello / heartbeat's counters; return the server's (possibly raised) cumulative grant."""
        admitted, bad = int(counters.get("admitted", 0)), int(counters.get("bad_groups", 0))
        with self._lock:
            self.version = max(version, server_version)  # a server holding a version proves it is being published
            accepted, used, received = self.snapshot(server_version)
            h = self.holders.get(sid)
            if (
                h is None or h.sent_final is not None
            ):  # new, back after it was presumed dead, or it outlived a learner life
                # a server that outlived the learner (its groups were received by an earlier life) sent the rest
                # to that life: they are lost_at_learner_restart in the books, not in flight to this one
                lost = 0 if sid in self.expired else max(0, int(counters.get("sent", 0)) - received.get(sid, 0))
                h = self.holders[sid] = Holder(grant=admitted, admitted=admitted, bad=bad, seen=now, lost=lost)
            if admitted > h.grant:
                self.violations += 1
            h.admitted, h.bad, h.seen = max(h.admitted, admitted), max(h.bad, bad), now
            limit = self.limit(used)
            live = self._live(now)
            if version - server_version <= self.max_staleness:
                free = limit - accepted - self._reserved(received)
                share = math.ceil(max(0, limit - accepted) / live)
                h.grant += max(0, min(free, received.get(sid, 0) + h.bad + h.lost + share - h.grant))
            self._observe(self.limit(self.snapshot(self.version)[1]), accepted, received, live)
            return h.grant

    def bye(self, sid: str, counters: dict) -> None:
        """A server that leaves keeps only its groups still on the wire."""
        with self._lock:
            h = self.holders.get(sid)
            if h is not None:
                h.sent_final = int(counters.get("sent", 0))
                h.grant = min(h.grant, h.sent_final + h.bad)

    def expire(self, now: float) -> list[str]:
        """Return the reservations of servers silent for SERVER_GONE_S (their ids); forget departed ones settled."""
        with self._lock:
            _, _, received = self.snapshot(self.version)
            settled = [
                sid
                for sid, h in self.holders.items()
                if h.sent_final is not None and h.grant - received.get(sid, 0) - h.bad <= 0
            ]
            gone = [sid for sid, h in self.holders.items() if h.sent_final is None and now - h.seen >= SERVER_GONE_S]
            for sid in settled + gone:
                del self.holders[sid]
            self.expired.update(gone)
            return gone

    def release(self, sid: str) -> bool:
        """A server known dead (its replacement said so): return its reservation now; False if it held none."""
        with self._lock:
            self.expired.add(sid)
            return self.holders.pop(sid, None) is not None

    def idle(self, version: int) -> bool:
        """No server has a group to make: every grant received (or refused), and no room at `version`, the newest
        weights, for one more (learner/core_lending.py lends the servers' cores to the learner meanwhile)."""
        with self._lock:
            accepted, used, received = self.snapshot(version)
            return self._reserved(received) == 0 and self.limit(used) <= accepted

    def take_window(self) -> dict[str, float]:
        """admission/* metrics since the last call: the bound L, the peaks measured against it, the violations."""
        with self._lock:
            accepted, used, received = self.snapshot(self.version)
            self._observe(self.limit(used), accepted, received, self._live(time.monotonic()))
            out, self._window = self._window, {}
        out["admission/violations"] = self.violations
        return out

    def _live(self, now: float) -> int:
        return sum(1 for h in self.holders.values() if h.sent_final is None and now - h.seen < LIVE_S)

    def _reserved(self, received: dict[str, int]) -> int:
        return sum(max(0, h.grant - received.get(sid, 0) - h.bad - h.lost) for sid, h in self.holders.items())

    def _observe(self, limit: int, accepted: int, received: dict[str, int], live: int) -> None:
        """Peaks of the two sides: reserved (the grants' arithmetic) and held (the servers' own admitted counts)."""
        reserved = accepted + self._reserved(received)
        # a departed server's unsent groups are lost, not held: it holds at most what it sent
        held = accepted + sum(
            max(0, (h.admitted if h.sent_final is None else h.grant) - received.get(sid, 0) - h.bad - h.lost)
            for sid, h in self.holders.items()
        )
        w = self._window
        w["admission/limit"] = limit
        w["admission/max_reserved"] = max(w.get("admission/max_reserved", 0), reserved)
        w["admission/max_held"] = max(w.get("admission/max_held", 0), held)
        w["admission/min_margin"] = min(w.get("admission/min_margin", math.inf), limit - reserved)
        w["admission/min_held_margin"] = min(w.get("admission/min_held_margin", math.inf), limit - held)
        w["admission/servers"] = max(w.get("admission/servers", 0), live)
