"""What one eval/acc_fp costs at a recipe's shapes: transformers greedy decode (the evaluator's hf_greedy) of a batch
of held-out prompts, seconds per token at several answer lengths, with `--layers` of the model's layers, extrapolated
to the whole model and to the recipe's answer length.

Per decode step the time is a + l * (b + c * context) for l layers: the head and sampling (a), each layer's weights
(b) and its attention over the KV cache (c per cached token). Runs at two layer counts and three answer lengths fit
a, b and c by least squares; the estimate sums the step time over the recipe's answer (prompt 128 tokens).

    python benchmarks/eval_time.py [--shape 1.5b] [--layers 1,2] [--lengths 64,128,256] [--device cpu] [--out F]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN2_15B, QWEN25_7B, emit, machine_info  # noqa: E402  (benchmarks/common.py)

SHAPES = {  # name -> (config shapes, layers of the real model, the recipe's eval answer length and problems)
    "1.5b": (QWEN2_15B, 28, 8192, 30),
    "7b": (QWEN25_7B, 28, 3072, 30),
    "tiny": (
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
        4,
        256,
        8,
    ),
}
PROMPT = 128


def seconds_per_token(shape: dict, layers: int, length: int, batch: int, device: torch.device) -> float:
    """Mean seconds per generated token of a greedy batch answering `length` tokens after a 128-token prompt."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        **shape,
        num_hidden_layers=layers,
        max_position_embeddings=PROMPT + length + 8,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    ids = torch.randint(3, shape["vocab_size"], (batch, PROMPT), device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=length, min_new_tokens=length, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    assert out.shape[1] == PROMPT + length
    return (time.perf_counter() - started) / length


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Non-negative least-squares a, b, c of t = a + l * (b + c * mean context) over (layers, length, s/token)
    points (every subset of the three terms solved, the best with no negative cost kept: timing noise at small
    shapes would otherwise fit a negative one)."""
    import itertools

    x = torch.tensor([[1.0, k, k * (PROMPT + n / 2)] for k, n, _ in points], dtype=torch.float64)
    y = torch.tensor([[t] for *_, t in points], dtype=torch.float64)
    best, best_err = (0.0, 0.0, 0.0), float("inf")
    for keep in (c for r in (3, 2, 1) for c in itertools.combinations(range(3), r)):
        coef = torch.linalg.lstsq(x[:, list(keep)], y).solution.flatten()
        if (coef < 0).any():
            continue
        full = [0.0, 0.0, 0.0]
        for i, v in zip(keep, coef.tolist()):
            full[i] = v
        err = float(((x @ torch.tensor(full, dtype=torch.float64)[:, None] - y) ** 2).sum())
        if err < best_err:
            best, best_err = tuple(full), err
    return best


def measure(shape_name: str, layers: list[int], lengths: list[int], device: str) -> dict:
    shape, full_layers, answer, problems = SHAPES[shape_name]
    dev = torch.device(device)
    seconds_per_token(shape, layers[0], lengths[0], problems, dev)  # warm-up: the first point ran 10x slow on an H200
    points = [(k, n, seconds_per_token(shape, k, n, problems, dev)) for k in layers for n in lengths]
    a, b, c = fit(points)
    estimate = answer * (a + full_layers * (b + c * (PROMPT + answer / 2)))
    return {
        "shape": shape_name,
        "batch": problems,
        "points": [{"layers": k, "answer_tokens": n, "s_per_token": t} for k, n, t in points],
        "fit_s": {"head": a, "per_layer": b, "per_layer_per_cached_token": c},
        "full_layers": full_layers,
        "answer_tokens": answer,
        "eval_s_estimate": estimate,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--layers", default="1,2")
    p.add_argument("--lengths", default="64,128,256")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out")
    args = p.parse_args(argv)
    row = measure(
        args.shape, [int(x) for x in args.layers.split(",")], [int(x) for x in args.lengths.split(",")], args.device
    )
    emit({"benchmark": "eval_time", "machine": machine_info(), "device": args.device, "rows": [row]}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
