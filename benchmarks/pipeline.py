"""End-to-end pipeline benchmark (issue 9): learner steps per hour, asynchronous (max_staleness 1, 2, 4) against
synchronous (0), with int8 and with full-precision rollout, on the CPU demo through qurl-async.

The runs go one at a time (timing). The first --warmup steps of each run are left out; over the rest, a
step's wall time is time/wait_s (the learner waiting for trajectories) + time/step_s (proximal pass,
update and weight push). steps_per_hour = 3600 * steps / that sum; steps_per_hour_e2e divides by the whole
run's wall time instead (process start, evaluation at start and end, checkpoint, export included).
rollout_share = wait / wall: the share of the learner's wall time spent waiting for rollout (in async mode
generation also overlaps the update, so this is the part that did not overlap); push_share =
sync/seconds / wall (gather, quantize, hand to ZeroMQ); train_share is the rest. Ratios async/sync are
computed between rows of this run. Resumable like ablation.py: delete the runs folder to measure again.

    python benchmarks/pipeline.py [--steps 60] [--warmup 5] [--out results/pipeline.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_runs import QUICK, Run, demo, demo_overrides, read_run, run_all  # noqa: E402

QUANTS = ("int8", "none")
STALENESS = (0, 1, 2, 4)


def measure(row: dict, warmup: int) -> dict:
    """Steps per hour and time shares from one run's per-step curves."""
    c = row["curves"]
    keep = [i for i, s in enumerate(c["step"]) if s > warmup]
    wait = [c["time/wait_s"][i] or 0.0 for i in keep]
    step = [c["time/step_s"][i] or 0.0 for i in keep]
    sync = [c["sync/seconds"][i] or 0.0 for i in keep]
    wall = sum(wait) + sum(step)
    if not keep or wall <= 0:
        return {"measured_steps": 0}
    return {
        "measured_steps": len(keep),
        "steps_per_hour": 3600 * len(keep) / wall,
        "steps_per_hour_e2e": 3600 * row["steps"] / row["wall_s"] if row["wall_s"] else None,
        "rollout_share": sum(wait) / wall,
        "push_share": sum(sync) / wall,
        "train_share": (sum(step) - sum(sync)) / wall,
        "wait_s_median": statistics.median(wait),
        "step_s_median": statistics.median(step),
        "sync_s_median": statistics.median(sync),
        "staleness_mean": statistics.fmean(c["staleness/mean"][i] or 0.0 for i in keep),
    }


def ratios(rows: list[dict]) -> dict:
    """steps_per_hour async / sync per quant and staleness, and int8 / none per staleness."""
    sph = {(r["quant"], r["max_staleness"]): r.get("steps_per_hour") for r in rows}
    out: dict = {"async_over_sync": {}, "int8_over_none": {}}
    for (quant, ms), value in sph.items():
        base = sph.get((quant, 0))
        if ms > 0 and value and base:
            out["async_over_sync"][f"{quant}/staleness{ms}"] = round(value / base, 3)
        other = sph.get(("none", ms))
        if quant == "int8" and value and other:
            out["int8_over_none"][f"staleness{ms}"] = round(value / other, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pipeline.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of the rates")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--runs-dir", default=os.path.join("runs", "pipeline"))
    p.add_argument("--demo-dir", default=None)
    p.add_argument("--quick", action="store_true", help="int8 only, staleness 0 and 1, 4 steps, small batches")
    args = p.parse_args(argv)
    if args.steps <= args.warmup or args.warmup < 0:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) >= 0")
    quants, staleness = (("int8",), (0, 1)) if args.quick else (QUANTS, STALENESS)
    if args.quick:
        args.steps, args.warmup = 4, 1
    root, info = demo("add", args.demo_dir)
    base = demo_overrides(root, info) + (QUICK if args.quick else ["eval.max_problems=32"])
    runs = [
        Run(
            f"{q}-stale{ms}",
            0,
            base + [f"rollout.quant={q}", f"async.max_staleness={ms}"],
            args.steps,
            os.path.abspath(os.path.join(args.runs_dir, f"{q}-stale{ms}")),
            ["eval.every=0", "checkpoint.every=0"],
        )
        for q in quants
        for ms in staleness
    ]
    started = time.time()
    failed = run_all(runs, parallel=1, desc="pipeline")
    rows = []
    for run, quant_ms in zip(runs, [(q, ms) for q in quants for ms in staleness]):
        got = read_run(run)
        rows.append(
            {
                "quant": quant_ms[0],
                "max_staleness": quant_ms[1],
                "steps": got["steps"],
                "ok": got["ok"],
                "wall_s": got["wall_s"],
                **measure(got, args.warmup),
            }
        )
    from common import machine_info

    result = {
        "benchmark": "pipeline",
        "machine": machine_info(),
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": rows,
        "ratios": ratios(rows),
        "failed": failed,
        "wall_s": round(time.time() - started, 1),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
