"""What every benchmark reports about the machine it ran on (design.md §9)."""

from __future__ import annotations

import json
import os
import platform

import torch


def machine_info(**extra: str) -> dict:
    """CPU model, core count, GPU, torch and Python versions, plus any library versions the caller adds."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        **extra,
    }


# The ~150M-parameter random Qwen2 that the CPU speed benchmarks share (hidden 1024, 8 layers).
QWEN2_150M = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=2816,
    vocab_size=32000,
)


def emit(result: dict, out: str | None) -> None:
    """Print the benchmark's JSON on stdout and, with --out, also write it to that file."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
