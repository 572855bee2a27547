"""Invariant scaling study (issue 9, paper.md §4): does scaling move more quantized codes per push, about s times?

INT8 rollout with ACR and invariant scaling s = 1.0, 1.5, 2.0 (targets q/k/v, the default), s = 1.5 on q/k/v and
gate/up, and s = 1.0 with the learning rate x1.5. With
symmetric abs-max scales the quantized function is unchanged by s (docs/algorithms.md), but Adam's update
size does not depend on the weights' scale while the grid step shrinks by s, so an update moves about s times
more grid steps; raising the learning rate by the same factor should do the same to the codes. Reports, per
config, sync/changed_frac (share of int8 codes that differ from the previous push) and mismatch/kl_k3 over
training, their means, and changed_frac relative to s = 1.0 next to the expected factor (see configs(): the
metric counts all linears, scaling touches only its targets). Same resumable run
driver, flags and --quick as ablation.py; writes OUT/scaling.json and OUT/scaling.png.

    python benchmarks/scaling_study.py [--steps 300] [--seeds 0] [--out results] [--weight-bits 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ablation import INT, build_runs, suffix  # noqa: E402
from demo_runs import (  # noqa: E402
    DEMO_CONFIG,
    add_common_args,
    check_args,
    demo,
    mean_std,
    plot_curve,
    read_run,
    run_all,
    strip_curves,
    write_result,
)

BASE = [INT, "algo.loss=acr"]


def scaled_share(model_dir: str, targets: tuple[str, ...]) -> float:
    """Share of the quantized linear weights that invariant scaling divides by s (q/k/v; with mlp also gate/up)."""
    from safetensors import safe_open

    from qurl.quant import is_quantized_linear

    names = ("q_proj", "k_proj", "v_proj") + (("gate_proj", "up_proj") if "mlp" in targets else ())
    total = scaled = 0
    for file in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model_dir, file), "pt") as f:
            for name in f.keys():
                if is_quantized_linear(name):
                    size = f.get_slice(name).get_shape()[0] * f.get_slice(name).get_shape()[1]
                    total += size
                    scaled += size if name.split(".")[-2] in names else 0
    return scaled / total


def configs(model_dir: str) -> dict[str, tuple[list[str], float]]:
    """name -> (overrides, expected changed_frac factor over s = 1.0).

    sync/changed_frac counts every quantized linear, but scaling divides only the targets' weights by s, so
    if those move s times more codes and the rest move as before, the whole-model factor is
    1 + (s - 1) * share (share = the targets' part of the quantized weights); a learning rate x k moves every
    weight k times more, factor k."""
    lr = float(OmegaConf.load(DEMO_CONFIG).train.lr)
    qkv, qkv_mlp = scaled_share(model_dir, ("qkv",)), scaled_share(model_dir, ("qkv", "mlp"))
    return {
        "s1.0": (BASE + ["quant.invariant_scaling.s=1.0"], 1.0),
        "s1.5": (BASE + ["quant.invariant_scaling.s=1.5"], 1 + 0.5 * qkv),
        "s2.0": (BASE + ["quant.invariant_scaling.s=2.0"], 1 + 1.0 * qkv),
        "s1.5-mlp": (
            BASE + ["quant.invariant_scaling.s=1.5", "quant.invariant_scaling.targets=[qkv,mlp]"],
            1 + 0.5 * qkv_mlp,
        ),
        "lr1.5x": (BASE + ["quant.invariant_scaling.s=1.0", f"train.lr={lr * 1.5:g}"], 1.5),
    }


def window_mean(row: dict, key: str, skip: int) -> float | None:
    """Mean of a curve after its first `skip` steps (the first push compares against the initial weights)."""
    values = [v for v in row["curves"][key][skip:] if v is not None]
    return sum(values) / len(values) if values else None


def report(rows: list[dict], expected: dict[str, float], skip: int) -> list[dict]:
    out = []
    for name, factor in expected.items():
        mine = [r for r in rows if r["config"] == name and r["ok"]]
        changed, changed_std = mean_std([window_mean(r, "sync/changed_frac", skip) for r in mine])
        kl, kl_std = mean_std([window_mean(r, "mismatch/kl_k3", skip) for r in mine])
        out.append(
            {
                "config": name,
                "n": len(mine),
                "changed_frac_mean": changed,
                "changed_frac_std": changed_std,
                "kl_k3_mean": kl,
                "kl_k3_std": kl_std,
                "final_acc_mean": mean_std([r["final_acc"] for r in mine])[0],
                "expected_factor": factor,
            }
        )
    ref = next((a["changed_frac_mean"] for a in out if a["config"] == "s1.0"), None)
    for a in out:
        a["changed_frac_factor"] = a["changed_frac_mean"] / ref if ref and a["changed_frac_mean"] is not None else None
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    plot_curve(left, rows, "sync/changed_frac", "share of int8 codes changed per push")
    left.set_yscale("log")
    plot_curve(right, rows, "mismatch/kl_k3", "mismatch/kl_k3 (behaviour vs proximal)")
    right.set_yscale("log")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scaling_study.py", description=__doc__.splitlines()[0])
    add_common_args(p, steps=300, seeds=[0], out="results")
    args = p.parse_args(argv)
    check_args(p, args)
    table = configs(os.path.join(demo(args.task, args.demo_dir)[0], "model"))
    if args.quick:
        args.steps, args.seeds = 3, args.seeds[:1]
    started = time.time()
    runs = build_runs({name: keys for name, (keys, _) in table.items()}, args, "scaling")
    failed = run_all(runs, args.parallel, desc="scaling")
    rows = [read_run(r) for r in runs]
    skip = 1 if args.steps > 1 else 0
    from common import machine_info

    result = {
        "benchmark": "scaling_study",
        "machine": machine_info(),
        "task": args.task,
        "weight_bits": args.weight_bits,
        "mini_batches": args.mini_batches,
        "steps": args.steps,
        "seeds": args.seeds,
        "summary": report(rows, {name: f for name, (_, f) in table.items()}, skip),
        "note": f"means over steps {skip + 1}..{args.steps}; changed_frac_factor = changed_frac_mean / s1.0's",
        "rows": rows,
        "failed": failed,
        "wall_s": round(sum(r["wall_s"] for r in rows), 1),
        "invocation_wall_s": round(time.time() - started, 1),
    }
    path = write_result(args.out, "scaling" + suffix(args), result)
    plot(
        rows,
        os.path.join(args.out, f"scaling{suffix(args)}.png"),
        f"invariant scaling: int8 ACR, task {args.task}, weight bits {args.weight_bits}, {args.steps} steps",
    )
    print(json.dumps(strip_curves(result), indent=1))
    for a in result["summary"]:
        print(
            f"{a['config']:7s} changed_frac {a['changed_frac_mean'] or 0:.4g} (x{a['changed_frac_factor'] or 0:.2f}, "
            f"expected x{a['expected_factor']:.2f})  kl_k3 {a['kl_k3_mean'] or 0:.3g}",
            file=sys.stderr,
        )
    print(f"scaling: {len(runs)} runs, all attempts {result['wall_s']:.0f} s; wrote {path}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
