"""Admission control (design.md §3.5): bound the work a server holds by what the learner can still use."""
from __future__ import annotations


class Admission:
    """Start a group only while accepted + in_flight < (max_staleness + version + 1) * batch_prompts.

    in_flight counts every group this server admitted that the learner has not yet reported as
    received (running in the engine, being scored, waiting to send, or on the wire), so a server
    whose groups are not consumed stops admitting and its memory stays bounded.
    """

    def __init__(self, max_staleness: int, batch_prompts: int) -> None:
        if max_staleness < 0 or batch_prompts < 1:
            raise ValueError(f"admission needs max_staleness >= 0 and batch_prompts >= 1, "
                             f"got {max_staleness} and {batch_prompts}")
        self.max_staleness = max_staleness
        self.batch_prompts = batch_prompts
        self.version = 0  # learner's V from its last reply
        self.accepted = 0  # learner's A: groups accepted over the whole run
        self.received = 0  # learner's R: groups it received from this server
        self.admitted = 0  # groups this server started

    @property
    def limit(self) -> int:
        """Most groups that may be accepted or in flight at the learner's current version."""
        return (self.max_staleness + self.version + 1) * self.batch_prompts

    @property
    def in_flight(self) -> int:
        """Groups admitted here and not yet received by the learner."""
        return max(0, self.admitted - self.received)

    @property
    def used(self) -> int:
        """The left side of the rule: accepted + in_flight."""
        return self.accepted + self.in_flight

    def room(self) -> int:
        """How many more groups may start now."""
        return max(0, self.limit - self.used)

    def admit(self, n: int = 1) -> None:
        """Record n started groups; raise if that breaks the budget (a caller bug)."""
        if n > self.room():
            raise RuntimeError(f"admission: {n} groups asked, room for {self.room()}")
        self.admitted += n

    def on_reply(self, version: int, accepted: int, received: int) -> None:
        """Adopt the learner's counters from a control reply."""
        self.version, self.accepted, self.received = version, accepted, received
