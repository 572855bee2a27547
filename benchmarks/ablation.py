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

--real is the same comparison on the real recipe (configs/smollm2-gsm-cpu.yaml, SmolLM2-135M, INT8
rollout, 2 mini-batches; FP8 is left out: on CPU it is a slow correctness path) trained on the templates
the base model sometimes solves (`qurl-prepare-real --easy`, qurl/real/easy.py) and evaluated on new
instances of those templates (gsm/fresh-easy.jsonl; the held-out templates filtered the same way leave one,
which the base model never solves greedily). Steps are sized small (REAL_STEP). The runs advance round-robin
in --segment-step segments, each under flock(--lock), until --steps or the --until deadline (UTC HH:MM),
so every configuration has about the same horizon at any stop; rerun the same command to continue, or
with --report to only rewrite OUT/ablation-real.json and .png from the run folders.

    python benchmarks/ablation.py [--steps 400] [--seeds 0 1 2] [--configs fp32 int8-acr ...] [--parallel 1]
                                  [--task add|sum-steps] [--weight-bits 8] [--mini-batches 1] [--out results]
                                  [--quick] [--stress]
    python benchmarks/ablation.py --real [--steps 200] [--segment 6] [--until 04:15] [--report] [--quick]
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
    ROOT,
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
    run_rounds,
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
REAL_CONFIG = str(ROOT / "configs" / "smollm2-gsm-cpu.yaml")
REAL_CONFIGS = ["fp32", "int8-ppo", "int8-tis", "int8-acr", "int8-acr-s1.5"]
REAL_STEP = [  # 16 responses of at most 160 tokens per step; 32 held-out problems every 12 steps, not at each stop
    "train.batch_prompts=2",
    "rollout.n_samples=8",
    "rollout.sampling.max_new_tokens=160",
    "train.mini_batches=2",
    "eval.max_problems=32",
    "eval.every=12",
    "eval.final=false",
    "checkpoint.every=0",
    "checkpoint.keep=1",
    "log.tensorboard=false",
]
REAL_QUICK = [  # the same path at toy sizes, on the recipe's own splits (no --easy needed)
    "train.batch_prompts=2",
    "rollout.n_samples=2",
    "rollout.sampling.max_new_tokens=8",
    "train.mini_batches=2",
    "eval.max_problems=2",
    "eval.every=0",
    "eval.final=false",
    "checkpoint.every=0",
    "log.tensorboard=false",
]
REAL_STEPS, REAL_SEGMENT = 200, 6


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


def real_data(quick: bool) -> list[str]:
    """Model and data paths of the prepared real track ($QURL_REAL_DIR); the easy splits unless quick. The eval
    set is fresh instances of the easy training templates: the one easy held-out template scores 0 of 32 greedily
    at the start, so held-out templates would not move."""
    from qurl.real.prepare import MODEL_DIR, default_root, read_info

    root = (ROOT / default_root()).resolve()
    if read_info(root) is None:
        raise SystemExit(f"ablation.py --real: no prepared real track at {root}; run qurl-prepare-real --easy")
    train, held = ("train", "heldout") if quick else ("train-easy", "fresh-easy")
    if not (root / "gsm" / f"{train}.jsonl").is_file():
        raise SystemExit(f"ablation.py --real: {root}/gsm/{train}.jsonl missing; run qurl-prepare-real --easy")
    return [
        f"model.path={root / MODEL_DIR}",
        f"data.train_files=[{root}/gsm/{train}.jsonl]",
        f"data.eval_files=[{root}/gsm/{held}.jsonl]",
    ]


def build_real_runs(args: argparse.Namespace) -> list[Run]:
    """One Run per (config, seed) of the real recipe under runs/ablation-real/ (or --runs-dir)."""
    base = real_data(args.quick) + (REAL_QUICK if args.quick else REAL_STEP)
    runs_dir = args.runs_dir or os.path.join("runs", "ablation-real")
    return [
        Run(
            name,
            seed,
            base + CONFIGS[name],
            args.steps,
            os.path.abspath(os.path.join(runs_dir, f"{name}-seed{seed}")),
            config=REAL_CONFIG,
        )
        for name in args.configs
        for seed in args.seeds
    ]


