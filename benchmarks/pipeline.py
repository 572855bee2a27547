"""End-to-end pipeline benchmark (issues 9, 20): learner steps per hour, asynchronous against synchronous
(max_staleness 0), with int8 and with full-precision rollout, through qurl-async.

Workloads: `demo` (default; the CPU demo, staleness 0, 1, 2, 4: its learner dominates) and `real`, shaped like
RL rollout: the SmolLM2-135M / GSM recipe (configs/smollm2-gsm-cpu.yaml, prepared by qurl-prepare-real) with
8 samples per prompt, up to 256 new tokens, 2 prompts per step, one update per step, no evaluation or
checkpoints; rows int8 and none in fp32 at sync and staleness 1, none with a bf16 model (the fair
16-bit baseline), and int8 with bf16 activations and the int8 lm_head (`int8+bf16+head`, INT8 at its fastest
decode), each at sync and staleness 1. --formats picks some of them.

The runs go one at a time (timing). The first --warmup steps of each run are left out; over the rest, a
step's wall time is time/wait_s (the learner waiting for trajectories) + time/step_s (proximal pass,
update and weight push). steps_per_hour = 3600 * steps / that sum; steps_per_hour_e2e divides by the whole
run's wall time instead (process start, evaluation at start and end, checkpoint, export included).
rollout_share = wait / wall: the share of the learner's wall time spent waiting for rollout (in async mode
generation also overlaps the update, so this is the part that did not overlap); push_share =
sync/seconds / wall (gather, quantize, hand to ZeroMQ); train_share is the rest. engine_s_per_step is the
rollout server's own time inside engine.step() (its engine_ms counter) per learner step; tokens_per_hour counts the
response tokens trained (actor/tokens) over the same wall. In sync mode the
two processes take turns on the cores, so wait_s is the rollout alone (weight load, generation, scoring,
transfer): ratios.rollout_speedup compares it, and engine_s_per_step, across formats with the learner's
share removed. Ratios are computed between rows of this run. Resumable like ablation.py: delete the runs
folder to measure again.

    python benchmarks/pipeline.py [--workload demo|real] [--steps 60] [--warmup 5] [--out FILE] [--quick]
                                  [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_runs import QUICK, ROOT, Run, demo, demo_overrides, read_run, run_all  # noqa: E402

QUANTS = ("int8", "none")
STALENESS = (0, 1, 2, 4)
REAL_CONFIG = str(ROOT / "configs" / "smollm2-gsm-cpu.yaml")
# (quant, rollout dtype, int8 lm_head, max_staleness) of the real workload
REAL_ROWS = (
    ("int8", "float32", False, 0),
    ("none", "float32", False, 0),
    ("int8", "float32", False, 1),
    ("none", "float32", False, 1),
    ("none", "bfloat16", False, 0),
    # issue 33: INT8 as fast as it decodes (bf16 activations, the int8 lm_head) against bf16 rollout
    ("none", "bfloat16", False, 1),
    ("int8", "bfloat16", True, 0),
    ("int8", "bfloat16", True, 1),
)
REAL_SHAPE = [
    "rollout.n_samples=8",
    "rollout.sampling.max_new_tokens=256",
    "rollout.max_seq_len=576",  # prompts <= 320 tokens + 256 new
    "train.batch_prompts=2",
    "train.mini_batches=1",
    "data.eval_files=[]",
]
REAL_QUICK = ["rollout.n_samples=2", "rollout.sampling.max_new_tokens=16", "train.batch_prompts=1"]


def label(quant: str, dtype: str, head: bool = False) -> str:
    """int8, none, none+bf16, int8+bf16+head, ...: the rollout format of a row."""
    name = quant if dtype == "float32" else f"{quant}+{'bf16' if dtype == 'bfloat16' else dtype}"
    return name + "+head" if head else name


def measure(row: dict, warmup: int) -> dict:
    """Steps per hour, time shares and the server's own generation time from one run's per-step curves."""
    c = row["curves"]
    keep = [i for i, s in enumerate(c["step"]) if s > warmup]
    wait = [c["time/wait_s"][i] or 0.0 for i in keep]
    step = [c["time/step_s"][i] or 0.0 for i in keep]
    sync = [c["sync/seconds"][i] or 0.0 for i in keep]
    wall = sum(wait) + sum(step)
    if not keep or wall <= 0:
        return {"measured_steps": 0}
    engine = c.get("servers/engine_ms") or []
    first, last = keep[0] - 1, keep[-1]
    engine_s = (
        (engine[last] - engine[first]) / 1000 / len(keep)
        if first >= 0 and last < len(engine) and engine[first] is not None and engine[last] is not None
        else None
    )
    lengths = [c["rollout/response_len_mean"][i] for i in keep if c.get("rollout/response_len_mean")]
    # trained response tokens: what the servers sent arrives in bursts that straddle steps under staleness
    tokens = sum(c["actor/tokens"][i] or 0 for i in keep) if c.get("actor/tokens") else 0
    per_token = lambda seconds: 1000 * seconds * len(keep) / tokens if tokens and seconds is not None else None  # noqa: E731
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
        "wait_s_mean": sum(wait) / len(keep),
        "step_s_mean": sum(step) / len(keep),
        "engine_s_per_step": engine_s,
        "response_tokens": tokens,
        "tokens_per_hour": 3600 * tokens / wall,
        "engine_ms_per_token": per_token(engine_s),
        "wait_ms_per_token": per_token(sum(wait) / len(keep)),
        "response_len_mean": statistics.fmean(x for x in lengths if x is not None) if lengths else None,
        "staleness_mean": statistics.fmean(c["staleness/mean"][i] or 0.0 for i in keep),
        # the share of the step the learner held its servers' cores (learner/core_lending.py; absent: it never could)
        "cores_lent_frac": statistics.fmean(c["perf/cores_lent_frac"][i] or 0.0 for i in keep)
        if any(v is not None for v in c.get("perf/cores_lent_frac") or [])
        else None,
    }


def ratios(rows: list[dict]) -> dict:
    """steps_per_hour async / sync per format and staleness, each format over fp32 `none` per staleness, and
    (sync rows) the rollout's own speed-up over fp32 `none`: its wait and its engine time per step."""
    by = {(label(r["quant"], r["dtype"], r.get("lm_head", False)), r["max_staleness"]): r for r in rows}
    out: dict = {"async_over_sync": {}, "int8_over_none": {}, "over_fp32_none": {}, "rollout_speedup": {}}
    for (fmt, ms), row in by.items():
        value, base, fp32 = row.get("steps_per_hour"), by.get((fmt, 0), {}), by.get(("none", ms), {})
        if ms > 0 and value and base.get("steps_per_hour"):
            out["async_over_sync"][f"{fmt}/staleness{ms}"] = round(value / base["steps_per_hour"], 3)
        if fmt != "none" and value and fp32.get("steps_per_hour"):
            out["over_fp32_none"][f"{fmt}/staleness{ms}"] = round(value / fp32["steps_per_hour"], 3)
            if row.get("tokens_per_hour") and fp32.get("tokens_per_hour"):
                out["over_fp32_none"][f"{fmt}/staleness{ms}/tokens"] = round(
                    row["tokens_per_hour"] / fp32["tokens_per_hour"], 3
                )
            if fmt == "int8":
                out["int8_over_none"][f"staleness{ms}"] = round(value / fp32["steps_per_hour"], 3)
        if ms == 0 and fmt != "none" and fp32.get("measured_steps"):
            for key in ("wait_s_mean", "engine_s_per_step", "wait_ms_per_token", "engine_ms_per_token"):
                if row.get(key) and fp32.get(key):
                    out["rollout_speedup"][f"{fmt}/{key}"] = round(fp32[key] / row[key], 3)
    for ms in STALENESS:  # issue 33: INT8 at its fastest against bf16 rollout, steps and tokens per hour
        a, b = by.get(("int8+bf16+head", ms), {}), by.get(("none+bf16", ms), {})
        if a.get("steps_per_hour") and b.get("steps_per_hour"):
            out.setdefault("int8_bf16_head_over_none_bf16", {})[f"staleness{ms}"] = {
                "steps_per_hour": round(a["steps_per_hour"] / b["steps_per_hour"], 3),
                "tokens_per_hour": round(a["tokens_per_hour"] / b["tokens_per_hour"], 3)
                if a.get("tokens_per_hour") and b.get("tokens_per_hour")
                else None,
            }
    a, b = by.get(("int8", 0), {}), by.get(("none+bf16", 0), {})
    if a.get("steps_per_hour") and b.get("steps_per_hour"):  # int8 (fp32 activations) against the 16-bit baseline
        out["int8_over_none_bf16"] = {
            "steps_per_hour": round(a["steps_per_hour"] / b["steps_per_hour"], 3),
            "rollout_wait_speedup": round(b["wait_s_mean"] / a["wait_s_mean"], 3),
            "engine_ms_per_token_speedup": round(b["engine_ms_per_token"] / a["engine_ms_per_token"], 3)
            if a.get("engine_ms_per_token") and b.get("engine_ms_per_token")
            else None,
        }
    return out


