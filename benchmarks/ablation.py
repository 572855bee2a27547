"""Ablation of quantized rollout and its corrections on the CPU demo (issue 9): configurations x seeds.

Each run is a real `qurl-async --config configs/demo-cpu.yaml` (learner + rollout server processes). The
configurations differ only in the keys below; everything else is the demo config. Resumable: a run that
finished is skipped, an interrupted one resumes from its newest checkpoint (see demo_runs.py).
Writes OUT/ablation.json (design.md §9; rows carry per-step curves and eval points) and OUT/ablation.png
(mean +- std reward and mismatch curves over seeds, and final held-out accuracy per config with
error bars), and prints the JSON without curves. `final_acc` is the learner's full-precision greedy
held-out accuracy at the end (eval/acc_fp), `final_acc_quant` the rollout engine's.

--stress is the mismatch stress ablation: the fp32 reference and the int configurations on the sum-steps
task (longer answers, so mismatch accumulates) with int weights on a STRESS_BITS-bit grid; it writes
OUT/ablation-stress.json and .png. Flags given with it override its defaults. --mini-batches N (N > 1)
gives every run N updates per learner step, so that the ratio to the proximal policy leaves 1 and
clipping (and ACR's widening of it) can act; its folders and outputs end in -mbN.

    python benchmarks/ablation.py [--steps 400] [--seeds 0 1 2] [--configs fp32 int8-acr ...] [--parallel 1]
                                  [--task add|sum-steps] [--weight-bits 8] [--mini-batches 1] [--out results]
                                  [--quick] [--stress]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_runs import (  # noqa: E402
    QUICK,
    Run,
    add_common_args,
    cadence,
    check_args,
    demo,
    demo_overrides,
    mean_std,
    plot_curve,
    read_run,
    run_all,
    strip_curves,
    write_result,
)

INT = "rollout.quant=int8"
CONFIGS: dict[str, list[str]] = {
    "fp32": ["rollout.quant=none", "algo.loss=acr", "quant.invariant_scaling.s=1.0"],  # reference
    "int8-ppo": [INT, "algo.loss=ppo", "quant.invariant_scaling.s=1.0"],  # naive
    "int8-tis": [INT, "algo.loss=tis", "quant.invariant_scaling.s=1.0"],
    "int8-acr": [INT, "algo.loss=acr", "quant.invariant_scaling.s=1.0"],
    "int8-acr-s1.5": [INT, "algo.loss=acr", "quant.invariant_scaling.s=1.5"],
    "fp8-acr-s1.5": [
        "rollout.quant=fp8",
        "quant.fp8_granularity=block",
        "algo.loss=acr",
        "quant.invariant_scaling.s=1.5",
    ],
}
REFERENCE = "fp32"
STEPS = 400  # default run length: 18 runs fit in an hour on 2 cores
STRESS_BITS = 4
STRESS_STEPS = 200
STRESS_CONFIGS = ["fp32", "int8-ppo", "int8-tis", "int8-acr", "int8-acr-s1.5"]


def suffix(args: argparse.Namespace) -> str:
    """Names of folders and outputs made with more than one update per learner step end in -mbN."""
    return f"-mb{args.mini_batches}" if args.mini_batches != 1 else ""


def build_runs(configs: dict[str, list[str]], args: argparse.Namespace, benchmark: str) -> list[Run]:
    """One Run per (config, seed) under runs/<benchmark>/<task>-w<bits>/ (or --runs-dir)."""
    root, info = demo(args.task, args.demo_dir)
    base = demo_overrides(root, info) + (QUICK if args.quick else [])
    mb = [f"train.mini_batches={args.mini_batches}"] if args.mini_batches != 1 else []
    runs_dir = args.runs_dir or os.path.join("runs", benchmark, f"{args.task}-w{args.weight_bits}" + suffix(args))
    runs = []
    for name, keys in configs.items():
        bits = [f"quant.weight_bits={args.weight_bits}"] if INT in keys and args.weight_bits != 8 else []
        for seed in args.seeds:
            runs.append(
                Run(
                    name,
                    seed,
                    base + keys + bits + mb,
                    args.steps,
                    os.path.abspath(os.path.join(runs_dir, f"{name}-seed{seed}")),
                    cadence(args.steps, args.quick),
                )
            )
    return runs


def aggregate(rows: list[dict]) -> list[dict]:
    """Per config: mean and std over seeds of final and best accuracy, and the gap to the fp32 reference."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        final, final_std = mean_std([r["final_acc"] for r in mine])
        best, best_std = mean_std([r["best_acc"] for r in mine])
        quant, _ = mean_std([r["final_acc_quant"] for r in mine])
        out.append(
            {
                "config": config,
                "n": len(mine),
                "final_acc_mean": final,
                "final_acc_std": final_std,
                "best_acc_mean": best,
                "best_acc_std": best_std,
                "final_acc_quant_mean": quant,
                "wall_s_mean": mean_std([r["wall_s"] for r in mine])[0],
            }
        )
    ref = next((a["final_acc_mean"] for a in out if a["config"] == REFERENCE), None)
    for a in out:
        a["final_acc_minus_fp32"] = (
            a["final_acc_mean"] - ref if ref is not None and a["final_acc_mean"] is not None else None
        )
    return out


