"""Whether the reward function works (rank 0): a verifier that raises, times out or returns NaN scores those samples
0, which trains on noise without a word. The share of failed scores over the last WINDOW samples stops the run
(exit 2, one line) once it exceeds reward.max_error_frac; the first failure is kept for the console's warning."""

from __future__ import annotations

from collections import Counter, deque

from qurl.rewards import FAILED_STATUSES as FAILED

WINDOW = 256  # scored samples the share is taken over
MIN_SEEN = 64  # no verdict on fewer


class RewardHealth:
    """Feed it every batch's reward details; `problem()` is the stop line, or None while the share is acceptable."""

    def __init__(self, max_error_frac: float, reward_name: str) -> None:
        self.max_error_frac, self.reward_name = max_error_frac, reward_name
        self.window: deque[str] = deque(maxlen=WINDOW)
        self.first_failure: str | None = None  # "status: detail" of the first failed score of this learner life

    def observe(self, details: list[dict]) -> str | None:
        """Record one batch's reward details; return the first failure when this batch holds it (for the metrics)."""
        statuses = [str(d.get("status", "ok")) for d in details]
        self.window.extend(statuses)
        if self.first_failure is None:
            first = next((d for d in details if d.get("status") in FAILED), None)
            if first is not None:
                self.first_failure = f"{first['status']}: {first.get('detail') or '(no detail)'}"[:300]
                return self.first_failure
        return None

    def problem(self) -> str | None:
        """The one line that stops the run when too many recent scores failed."""
        failed = Counter(s for s in self.window if s in FAILED)
        n, bad = len(self.window), sum(failed.values())
        if self.max_error_frac >= 1.0 or n < MIN_SEEN or bad / n <= self.max_error_frac:
            return None
        kinds = ", ".join(f"{v} {k}" for k, v in sorted(failed.items()))
        return (
            f"reward.name={self.reward_name}: {bad} of the last {n} scores failed ({kinds}; {bad / n:.0%} > "
            f"reward.max_error_frac={self.max_error_frac:g}); first: {self.first_failure}; fix the reward function "
            "(or raise reward.max_error_frac), then resume"
        )