def aggregate_real(rows: list[dict]) -> list[dict]:
    """Per config (seed 0 .. n): steps reached, newest and best held-out accuracy, mismatch at start and end,
    and how often clipping, TIS truncation and ACR widening acted."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]

        def stat(fn):
            return mean_std([fn(r) for r in mine])[0]

        def avg(key, part=slice(None)):
            vals = [v for r in mine for v in r["curves"][key][part] if v is not None]
            return sum(vals) / len(vals) if vals else None

        out.append(
            {
                "config": config,
                "n": len(mine),
                "steps": stat(lambda r: r["steps"]),
                "first_acc": stat(lambda r: r["first_acc"]),
                "last_acc_mean": stat(lambda r: r["last_acc"]),
                "last_acc_std": mean_std([r["last_acc"] for r in mine])[1],
                "best_acc_mean": stat(lambda r: r["best_acc"]),
                "first_acc_quant": stat(lambda r: r["first_acc_quant"]),
                "last_acc_quant_mean": stat(lambda r: r["last_acc_quant"]),
                "reward_first5": avg("reward/mean", slice(0, 5)),
                "reward_last5": avg("reward/mean", slice(-5, None)),
                "kl_k3_first5": avg("mismatch/kl_k3", slice(0, 5)),
                "kl_k3_last5": avg("mismatch/kl_k3", slice(-5, None)),
                "rho_max_mean": avg("mismatch/rho_max"),
                "clipfrac_mean": avg("actor/clipfrac"),
                "tis_truncated_mean": avg("tis/truncated_frac"),
                "acr_widened_mean": avg("acr/widened_frac"),
                "wall_s_mean": stat(lambda r: r["wall_s"]),
                "wall_s_per_step": stat(lambda r: r["wall_s"] / r["steps"] if r["steps"] else None),
            }
        )
    return out


def main_real(args: argparse.Namespace) -> int:
    """--real: run (or only --report) the real-model ablation and write OUT/ablation-real.json and .png."""
    started = time.time()
    runs = build_real_runs(args)
    failed: list[str] = []
    if not args.report:
        until = float("inf") if args.until is None else deadline(args.until)
        failed = run_rounds(runs, args.steps, args.segment, until, args.lock, desc="ablation-real")
    rows = [r for r in (read_run(run) for run in runs) if r["steps"]]
    name = "ablation-real"
    summary = aggregate_real(rows)
    params = {
        "config_file": os.path.relpath(REAL_CONFIG, ROOT),
        "step_overrides": REAL_QUICK if args.quick else REAL_STEP,
        "data": real_data(args.quick),
        "horizon": args.steps,
        "segment": args.segment,
    }
    result = record(name, params, args, summary, rows, failed, started)
    path = write_result(args.out, name, result)
    if rows:
        plot_real(rows, os.path.join(args.out, f"{name}.png"), args)
    print(json.dumps(strip_curves(result), indent=1))
    print(markdown_table(summary), file=sys.stderr)
    steps = {r["config"]: r["steps"] for r in rows}
    print(f"ablation-real: steps per run {steps}; {len(failed)} failed; wrote {path}", file=sys.stderr)
    return 1 if failed else 0


def markdown_table(summary: list[dict]) -> str:
    """The real ablation's summary as docs/RESULTS.md §8 shows it (means over seeds)."""

    def f(v, digits=3):
        return "-" if v is None else f"{v:.{digits}f}"

    lines = [
        "| config | seeds | steps | wall s | s / step | acc_fp start -> last (best) | acc_quant start -> last | "
        "reward first 5 / last 5 | kl_k3 first 5 / last 5 | rho_max mean | clipfrac | tis truncated | acr widened |",
        "|" + "---|" * 13,
    ]
    for a in summary:
        lines.append(
            f"| {a['config']} | {a['n']} | {a['steps']:.0f} | {a['wall_s_mean']:.0f} | {a['wall_s_per_step']:.0f} | "
            f"{f(a['first_acc'])} -> {f(a['last_acc_mean'])} ({f(a['best_acc_mean'])}) | "
            f"{f(a['first_acc_quant'])} -> {f(a['last_acc_quant_mean'])} | "
            f"{f(a['reward_first5'])} / {f(a['reward_last5'])} | "
            f"{f(a['kl_k3_first5'], 4)} / {f(a['kl_k3_last5'], 4)} | "
            f"{f(a['rho_max_mean'], 2)} | {f(a['clipfrac_mean'], 4)} | {f(a['tis_truncated_mean'], 4)} | "
            f"{f(a['acr_widened_mean'], 4)} |"
        )
    return "\n".join(lines)


