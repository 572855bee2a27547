"""The rollout servers as the learner last heard them: one record per server id, written by the control plane's thread
from each hello and heartbeat, read by the weight sync (who holds which version, who is busy evaluating)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from learner.budget import SERVER_GONE_S


@dataclass
class ServerInfo:
    """What the last hello / heartbeat of one server said."""

    version: int
    running: int
    queued: int
    seen: float
    counters: dict = field(default_factory=dict)
    repushed_at: float = -float("inf")

    @property
    def evaluating(self) -> bool:
        """Generating a held-out evaluation: it takes no weights until that is done, so it lags on purpose."""
        return bool(self.counters.get("evaluating", 0))


class ServerRegistry(dict[str, ServerInfo]):
    """server id -> ServerInfo; plain dict updates from one thread, snapshot reads from any."""

    def live(self, now: float | None = None) -> dict[str, ServerInfo]:
        """The servers heard from within SERVER_GONE_S."""
        now = time.monotonic() if now is None else now
        return {sid: s for sid, s in list(self.items()) if now - s.seen < SERVER_GONE_S}

    def behind(self, version: int) -> list[str]:
        """Live servers that report a version older than `version`."""
        return [sid for sid, s in self.live().items() if s.version < version]

    def wait_applied(self, version: int, timeout_s: float) -> list[str]:
        """Wait until every live server reports `version` or newer; return those still behind."""
        deadline = time.monotonic() + timeout_s
        while True:
            behind = self.behind(version)
            if not behind or time.monotonic() >= deadline:
                return behind
            time.sleep(0.05)

    def status_line(self) -> str:
        """'rollout-0-123 v3 running 8 queued 2, ...' for the servers heard from recently."""
        live = self.live()
        if not live:
            return "no rollout server has said hello yet" if not self else "no rollout server heard from for 30 s"
        return ", ".join(f"{sid} v{s.version} running {s.running} queued {s.queued}" for sid, s in live.items())
