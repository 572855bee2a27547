"""The mismatch alarm (every rank, on the all-reduced metric): a broken refit (wrong scales, a tensor left out, a
stale buffer) makes the rollout engine's policy stop being the learner's, and the behaviour/proximal KL jumps long
before the reward falls. A smoothed mismatch/kl_k3 above mismatch.max_kl for mismatch.alarm_steps steps in a row
fires it: a warning, or with mismatch.stop a checkpoint and exit 3."""

from __future__ import annotations

import math

SMOOTHED, ALARM = "mismatch/kl_k3_smoothed", "mismatch/alarm"


class MismatchAlarm:
    """Feed it each step's mismatch/kl_k3; `observe` returns the step's metrics and, the step it fires, its line."""

    def __init__(self, max_kl: float, steps: int, smoothing: float) -> None:
        self.max_kl, self.steps, self.smoothing = max_kl, steps, smoothing
        self.smoothed: float | None = None
        self.streak = 0  # steps in a row with the smoothed KL above max_kl
        self.healthy_step = 0  # the last step at or under it

    def observe(self, step: int, kl_k3: float) -> tuple[dict, str | None]:
        """(metrics for this step, the alarm's line when it fires at this step, else None)."""
        if not math.isnan(kl_k3):  # a step whose every update was skipped logs no mismatch
            self.smoothed = (
                kl_k3 if self.smoothed is None else (self.smoothing * kl_k3 + (1 - self.smoothing) * self.smoothed)
            )
        smoothed = self.smoothed if self.smoothed is not None else float("nan")
        above = self.max_kl > 0 and smoothed > self.max_kl
        self.streak = self.streak + 1 if above else 0
        if not above:
            self.healthy_step = step
        fired = self.streak == self.steps
        line = None
        if fired:
            line = (
                f"mismatch alarm: smoothed mismatch/kl_k3 {smoothed:.3g} > mismatch.max_kl={self.max_kl:g} for "
                f"{self.steps} steps (steps {step - self.steps + 1}-{step}; last step under it: {self.healthy_step}): "
                "the rollout engine's policy is no longer the learner's; suspect the weight push (wrong scales, a "
                "tensor left out, a stale buffer) before the data, and compare rollout.quant=none"
            )
        return {SMOOTHED: smoothed, ALARM: float(self.streak >= self.steps)}, line