def demo_runs(args: argparse.Namespace) -> list[tuple[tuple[str, str, bool, int], Run]]:
    quants, staleness = (("int8",), (0, 1)) if args.quick else (QUANTS, STALENESS)
    root, info = demo("add", args.demo_dir)
    base = demo_overrides(root, info) + (QUICK if args.quick else ["eval.max_problems=32"]) + args.set
    return [
        (
            (q, "float32", False, ms),
            Run(
                f"{q}-stale{ms}",
                0,
                base + [f"rollout.quant={q}", f"async.max_staleness={ms}"],
                args.steps,
                os.path.abspath(os.path.join(args.runs_dir, f"{q}-stale{ms}")),
                ["eval.every=0", "checkpoint.every=0"],
            ),
        )
        for q in quants
        for ms in staleness
    ]


def real_runs(args: argparse.Namespace) -> list[tuple[tuple[str, str, bool, int], Run]]:
    from qurl.real.prepare import MODEL_DIR, default_root, read_info

    root = default_root().resolve()
    if read_info(root) is None:
        raise SystemExit(f"pipeline.py: no real track at {root}; run qurl-prepare-real (or set QURL_REAL_DIR)")
    base = [f"model.path={root / MODEL_DIR}", f"data.train_files=[{root / 'gsm' / 'train.jsonl'}]", *REAL_SHAPE]
    if args.quick:
        base += REAL_QUICK
    base += args.set
    rows = [r for r in REAL_ROWS if r[0] == "int8" and r[1] == "float32"] if args.quick else REAL_ROWS
    rows = [r for r in rows if args.staleness is None or r[3] in args.staleness]
    rows = [r for r in rows if args.formats is None or label(*r[:3]) in args.formats]
    return [
        (
            (q, dtype, head, ms),
            Run(
                f"real-{label(q, dtype, head)}-stale{ms}",
                0,
                base
                + [f"rollout.quant={q}", f"rollout.dtype={dtype}", f"quant.lm_head={str(head).lower()}"]
                + [f"async.max_staleness={ms}"],
                args.steps,
                os.path.abspath(os.path.join(args.runs_dir, f"real-{label(q, dtype, head)}-stale{ms}")),
                ["checkpoint.every=0"],
                config=REAL_CONFIG,
            ),
        )
        for q, dtype, head, ms in rows
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pipeline.py", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="demo", choices=("demo", "real"), help="demo task or the real recipe")
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (default: demo 60, real 4)")
    p.add_argument("--warmup", type=int, default=None, help="first steps of each run left out (demo 5, real 1)")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--runs-dir", default=os.path.join("runs", "pipeline"))
    p.add_argument("--demo-dir", default=None)
    p.add_argument(
        "--staleness", type=int, nargs="+", default=None, help="real workload: only the rows at these max_staleness"
    )
    p.add_argument(
        "--formats", nargs="+", default=None, help="real workload: only these formats (int8, none+bf16, int8+bf16+head)"
    )
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for every run (cluster.lend_idle_cores=false)",
    )
    p.add_argument("--lock", default=None, help="hold an flock on this file during each run (shared machines)")
    p.add_argument("--quick", action="store_true", help="int8 (fp32) only, staleness 0 and 1, 4 steps, small batches")
    args = p.parse_args(argv)
    real = args.workload == "real"
    if args.quick:
        args.steps, args.warmup = 4, 1
    args.steps = args.steps if args.steps is not None else (4 if real else 60)
    args.warmup = args.warmup if args.warmup is not None else (1 if real else 5)
    if args.steps <= args.warmup or args.warmup < 0:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) >= 0")
    runs = real_runs(args) if real else demo_runs(args)
    started = time.time()
    failed = run_all([run for _, run in runs], parallel=1, desc="pipeline", lock=args.lock)
    rows = []
    for (quant, dtype, head, ms), run in runs:
        got = read_run(run)
        rows.append(
            {
                "quant": quant,
                "dtype": dtype,
                "lm_head": head,
                "max_staleness": ms,
                "steps": got["steps"],
                "ok": got["ok"],
                "wall_s": got["wall_s"],
                **measure(got, args.warmup),
            }
        )
    from common import machine_info

    result = {
        "benchmark": "pipeline",
        "workload": args.workload,
        "machine": machine_info(),
        "steps": args.steps,
        "warmup": args.warmup,
        "set": args.set,
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
