"""End-of-run report (design.md §6): summary.json and curves.png from metrics.jsonl."""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Parse metrics.jsonl, skipping a torn last line from a killed writer."""
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _last(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return values[-1] if values else None


def _best(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return max(values) if values else None


def _first(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return values[0] if values else None


NO_SIGNAL_STEPS = 10  # this many steps in a row with every group's rewards all equal: warn, nothing is learned


def no_signal_streak(rows: list[dict[str, Any]]) -> int:
    """The longest run of consecutive training steps in which no group had two different rewards."""
    longest = current = 0
    for r in rows:
        if "reward/groups_with_signal" not in r:
            continue
        current = current + 1 if r["reward/groups_with_signal"] == 0 else 0
        longest = max(longest, current)
    return longest


NO_ANSWER_STEPS = 5  # this many steps in a row where no response had an answer the reward could read: warn


def no_answer_streak(rows: list[dict[str, Any]]) -> int:
    """The longest run of consecutive training steps in which every sample's reward status was no_answer."""
    longest = current = 0
    for r in rows:
        statuses = {k: v for k, v in r.items() if k.startswith("reward/status_")}
        if not statuses:
            continue
        total = sum(statuses.values())
        current = current + 1 if total and statuses.get("reward/status_no_answer", 0) == total else 0
        longest = max(longest, current)
    return longest


def write_summary(run_dir: str, config_yaml: str, wall_s: float, extra: dict | None = None) -> dict:
    """Write summary.json: final and best reward and accuracy, totals, wall time, config hash."""
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    summary: dict[str, Any] = {
        "steps": int(_last(rows, "step") or 0),
        "version": int(_last(rows, "version") or 0),
        "wall_s": round(wall_s, 2),
        "config_sha256": hashlib.sha256(config_yaml.encode()).hexdigest(),
        "reward/final": _last(rows, "reward/mean"),
        "reward/best": _best(rows, "reward/mean"),
    }
    for key in ("eval/acc_fp", "eval/acc_quant"):
        evals = [r for r in rows if isinstance(r.get(key), (int, float))]
        last_version = evals[-1].get("eval/version") if evals else None
        summary[f"{key}/first"] = _first(rows, key)
        summary[f"{key}/last"] = _last(rows, key)
        summary[f"{key}/last_version"] = last_version
        # final: of the final weights; a run stopped early (Ctrl-C) has none, rather than its first eval's
        summary[f"{key}/final"] = summary[f"{key}/last"] if evals and last_version == summary["version"] else None
        summary[f"{key}/best"] = _best(rows, key)
    summary["reward/no_signal_steps"] = no_signal_streak(rows)
    summary["reward/no_answer_steps"] = no_answer_streak(rows)
    tokens = sum(r.get("rollout/tokens", 0) for r in rows)
    summary["totals"] = {
        "response_tokens": tokens,
        "dropped_stale": _last(rows, "buffer/dropped_stale"),
        "skipped_steps": _last(rows, "train/skipped_steps"),
        "sync_bytes": sum(r.get("sync/bytes", 0) for r in rows),
        # samples trained on, by how their reward was obtained (timeout / error / nan score 0 and are counted)
        "reward_status": {
            k[len("reward/status_") :]: sum(r.get(k, 0) for r in rows)
            for k in sorted({k for r in rows for k in r if k.startswith("reward/status_")})
        },
    }
    summary.update(extra or {})
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


PANELS = [
    ("reward", ["reward/mean", "eval/acc_fp", "eval/acc_quant"]),
    ("mismatch KL (behaviour vs proximal)", ["mismatch/kl_k3", "mismatch/kl_k1", "mismatch/kl_k3_smoothed"]),
    ("mismatch (rollout_corr/)", ["rollout_corr/log_ppl_abs_diff", "rollout_corr/chi2_token"]),
    ("importance weight", ["rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size"]),
    (
        "clipped, truncated, rejected (fraction)",
        [
            "actor/clipfrac",
            "acr/widened_frac",
            "rollout_corr/rollout_is_ratio_fraction_high",
            "rollout_corr/rollout_rs_masked_fraction",
            "rollout_corr/rollout_rs_seq_masked_fraction",
        ],
    ),
    ("throughput (response tokens/s)", ["rollout/tokens_per_s"]),
]


def _moving_mean(values: tuple, window: int) -> list[float]:
    """Trailing mean over `window` points (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(run_dir: str) -> str | None:
    """Draw curves.png (reward and accuracy, mismatch, importance weights, clipped / rejected shares, throughput)."""
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(11, 10), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
            if not points:
                continue
            xs, ys = zip(*points)
            if key.startswith("eval/") or len(points) < 50:
                ax.plot(xs, ys, marker="o" if len(points) < 20 else None, ms=3, label=key)
                continue
            (line,) = ax.plot(xs, ys, alpha=0.25, lw=0.8)  # per-step values are noisy: show a moving mean on top
            ax.plot(xs, _moving_mean(ys, max(5, len(ys) // 40)), color=line.get_color(), label=f"{key} (mean)")
        ax.set_title(title)
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    path = os.path.join(run_dir, "curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
