"""INT8 against bf16 rollout on the real recipe that learns (issue 30): configs x seeds, whole runs, one at a time.

Each run is `qurl-async --config configs/smollm2-gym-cpu.yaml` (SmolLM2-135M warm-started on reasoning-gym
arithmetic; `qurl-prepare-real --gym configs/tasks/gym-arith.yaml` first) with only the keys below changed,
run whole (never in segments, so wall-clock curves hold no restarts) and one at a time under flock(--lock).
A finished run is skipped on a rerun; --report only rewrites the outputs from the run folders.

Writes OUT/real-learning.json (per run: reward per step, both held-out accuracies per weights version, each
against learner step and against wall-clock seconds since the learner first waited for rollouts; per config: means
and spread over seeds, the seconds to reach --target-acc, and learner steps and trained tokens per hour of the clock
less its inline evaluations) and OUT/real-learning.png, and prints the JSON without curves.

    python benchmarks/real_learning.py [--configs int8-acr-s1.5 bf16 int8-ppo] [--seeds 0 1] [--steps 100]
                                       [--target-acc 0.45] [--report] [--out results]
    # issue 33's synchronous comparison (steps and tokens per hour in the summary)
    python benchmarks/real_learning.py --configs int8-acr-s1.5-sync bf16-sync --seeds 0 1 --steps 60
    # issue 32's comparison: the corrections on INT8 rollout and on 4-bit weights (the stress regime), a shorter horizon
    python benchmarks/real_learning.py --configs w4-ppo w4-tis w4-icepop w4-geo-rs w4-acr w4-acr-s1.5 int8-ppo \
        int8-tis int8-icepop int8-geo-rs int8-acr int8-acr-s1.5 bf16 --seeds 0 1 --steps 30 --runs-dir runs/gym-recipe \
        --out results/corrections  # the 60-step runs of the recipe count, cut at step 30
    # the same at two updates per step, where the clipping rule acts
    python benchmarks/real_learning.py --configs w4-tis-mb2 w4-acr-mb2 w4-acr-s1.5-mb2 --seeds 0 1 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from itertools import accumulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_runs import ROOT, Run, mean_std, read_run, run_all, strip_curves, write_result  # noqa: E402

from qurl.outputs.report import read_metrics  # noqa: E402

CONFIG = str(ROOT / "configs" / "smollm2-gym-cpu.yaml")
NO_SCALING = ["quant.invariant_scaling.s=1.0"]
FULL_PRECISION = ["rollout.quant=none", "quant.lm_head=false", *NO_SCALING]  # the recipe's int8 head needs int8
SYNC = "async.max_staleness=0"  # rollout and training take turns
FOUR_BIT = ["quant.weight_bits=4"]  # the stress regime: int8 codes on a 4-bit grid (a mismatch study knob)
# two updates per step, each from 8 groups as the recipe's one: the second sees a moved policy (R != 1), the only place
# where the clipping rule acts, so ACR can differ from TIS (with one update R = 1 and the two objectives are equal)
TWO_UPDATES = ["train.batch_prompts=16", "train.mini_batches=2"]
CONFIGS: dict[str, list[str]] = {
    "int8-acr-s1.5": [],  # the recipe itself: INT8 W8A8 rollout, ACR, invariant scaling s = 1.5, int8 lm_head
    "bf16": ["rollout.dtype=bfloat16", *FULL_PRECISION],
    "int8-ppo": ["algo.loss=ppo", *NO_SCALING],  # naive: no correction for the mismatch
    "int8-acr-s1.5-all": ["algo.dynamic_sampling=false"],  # the recipe training on every group, mixed or not
    "fp32": ["rollout.dtype=float32", *FULL_PRECISION],  # full precision where bf16 is emulated
    # issue 33's synchronous pair: the server waits while the learner trains, each side with every core
    "int8-acr-s1.5-sync": [SYNC],
    "bf16-sync": ["rollout.dtype=bfloat16", *FULL_PRECISION, SYNC],
    # the recipe before 2026-12-05's eighth session, which the earlier runs measured: fp32 activations and lm_head
    "int8-fp32-act": ["rollout.dtype=float32", "quant.lm_head=false"],
    # issue 32's comparison of the corrections (docs/algorithms.md), INT8 rollout, then 4-bit weights
    "int8-tis": ["algo.loss=tis", *NO_SCALING],
    "int8-icepop": ["algo.loss=icepop", *NO_SCALING],
    "int8-geo-rs": ["algo.loss=geo-rs", *NO_SCALING],
    "int8-acr": NO_SCALING,
    **{
        f"w4-{name}": [*overrides, *FOUR_BIT]
        for name, overrides in (
            ("ppo", ["algo.loss=ppo", *NO_SCALING]),
            ("tis", ["algo.loss=tis", *NO_SCALING]),
            ("icepop", ["algo.loss=icepop", *NO_SCALING]),
            ("geo-rs", ["algo.loss=geo-rs", *NO_SCALING]),
            ("acr", NO_SCALING),
            ("acr-s1.5", []),
            ("tis-mb2", ["algo.loss=tis", *NO_SCALING, *TWO_UPDATES]),
            ("acr-mb2", [*NO_SCALING, *TWO_UPDATES]),
            ("acr-s1.5-mb2", TWO_UPDATES),
        )
    },
}
STEPS = 100
MISMATCH_PANELS = (  # per-step curves summed into each mismatch panel of the plot
    ("mismatch/kl_k3",),
    ("rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_rs_masked_fraction"),
)
QUIET = ["log.tensorboard=false", "checkpoint.every=0", "checkpoint.keep=1"]


def clock(run_dir: str) -> dict[int, float]:
    """Seconds from the learner's first wait for rollouts to the end of each step: the sum of time/wait_s and
    time/step_s, so the time a faster rollout saves (the learner's wait) is on the clock."""
    rows = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss/policy" in r]
    spent = ((r.get("time/wait_s") or 0.0) + (r.get("time/step_s") or 0.0) for r in rows)
    return dict(zip((r["step"] for r in rows), accumulate(spent)))


def throughput(run_dir: str, steps: int) -> dict:
    """Up to `steps`: the clock less the inline evaluations' holds (time/eval_s, the same work for every config), and
    learner steps and trained response tokens (actor/tokens) per hour of it."""
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    rows = [r for r in rows if "loss/policy" in r and r["step"] <= steps]
    clock_s = sum((r.get("time/wait_s") or 0.0) + (r.get("time/step_s") or 0.0) for r in rows)
    eval_s = sum(r.get("time/eval_s") or 0.0 for r in rows)
    train_s = clock_s - eval_s
    tokens = sum(r.get("actor/tokens") or 0.0 for r in rows)
    return {
        "clock_s": round(clock_s, 1),
        "eval_s": round(eval_s, 1),
        "train_s": round(train_s, 1),
        "steps_per_hour": round(len(rows) * 3600 / train_s, 1) if train_s > 0 else None,
        "tokens_per_hour": round(tokens * 3600 / train_s) if train_s > 0 else None,
    }


def with_time(points: list[list[float]], seconds: dict[int, float]) -> list[list[float]]:
    """[version, value] -> [version, seconds at that version (0 before the first step), value]."""
    return [[v, round(seconds.get(int(v), 0.0), 1), a] for v, a in points]


def cut(row: dict, steps: int) -> dict:
    """The row up to learner step `steps`: a longer run (the recipe's own `make real` run) compared at this horizon."""
    keep = [i for i, step in enumerate(row["curves"]["step"]) if step <= steps]
    row["curves"] = {k: [v[i] for i in keep] for k, v in row["curves"].items()}
    row["evals"] = {k: [p for p in v if p[0] <= steps] for k, v in row["evals"].items()}
    row["steps"] = min(row["steps"], steps)
    return row


def reach(points: list[list[float]], target: float) -> float | None:
    """Seconds at the first evaluation at or above target, or None."""
    return next((t for _, t, a in points if a >= target), None)


def summarise(rows: list[dict], target: float) -> list[dict]:
    """Per config: start and end accuracies, their gain, the seconds to the target, as mean and std over seeds."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        entry: dict = {"config": config, "seeds": [r["seed"] for r in mine]}
        for key in ("eval/acc_fp", "eval/acc_quant"):
            name = key.split("/")[1]
            start = [r["timed"][key][0][2] if r["timed"][key] else None for r in mine]
            end = [r["timed"][key][-1][2] if r["timed"][key] else None for r in mine]
            gain = [e - s for s, e in zip(start, end) if s is not None and e is not None]
            entry[f"{name}_start"], entry[f"{name}_start_std"] = mean_std(start)
            entry[f"{name}_end"], entry[f"{name}_end_std"] = mean_std(end)
            entry[f"{name}_gain"], entry[f"{name}_gain_std"] = mean_std(gain)
            entry[f"{name}_per_seed"] = [[s, e] for s, e in zip(start, end)]
            times = [reach(r["timed"][key], target) for r in mine]
            entry[f"{name}_s_to_target"] = times
        entry["reward_first10"] = mean_std([_avg(r["curves"]["reward/mean"][:10]) for r in mine])[0]
        entry["reward_last10"] = mean_std([_avg(r["curves"]["reward/mean"][-10:]) for r in mine])[0]
        for key in ("eval/acc_fp", "eval/acc_quant"):
            best = [max((a for _, _, a in r["timed"][key]), default=None) for r in mine]
            entry[f"{key.split('/')[1]}_best"], entry[f"{key.split('/')[1]}_best_std"] = mean_std(best)
        for key, name in (
            ("mismatch/kl_k3", "kl_k3_mean"),
            ("rollout_corr/log_ppl_abs_diff", "log_ppl_abs_diff_mean"),
            ("rollout_corr/rollout_is_ratio_fraction_high", "truncated_frac_mean"),
            ("rollout_corr/rollout_rs_masked_fraction", "masked_token_frac_mean"),
            ("rollout_corr/rollout_rs_seq_masked_fraction", "masked_seq_frac_mean"),
        ):
            entry[name] = mean_std([_avg(r["curves"].get(key) or []) for r in mine])[0]
        entry["steps"] = mean_std([r["steps"] for r in mine])[0]
        entry["rl_s"] = mean_std([max(r["seconds"].values(), default=None) for r in mine])[0]
        for key in ("eval_s", "train_s", "steps_per_hour", "tokens_per_hour"):
            entry[key], entry[f"{key}_std"] = mean_std([r["throughput"][key] for r in mine])
        out.append(entry)
    return out


def _avg(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def plot(rows: list[dict], path: str, target: float) -> None:
    """Reward against step; each held-out accuracy against step and against wall-clock minutes; the mismatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, grid = plt.subplots(2, 4, figsize=(24, 10), constrained_layout=True)
    axes = list(grid.flat)
    for r in rows:
        color, style = f"C{configs.index(r['config'])}", ["-", "--", ":"][r["seed"] % 3]
        label = f"{r['config']} seed {r['seed']}"
        steps, reward = r["curves"]["step"], r["curves"]["reward/mean"]
        smooth = [_avg(reward[max(0, i - 9) : i + 1]) for i in range(len(reward))]
        axes[0].plot(steps, smooth, style, color=color, label=label)
        for i, key in enumerate(("eval/acc_fp", "eval/acc_quant")):
            pts = r["timed"][key]
            if pts:
                axes[1 + 2 * i].plot([p[0] for p in pts], [p[2] for p in pts], style + "o", color=color, label=label)
                axes[2 + 2 * i].plot([p[1] / 60 for p in pts], [p[2] for p in pts], style + "o", color=color)
        for ax, keys in zip(axes[5:], MISMATCH_PANELS):
            per_step = [sum(v or 0.0 for v in vals) for vals in zip(*(r["curves"][k] for k in keys))]
            ax.plot(steps, per_step, style, color=color)
    titles = [
        "train reward (trailing mean of 10 steps)",
        "held-out greedy accuracy, learner (fp32 weights) vs step",
        "the same vs wall-clock minutes of RL",
        "held-out greedy accuracy, rollout engine vs step",
        "the same vs wall-clock minutes of RL",
        "mismatch: per-token k3 KL, rollout engine to learner",
        "fraction of tokens truncated (IS weight > C) or masked",
    ]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1:5]:
        ax.axhline(target, color="grey", lw=0.8)
    axes[5].set_yscale("log")
    axes[7].axis("off")
    axes[7].legend(*axes[0].get_legend_handles_labels(), loc="center", fontsize=9)
    fig.suptitle(
        "SmolLM2-135M on reasoning-gym arithmetic after a warm start, per rollout format and correction (2-core CPU)"
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="real_learning.py", description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS)[:3], choices=list(CONFIGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--target-acc", type=float, default=0.45, help="accuracy whose wall-clock time is reported")
    p.add_argument("--runs-dir", default=os.path.join("runs", "real-learning"))
    p.add_argument("--out", default="results")
    p.add_argument("--lock", default="/tmp/qurl-cpu.lock", help="file each run holds flock on")
    p.add_argument("--report", action="store_true", help="only rewrite the JSON and the plot from the run folders")
    args = p.parse_args(argv)
    from common import machine_info

    runs = [
        Run(
            name,
            seed,
            CONFIGS[name] + QUIET,
            args.steps,
            os.path.abspath(os.path.join(args.runs_dir, f"{name}-seed{seed}")),
            config=CONFIG,
        )
        for seed in args.seeds  # seed-major: the first seed of every config finishes before any second seed
        for name in args.configs
    ]
    started = time.time()
    failed = [] if args.report else run_all(runs, desc="real-learning", lock=args.lock)
    rows = []
    for run in runs:
        row = cut(read_run(run), args.steps)
        if not row["steps"]:
            continue
        row["seconds"] = {k: v for k, v in clock(run.dir).items() if k <= args.steps}
        row["timed"] = {k: with_time(v, row["seconds"]) for k, v in row["evals"].items()}
        row["throughput"] = throughput(run.dir, args.steps)
        rows.append(row)
    result = {
        "benchmark": "real-learning",
        "machine": machine_info(),
        "config_file": os.path.relpath(CONFIG, ROOT),
        "configs": {c: CONFIGS[c] for c in args.configs},
        "common_overrides": QUIET,
        "steps": args.steps,
        "target_acc": args.target_acc,
        "summary": summarise(rows, args.target_acc),
        "rows": [{k: v for k, v in r.items() if k != "seconds"} for r in rows],
        "failed": failed,
        "invocation_wall_s": round(time.time() - started, 1),
    }
    path = write_result(args.out, "real-learning", result)
    if rows:
        plot(rows, os.path.join(args.out, "real-learning.png"), args.target_acc)
    print(json.dumps(strip_curves(result), indent=1))
    print(f"real-learning: {len(rows)} runs, {len(failed)} failed; wrote {path}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
