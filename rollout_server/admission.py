"""Admission control (design.md §3.5): start work only within the learner's grant of the global staleness budget."""

from __future__ import annotations


class Admission:
    """Start a group only while admitted < grant, the cumulative grant of the learner's latest reply.

    The learner (learner/budget.py) sizes every server's grant so that all servers together never hold more
    than (max_staleness + version + 1) * batch_prompts groups accepted or in flight. Grants only grow, so a
    reply that arrives late or out of order cannot widen anything; before the first reply nothing starts.
    """

    def __init__(self) -> None:
        self.grant = 0  # groups this server may have admitted in its life
        self.admitted = 0  # groups this server started

    def room(self) -> int:
        """How many more groups may start now."""
        return max(0, self.grant - self.admitted)

    def admit(self, n: int = 1) -> None:
        """Record n started groups; raise if that breaks the grant (a caller bug)."""
        if n > self.room():
            raise RuntimeError(f"admission: {n} groups asked, room for {self.room()}")
        self.admitted += n

    def on_reply(self, grant: int) -> None:
        """Adopt the grant of a control reply."""
        self.grant = max(self.grant, grant)