def plot(rows: list[dict], summary: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(19, 5), constrained_layout=True)
    plot_curve(left, rows, "reward/mean", "train reward (mean +- std over seeds)")
    plot_curve(middle, rows, "mismatch/kl_k3", "mismatch/kl_k3, behaviour vs proximal (log)")
    middle.set_yscale("log")
    names = [a["config"] for a in summary]
    means = [a["final_acc_mean"] or 0.0 for a in summary]
    right.bar(names, means, yerr=[a["final_acc_std"] or 0.0 for a in summary], capsize=4, alpha=0.7)
    for i, name in enumerate(names):
        pts = [r["final_acc"] for r in rows if r["config"] == name and r["final_acc"] is not None]
        right.scatter([i] * len(pts), pts, color="k", s=10, zorder=3)
    first = [r["first_acc"] for r in rows if r["first_acc"] is not None]
    if first:
        right.axhline(sum(first) / len(first), color="gray", ls="--", label="base (step 0)")
        right.legend(fontsize=8)
    right.set_title("final held-out greedy accuracy (eval/acc_fp)")
    right.tick_params(axis="x", rotation=30)
    right.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ablation.py", description=__doc__.splitlines()[0])
    add_common_args(p, steps=STEPS, seeds=[0, 1, 2], out="results")
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        choices=list(CONFIGS),
        help="subset to run (default all; --stress: fp32 and the int ones; --quick: int8-acr)",
    )
    p.add_argument(
        "--stress",
        action="store_true",
        help=f"mismatch stress: sum-steps task, {STRESS_BITS}-bit int weights, {STRESS_STEPS} steps",
    )
    args = p.parse_args(argv)
    if args.stress:
        p.set_defaults(task="sum-steps", weight_bits=STRESS_BITS, steps=STRESS_STEPS, configs=STRESS_CONFIGS)
        args = p.parse_args(argv)
    check_args(p, args)
    if not args.configs:
        args.configs = ["int8-acr"] if args.quick else list(CONFIGS)
    if args.quick:
        args.steps, args.seeds = 2, args.seeds[:1]
    started = time.time()
    runs = build_runs({c: CONFIGS[c] for c in args.configs}, args, "ablation")
    failed = run_all(runs, args.parallel, desc="ablation")
    rows = [read_run(r) for r in runs]
    from common import machine_info

    name = ("ablation-stress" if args.stress else "ablation") + suffix(args)
    summary = aggregate([r for r in rows if r["ok"]])
    result = {
        "benchmark": name,
        "machine": machine_info(),
        "task": args.task,
        "weight_bits": args.weight_bits,
        "mini_batches": args.mini_batches,
        "steps": args.steps,
        "seeds": args.seeds,
        "configs": {c: CONFIGS[c] for c in args.configs},
        "summary": summary,
        "rows": rows,
        "failed": failed,
        "wall_s": round(sum(r["wall_s"] for r in rows), 1),
        "invocation_wall_s": round(time.time() - started, 1),
    }
    path = write_result(args.out, name, result)
    plot(
        rows,
        summary,
        os.path.join(args.out, f"{name}.png"),
        f"demo ablation: task {args.task}, weight bits {args.weight_bits}, mini-batches {args.mini_batches}, "
        f"{args.steps} steps",
    )
    print(json.dumps(strip_curves(result), indent=1))
    print(
        f"ablation: {len(runs)} runs ({len(failed)} failed); this invocation {result['invocation_wall_s']:.0f} s "
        f"wall, all attempts of these runs {result['wall_s']:.0f} s; "
        f"wrote {path} and {os.path.join(args.out, name + '.png')}",
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
