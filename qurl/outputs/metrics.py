"""Per-step metrics to metrics.jsonl (the design.md §6 contract), TensorBoard and, when configured, wandb."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from qurl.corrections.metric_keys import REDUCE

log = logging.getLogger(__name__)

# design.md §6: every learner step's row holds at least these
CONTRACT_KEYS = (
    "step",
    "version",
    "time/step_s",
    "reward/mean",
    "reward/std",
    "loss/policy",
    "actor/grad_norm",
    *REDUCE,  # the objective's mismatch and correction metrics, every mode (qurl/corrections/metric_keys.py)
    "mismatch/kl_k3_smoothed",
    "mismatch/alarm",
    "staleness/mean",
    "staleness/max",
    "buffer/dropped_stale",
    "rollout/tokens_per_s",
    "rollout/response_len_mean",
    "sync/seconds",
    "sync/bytes",
    "sync/changed_frac",
)


def _json_value(value: Any) -> Any:
    """Numbers as JSON numbers; NaN and inf (a skipped step's loss) as null, since JSON has no such numbers."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def truncate_after(path: str, step: int) -> None:
    """Keep the rows up to `step` (and drop a torn last line), atomically."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


class MetricsLogger:
    """Appends one JSON line per step (flushed, so a killed run keeps its rows) and mirrors it to TensorBoard/wandb."""

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard: bool = True,
        wandb_project: str = "",
        run_name: str = "",
        config: dict | None = None,
        resume_step: int | None = None,
    ) -> None:
        """resume_step: continuing a run from that step's checkpoint; rows logged after it are dropped."""
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"), purge_step=purge)
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                log.warning("log.wandb_project=%s but wandb is not installed; logging to files only", wandb_project)
            else:
                self._wandb = wandb.init(project=wandb_project, name=run_name or None, config=config, resume="allow")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one row; keys are sorted, `step` comes first."""
        row = {"step": step, **{k: _json_value(v) for k, v in sorted(metrics.items()) if k != "step"}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in numeric.items():
                if key != "step":
                    self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
