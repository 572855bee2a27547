"""Results summary (issue 9): the JSON of the speed benchmarks and the demo experiments, collected into one page.

Reads RESULTS_DIR/NAME.json for each benchmark below (design.md §9 form) and writes one section per
benchmark: the command that produced it, the machine it ran on, and its rows (the experiments: their
per-config summary) as a table (scalar fields only), plus top-level ratios where the benchmark reports
them. A benchmark whose script is not in this checkout is skipped; one whose JSON is missing gets a
"not run yet" line with its command. --run first runs every present script whose JSON is missing (add
--quick for their small versions).

    python benchmarks/summary.py [--results results] [--out benchmarks/RESULTS.md] [--run [--quick]]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# name (of the JSON), script, extra flags, what it measures; the speed benchmarks take --out FILE, the demo
# experiments --out FOLDER and show their per-config "summary" instead of their rows.
BENCHMARKS = (
    (
        "rollout_throughput",
        "rollout_throughput",
        [],
        "decode tokens/s of the embedded engine per weight format, against transformers",
    ),
    ("decode-cpu", "decode", [], "INT8 against bf16 decode on CPU with the CPU kernels, against the byte limit"),
    ("wire", "wire", [], "trajectory messages/s and weight-push MB/s over ZeroMQ"),
    ("learner_step", "learner_step", [], "learner step time, tokens/s, weight-push seconds and bytes per quantization"),
    ("sync", "sync", [], "weight-push cost, full against delta pushes"),
    ("pipeline", "pipeline", [], "end-to-end learner steps per hour, async against sync, int8 against none"),
    ("ablation", "ablation", [], "final held-out accuracy per rollout format and correction, mean over seeds"),
    ("ablation-stress", "ablation", ["--stress"], "the same at 4-bit int weights on the longer sum-steps task"),
    ("scaling", "scaling_study", [], "int8 codes changed per push and mismatch, per invariant scaling factor"),
)
EXPERIMENTS = ("ablation", "scaling_study")


def command(name: str, script: str, flags: list[str], results: str, quick: bool = False) -> list[str]:
    out = results if script in EXPERIMENTS else os.path.join(results, f"{name}.json")
    return [sys.executable, os.path.join(HERE, f"{script}.py"), *flags, *(["--quick"] if quick else []), "--out", out]


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def table(rows: list[dict]) -> list[str]:
    """A Markdown table of the rows' scalar fields, columns in first-seen order."""
    cols = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (dict, list))))
    if not cols:
        return []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def section(name: str, script: str, flags: list[str], what: str, results: str) -> list[str]:
    """The Markdown of one benchmark: heading, command, machine, table (or why there is none)."""
    shown = " ".join(["python", f"benchmarks/{script}.py", *command(name, script, flags, results)[2:]])
    lines = [f"## {name}", "", what + ".", ""]
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(os.path.join(HERE, f"{script}.py")):
        return lines + [f"Not in this checkout (benchmarks/{script}.py is missing).", ""]
    if not os.path.exists(path):
        return lines + [f"Not run yet: `{shown}`", ""]
    with open(path) as f:
        data = json.load(f)
    machine = data.get("machine", {})
    lines += [
        f"Command: `{shown}`",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if v is not None),
        "",
    ]
    if data.get("wall_s") is not None:
        lines += [f"Wall time: {data['wall_s']:.0f} s", ""]
    lines += table(data.get("summary" if script in EXPERIMENTS else "rows", [])) + [""]
    for key, value in data.items():
        if key in ("ratios", "speedups") and isinstance(value, dict):
            lines += [f"{key}: `{json.dumps(value)}`", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="summary.py", description=__doc__.splitlines()[0])
    p.add_argument("--results", default="results", help="folder holding NAME.json")
    p.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--run", action="store_true", help="run each present benchmark whose JSON is missing")
    p.add_argument("--quick", action="store_true", help="with --run: the benchmarks' --quick versions")
    args = p.parse_args(argv)
    os.makedirs(args.results, exist_ok=True)
    failed = []
    for name, script, flags, _ in BENCHMARKS:
        present = os.path.exists(os.path.join(HERE, f"{script}.py"))
        if args.run and present and not os.path.exists(os.path.join(args.results, f"{name}.json")):
            print(f"summary: running {name}", file=sys.stderr)
            done = subprocess.run(command(name, script, flags, args.results, args.quick), stdout=subprocess.DEVNULL)
            if done.returncode != 0:
                failed.append(name)
    lines = [
        "# Benchmark results",
        "",
        "Written by `python benchmarks/summary.py`; each section names the command that produced its numbers.",
        "Timings on shared machines are noisy: compare ratios measured in the same run, not absolute values.",
        "",
    ]
    for name, script, flags, what in BENCHMARKS:
        lines += section(name, script, flags, what, args.results)
    with open(args.out, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"summary: wrote {args.out}" + (f"; these failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