def deadline(hhmm: str) -> float:
    """The next time of day HH:MM (UTC) as epoch seconds."""
    import datetime as dt

    try:
        hour, minute = map(int, hhmm.split(":"))
        now = dt.datetime.now(dt.timezone.utc)
        at = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    except ValueError:
        raise SystemExit(f"--until: want HH:MM (UTC), got {hhmm!r}") from None
    return (at if at > now else at + dt.timedelta(days=1)).timestamp()


def plot_real(rows: list[dict], path: str, args: argparse.Namespace) -> None:
    """Reward, mismatch (kl_k3 and rho_max) and held-out accuracy over steps, per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(24, 5), constrained_layout=True)
    plot_curve(axes[0], rows, "reward/mean", "train reward (mean +- std over seeds)")
    plot_curve(axes[1], rows, "mismatch/kl_k3", "mismatch/kl_k3, behaviour vs proximal (log)")
    axes[1].set_yscale("log")
    plot_curve(axes[2], rows, "mismatch/rho_max", "mismatch/rho_max (log)")
    axes[2].set_yscale("log")
    configs = list(dict.fromkeys(r["config"] for r in rows))  # plot_curve's colour order
    for r in rows:
        color = f"C{configs.index(r['config']) % 10}"
        for key, style in (("eval/acc_fp", "-o"), ("eval/acc_quant", ":x")):
            if r["evals"][key]:
                axes[3].plot(*zip(*r["evals"][key]), style, color=color, label=f"{r['config']} s{r['seed']} {key[5:]}")
    axes[3].set_title("greedy accuracy on new instances of the train templates")
    axes[3].set_xlabel("weights version (= learner step)")
    axes[3].grid(alpha=0.3)
    axes[3].legend(fontsize=7)
    fig.suptitle(
        "real-model ablation: SmolLM2-135M on the GSM-Symbolic templates it sometimes solves, INT8 rollout, "
        "2 prompts x 8 samples x <= 160 tokens per step, 2 mini-batches"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def record(
    name: str, params: dict, args: argparse.Namespace, summary: list, rows: list, failed: list, started: float
) -> dict:
    """The benchmark's JSON object (design.md §9): what was run, the per-config summary, the rows, wall times."""
    from common import machine_info

    return {
        "benchmark": name,
        "machine": machine_info(),
        **params,
        "seeds": args.seeds,
        "configs": {c: CONFIGS[c] for c in args.configs},
        "summary": summary,
        "rows": rows,
        "failed": failed,
        "wall_s": round(sum(r["wall_s"] for r in rows), 1),
        "invocation_wall_s": round(time.time() - started, 1),
    }


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
    p.add_argument("--real", action="store_true", help="the real recipe (SmolLM2-135M, GSM-Symbolic), see above")
    p.add_argument("--segment", type=int, default=REAL_SEGMENT, help="--real: steps per run per locked segment")
    p.add_argument("--until", default=None, help="--real: start no segment that would end after HH:MM (UTC)")
    p.add_argument("--lock", default="/tmp/qurl-cpu.lock", help="--real: file each segment holds flock on")
    p.add_argument("--report", action="store_true", help="--real: only rewrite the JSON and plot from the runs")
    args = p.parse_args(argv)
    if args.real:
        p.set_defaults(steps=REAL_STEPS, seeds=[0], configs=REAL_CONFIGS)
        args = p.parse_args(argv)
        check_args(p, args)
        if args.segment < 1:
            p.error(f"--segment: must be >= 1, got {args.segment}")
        if args.quick:
            args.configs, args.steps, args.segment, args.seeds = ["int8-acr"], 2, 2, args.seeds[:1]
        return main_real(args)
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
    name = ("ablation-stress" if args.stress else "ablation") + suffix(args)
    summary = aggregate([r for r in rows if r["ok"]])
    params = {
        "task": args.task,
        "weight_bits": args.weight_bits,
        "mini_batches": args.mini_batches,
        "steps": args.steps,
    }
    result = record(name, params, args, summary, rows, failed, started)
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
