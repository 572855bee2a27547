"""What every benchmark reports about the machine it ran on (design.md §9)."""

from __future__ import annotations

import json
import os
import platform

import torch


def machine_info(**extra: str) -> dict:
    """CPU model, core count, GPU, torch and Python versions, plus any library versions the caller adds."""
    cpu = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        flags = set(next(line.split(":", 1)[1] for line in info if line.startswith("flags")).split())
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        # the instructions bf16 and int8 kernels run on: the CPU kinds differ several-fold there
        "cpu_isa": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags],
        "cores": os.cpu_count(),
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        **extra,
    }


# The GPU recipes' models' shapes (config.json of DeepSeek-R1-Distill-Qwen-1.5B and Qwen2.5-7B), layers left to the
# benchmark: what grows with hidden size and vocabulary is measured at these, with fewer layers.
QWEN2_15B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=False,
)
QWEN25_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)

# The ~150M-parameter random Qwen2 that the CPU speed benchmarks share (hidden 1024, 8 layers).
QWEN2_150M = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=2816,
    vocab_size=32000,
)


# config -> (quant, model dtype, int8 lm_head). "+bf16": quantized linears with bf16 embeddings, norms, lm_head and
# KV cache; "+head": logits from an int8 copy of the lm_head (quant.lm_head)
OWN = {
    "fp32": ("none", "float32", False),
    "bf16": ("none", "bfloat16", False),
    "int8": ("int8", "float32", False),
    "int8+head": ("int8", "float32", True),
    "int8+bf16": ("int8", "bfloat16", False),
    "int8+bf16+head": ("int8", "bfloat16", True),
    "fp8": ("fp8", "float32", False),  # fp8 = 128x128 block scales
    "fp8+bf16": ("fp8", "bfloat16", False),
    "fp8-channel+bf16": ("fp8-channel", "bfloat16", False),  # the torch._scaled_mm path on CUDA
}


def step_bytes(engine) -> int:
    """Weight bytes one decode step streams: every projection's buffers and the lm_head (or its int8 copy)."""
    model = engine.model
    linears = [lin for layer in model.layers for lin in layer.linears]
    head = [model.head.weight, model.head.scale] if model.head is not None else [model.lm_head]
    return sum(t.nbytes for lin in linears for t in lin.named.values()) + sum(t.nbytes for t in head)


def emit(result: dict, out: str | None) -> None:
    """Print the benchmark's JSON on stdout and, with --out, also write it to that file."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
