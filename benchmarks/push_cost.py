"""What one weight push costs learner rank 0 at the GPU recipes' shapes: the push before issue 29 (gather the full fp32
state to the host, quantize it there) against the push now (each parameter gathered and quantized on the device, only
codes and scales to the host), both followed by the checksum and the delta against the version before.

Each case runs in processes of its own (FSDP2 over two gloo ranks, random weights of the recipe's shapes; rank 0's
peak RSS is reported) and pushes two versions (the second after a small weight update, as a delta of the first) and
reports the second's seconds per phase and the process's peak RSS above the model. Models with 1 and 2 decoder
layers separate the per-layer cost from the embedding and head, and the figures are extrapolated to 28 layers.
On a CPU the device is the host, so the quantization itself is no faster here; what the device path removes from
rank 0's host is the full fp32 copy (the RSS column).

    python benchmarks/push_cost.py [--shapes 1.5b,7b] [--layers 1,2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN2_15B, QWEN25_7B, emit, machine_info  # noqa: E402  (benchmarks/common.py)

SHAPES = {  # name -> (Qwen2 shapes, the recipe's scheme, its layers)
    "1.5b": (QWEN2_15B, "int8", 28),
    "7b": (QWEN25_7B, "fp8-block", 28),
    "tiny": (
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
        "int8",
        4,
    ),
}


RANKS = 2


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank: int, port: int, path: str, shape_name: str, layers: int, queue) -> None:
    """One of two gloo ranks of an FSDP2 model: two pushes through `path`; rank 0 reports the second one's costs."""
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner import checkpoint
    from learner.model import shard
    from learner.weight_sync.tensors import engine_tensors, gather_engine_tensors
    from qurl.wire import delta

    torch.set_num_threads(1)
    shape, scheme, _ = SHAPES[shape_name]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    torch.manual_seed(0)
    model = shard(Qwen2ForCausalLM(Qwen2Config(**shape, num_hidden_layers=layers)), bf16=False)
    params = sum(p.numel() for p in model.parameters())  # global (DTensor) sizes
    base = rss_mb()
    previous, phases = None, {}
    for version in (1, 2):
        if version == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-6 * torch.randn_like(p))
        dist.barrier()
        t0 = time.perf_counter()
        if path == "before":
            state = checkpoint.full_state_dict(model)  # the full fp32 copy, on rank 0's host
            t1 = time.perf_counter()
            tensors = engine_tensors(state, scheme, 8, torch.bfloat16, tied=False) if rank == 0 else {}
            del state
        else:
            t1 = t0
            tensors = gather_engine_tensors(model, scheme, 8, torch.bfloat16, tied=False, is_main=rank == 0)
        t2 = time.perf_counter()
        if rank == 0:
            delta.checksum(tensors)
        t3 = time.perf_counter()
        if rank == 0 and previous is not None:
            delta.diff(previous, tensors)
        t4 = time.perf_counter()
        phases = {"gather_s": t1 - t0, "quantize_s": t2 - t1, "checksum_s": t3 - t2, "diff_s": t4 - t3}
        previous = tensors
    if rank == 0:
        queue.put(
            {
                "path": path,
                "shape": shape_name,
                "scheme": scheme,
                "layers": layers,
                "ranks": RANKS,
                "params": params,
                **{k: round(v, 3) for k, v in phases.items()},
                "seconds": round(sum(phases.values()), 3),
                "push_bytes": sum(t.nbytes for t in previous.values()),
                "base_mb": round(base, 1),
                "peak_mb": round(rss_mb(), 1),
                "extra_mb": round(rss_mb() - base, 1),
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def run_case(path: str, shape_name: str, layers: int) -> dict:
    """Two gloo ranks (the smallest FSDP2 group that gathers: one rank's full state is its own tensors)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, path, shape_name, layers, queue)) for r in range(RANKS)]
    for p in procs:
        p.start()
    row = queue.get(timeout=3600)
    for p in procs:
        p.join(120)
    return row


def extrapolate(rows: list[dict]) -> list[dict]:
    """Per (path, shape): per-layer cost from the 1- and 2-layer rows, the whole model's at the recipe's layers."""
    out = []
    for path in ("before", "device"):
        for name, (_, scheme, layers) in SHAPES.items():
            pair = {r["layers"]: r for r in rows if r.get("path") == path and r.get("shape") == name and "seconds" in r}
            if 1 not in pair or 2 not in pair:
                continue
            row = {"path": path, "shape": name, "scheme": scheme, "layers": layers, "extrapolated": True}
            for key in ("seconds", "extra_mb", "push_bytes", "params"):
                per_layer = pair[2][key] - pair[1][key]
                row[key] = round(pair[1][key] + (layers - 1) * per_layer, 3)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1.5b,7b")
    p.add_argument("--layers", default="1,2")
    p.add_argument("--paths", default="before,device")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.case:
        path, shape, layers = args.case.split(":")
        print(json.dumps(run_case(path, shape, int(layers))))
        return 0
    rows = []
    for shape in args.shapes.split(","):
        for layers in map(int, args.layers.split(",")):
            for path in args.paths.split(","):
                done = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--case", f"{path}:{shape}:{layers}"],
                    capture_output=True,
                    text=True,
                    env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")),
                )
                if done.returncode != 0:
                    rows.append({"path": path, "shape": shape, "layers": layers, "failed": done.stderr[-300:]})
                else:
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"{path} {shape} {layers}: {rows[-1]}", file=sys.stderr)
    whole = extrapolate(rows)
    ratios = {}
    for name in SHAPES:
        pair = {r["path"]: r for r in whole if r["shape"] == name}
        if len(pair) == 2 and pair["before"]["seconds"] > 0 and pair["before"]["extra_mb"] > 0:
            ratios[name] = {
                "extra_mb_device_over_before": round(pair["device"]["extra_mb"] / pair["before"]["extra_mb"], 3),
                "seconds_device_over_before": round(pair["device"]["seconds"] / pair["before"]["seconds"], 3),
            }
    emit({"benchmark": "push_cost", "machine": machine_info(), "rows": rows + whole, "ratios": ratios}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
