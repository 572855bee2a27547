"""INT8 against bf16 decode on CPU, side by side in one run, each against its byte limit (issue 33).

Models: `smollm2` (the real track's SmolLM2-135M-Instruct, real held-out prompts of the gym and GSM tracks) and
`qwen2-150m` (common.QWEN2_150M, random weights, prompts of the same lengths). For each batch size, every
configuration runs once per round, round-robin, so that load from other processes spreads over all of them;
rows hold medians over rounds. One measurement: all samples admitted in the first engine step (prefill_s, the
prefill and one decode step), then `--new-tokens` - 1 decode steps (decode_tokens_per_s). Configurations are
common.OWN's formats with the CPU kernels (qurl/cpu_kernels.py); `-torch-ops` rows build and run
the engine without them: torch operators and oneDNN's GEMMs, the engine as it is with QURL_CPU_KERNELS=0.
(Before 2026-12-04 they were built with the kernels, so an int8 row kept the kernels' GEMM: results/decode-cpu.json.)

Byte limit: a decode step reads every weight once plus each sequence's KV cache; at the streaming bandwidth
measured in the same run (a sum over a 512 MB buffer) that bounds decode tokens/s. `vs_bf16` is the ratio
to bf16 (with kernels) in the same round.

    python benchmarks/decode.py [--models smollm2,qwen2-150m] [--batches 16,64] [--rounds 3] [--out FILE] [--quick]
    python benchmarks/decode.py --gemm [--out FILE]   # the kernels' int8 GEMM against oneDNN, 1-2,880 rows
    python benchmarks/decode.py --apply [--models smollm2] [--threads 1] [--out FILE]   # one push's re-derivations
    python benchmarks/decode.py --attention [--out FILE]   # the kernels' decode attention against SDPA

--apply: what a push costs the int8+bf16+head engine after its bytes are written (TorchEngine.apply_delta's
model.repack, and the checksum), by part: every int8 linear's re-packs (oneDNN's where the engine keeps a copy for
it, which it does not with AMX or AVX2, whose kernel takes every row count; and the CPU kernels' own where they have
an int8 GEMM, also alone), the int8 lm_head's requantization (by the CPU kernel, as the engine does, and by torch
operators, side by side) and its re-pack. One part after another per round, medians over --rounds.

--attention: decode attention at the decode step's shapes (ATTENTION_SHAPES), the CPU kernel against SDPA with the
additive mask (what the engine runs without the kernels), bf16 and fp32 caches, each layer's cache its own tensor as
in a decode step (so that one step's caches stream from memory where they exceed the last-level cache), sequence
lengths spread over [keys / 2, keys]; milliseconds per layer, and bytes/s of keys and values read.

--quick: a 2-layer random Qwen2 (`tiny`), batch 4, 8 new tokens, one round (the test's run); with --attention, one
tiny shape.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import OWN, QWEN2_150M, emit, machine_info, step_bytes  # noqa: E402  (benchmarks/common.py)

from qurl import cpu_kernels  # noqa: E402
from rollout_server.engines import GenRequest, load_engine, torch_engine  # noqa: E402

CONFIGS = ("bf16", "int8+bf16+head", "int8+head", "int8", "bf16-torch-ops", "int8+bf16+head-torch-ops")


def stream_bandwidth() -> float:
    """Bytes/s of a sum over a buffer far larger than the caches: what a weight stream can reach here."""
    x = torch.ones(256 * 2**20, dtype=torch.bfloat16)
    x.sum()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.nbytes / statistics.median(times)


def smollm2_prompts(batch: int) -> tuple[str, list[list[int]]]:
    from transformers import AutoTokenizer

    from qurl.data import PromptDataset
    from qurl.real.prepare import MODEL_DIR, default_root, read_info

    root = default_root()
    if read_info(root) is None:
        raise SystemExit(f"decode.py: no real track at {root}; run qurl-prepare-real")
    model = str(root / MODEL_DIR)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for track in ("gym", "gsm"):  # the learning recipe's short prompts, then GSM-Symbolic's longer ones
        ds = PromptDataset(str(root / track / "heldout.jsonl"), tok, shuffle=False)
        prompts += [ds[i].prompt_ids for i in range(min(len(ds), batch // 2))]
    return model, [list(prompts[i % len(prompts)]) for i in range(batch)]


TINY = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=512,
)


def random_qwen2(tmp: str, shape: dict, batch: int, prompt_len: int) -> tuple[str, list[list[int]]]:
    """A random-weight Qwen2 of `shape` saved under `tmp` (once), and `batch` random prompts."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = os.path.join(tmp, str(shape["hidden_size"]))
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen2Config(**shape)).save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    vocab = shape["vocab_size"]
    return path, [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def measure(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(seconds of the admitting step, decode tokens/s of the steps after it). Every prompt is admitted in that step,
    past the engine's per-step prefill budget, so that no prefill falls into the decode steps' time (2026-12-05 to
    -07 it did: the budget of 512 prompt tokens admitted 3-4 of 16 prompts per step)."""
    for i, p in enumerate(prompts):
        engine.add_request(GenRequest(p, max_new_tokens=new_tokens, temperature=1.0, seed=i), i)
    budget, torch_engine.PREFILL_TOKENS_PER_STEP = torch_engine.PREFILL_TOKENS_PER_STEP, sys.maxsize
    try:
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
    finally:
        torch_engine.PREFILL_TOKENS_PER_STEP = budget
    if engine.num_waiting:
        raise SystemExit(f"decode.py: {engine.num_waiting} samples not admitted in the first step (batch > slots?)")
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    return t1 - t0, len(prompts) * steps / (time.perf_counter() - t1)


def kv_bytes(engine, prompts: list[list[int]], new_tokens: int) -> int:
    """KV cache bytes the decode steps read per step, on average over the generation."""
    cfg = engine.model.cfg
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.k_cache.element_size()
    return int(sum(len(p) + new_tokens / 2 for p in prompts) * per_token)


def _off(fn, *args):
    """fn(*args) with the CPU kernels hidden: the torch operators they replace."""
    with kernels_off(True):
        return fn(*args)


@contextlib.contextmanager
def kernels_off(off: bool):
    """The CPU kernels hidden from the engine (built and run) inside the block: torch operators and oneDNN's GEMM."""
    saved = cpu_kernels.kernels
    if off:
        cpu_kernels.kernels = lambda: None
    try:
        yield
    finally:
        cpu_kernels.kernels = saved


def run(model: str, prompts: list[list[int]], configs: list[str], rounds: int, new_tokens: int, bw: float) -> list:
    engines = {}
    for name in configs:
        quant, dtype, head = OWN[name.removesuffix("-torch-ops")]
        with kernels_off(name.endswith("-torch-ops")):
            engines[name] = load_engine(
                model,
                quant=quant,
                dtype=dtype,
                max_batch=len(prompts),
                max_seq_len=max(map(len, prompts)) + new_tokens + 1,
                int8_lm_head=head,
            )
    samples = {name: [] for name in configs}
    for _ in range(rounds):
        for name, engine in engines.items():
            with kernels_off(name.endswith("-torch-ops")):
                samples[name].append(measure(engine, prompts, new_tokens))
    rows = []
    for name, engine in engines.items():
        weights, kv = step_bytes(engine), kv_bytes(engine, prompts, new_tokens)
        decode = statistics.median(s[1] for s in samples[name])
        limit = len(prompts) * bw / (weights + kv)
        rows.append(
            {
                "config": name,
                "cpu_kernels": not name.endswith("-torch-ops"),
                "batch": len(prompts),
                "prompt_len_mean": round(statistics.mean(map(len, prompts)), 1),
                "new_tokens": new_tokens,
                "prefill_s": round(statistics.median(s[0] for s in samples[name]), 3),
                "decode_tokens_per_s": round(decode, 1),
                "weight_bytes_per_step": weights,
                "kv_bytes_per_step": kv,
                "byte_limit_tokens_per_s": round(limit, 1),
                "share_of_byte_limit": round(decode / limit, 3),
                "rounds": rounds,
            }
        )
    base = next(r for r in rows if r["config"] == "bf16")
    for r in rows:
        r["vs_bf16"] = round(r["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
        r["prefill_vs_bf16"] = round(base["prefill_s"] / r["prefill_s"], 3)
        r["byte_limit_vs_bf16"] = round(r["byte_limit_tokens_per_s"] / base["byte_limit_tokens_per_s"], 3)
    return rows


GEMM_SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}  # SmolLM2's (N, K)
# decode batches, then prefill: 512 rows is the engine's prefill budget a step (torch_engine.PREFILL_TOKENS_PER_STEP),
# 2,880 more than this benchmark's admitting step (16 SmolLM2 prompts, ~2,150 tokens)
GEMM_ROWS = [1, 16, 32, 64, 128, 256, 512, 2880]


def gemm_rows(shapes: dict, rows: list[int], reps: int) -> list[dict]:
    """The kernels' int8 GEMM against oneDNN's qlinear (what Int8Linear runs without it) at decode row counts, fp32
    activations, one Int8Linear switched between the two, medians of 5 timings of `reps` calls (one call above 256
    rows); the kernel at every row count, also above int8_gemm_max_rows, up to which the engine takes it."""
    from qurl.quant import quantize_int8
    from rollout_server.engines.linear import Int8Linear

    def timed(f, calls: int) -> float:
        f()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(calls):
                f()
            times.append((time.perf_counter() - t) / calls)
        return statistics.median(times)

    out = []
    for name, (n, k) in shapes.items():
        codes, scale = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), dim=-1)
        lin = Int8Linear(["w"], {"w.weight": codes, "w.weight_scale": scale}, torch.float32, torch.device("cpu"))
        kernel = lin._gemm = types.SimpleNamespace(
            int8_pack=cpu_kernels.kernels().int8_pack, int8_gemm_max_rows=sys.maxsize
        )
        lin.use_onednn()  # where the kernel takes every row count the engine keeps no oneDNN copy
        for m in rows:
            x = torch.randn(m, k)
            lin._gemm = kernel
            calls = reps if m <= 256 else 1
            a = timed(lambda: lin(x), calls)
            lin._gemm = None
            b = timed(lambda: lin(x), calls)
            macs = m * n * k
            row = {"shape": name, "n": n, "k": k, "rows": m, "kernel_gmac_per_s": round(macs / a / 1e9, 2)}
            out.append(row | {"onednn_gmac_per_s": round(macs / b / 1e9, 2), "kernel_vs_onednn": round(b / a, 3)})
            print("gemm", out[-1], file=sys.stderr, flush=True)
    return out


def apply_parts(model: str, rounds: int) -> dict:
    """Seconds per part of re-deriving an int8+bf16+head engine's copies after a push (medians over rounds)."""
    from qurl.quant import quantize_int8
    from qurl.wire import delta

    engine = load_engine(model, quant="int8", dtype="bfloat16", max_seq_len=64, int8_lm_head=True)
    m, head = engine.model, engine.model.head
    linears = [lin for layer in m.layers for lin in layer.linears]
    parts = {
        "linears_repack_s": lambda: [lin.repack() for lin in linears],
        "head_quantize_kernel_s": lambda: quantize_int8(head.source),
        "head_quantize_torch_ops_s": lambda: _off(quantize_int8, head.source),
        "head_repack_s": head.repack,
        "checksum_s": lambda: delta.checksum(engine.weights),
        "repack_all_s": lambda: m.repack(list(engine.weights)),  # what apply_delta runs after the write
    }
    if cpu_kernels.kernels().int8_gemm:  # the kernels' own layout of the same codes (in linears_repack_s too)
        pack = cpu_kernels.kernels().int8_pack
        parts["linears_kernel_pack_s"] = lambda: [pack(lin.weight) for lin in linears]
    times: dict[str, list[float]] = {k: [] for k in parts}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, f in parts.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
    out = {k: round(statistics.median(v), 6) for k, v in times.items()}
    out["head_quantize_kernel_speedup"] = round(out["head_quantize_torch_ops_s"] / out["head_quantize_kernel_s"], 2)
    out["head_shape"] = list(head.weight.shape)
    out["int8_linears"] = len(linears)
    return out


# (kv heads, query heads per kv head, head dim, layers timed, batch, keys): SmolLM2-135M's attention at the decode
# benchmark's batches, and Qwen2-7B's (28 heads over 4 kv heads of 128) at the GPU recipes' answer lengths
ATTENTION_SHAPES = {
    "smollm2-b16": (3, 3, 64, 30, 16, 200),
    "smollm2-b64": (3, 3, 64, 30, 64, 200),
    "qwen2-7b-b16": (4, 7, 128, 4, 16, 2000),
}


def attention_rows(rounds: int, shapes: dict = ATTENTION_SHAPES) -> list[dict]:
    """Decode attention per layer, kernel against SDPA, medians over `rounds` passes over every layer."""
    import torch.nn.functional as F

    kernel = cpu_kernels.kernels()
    rows = []
    for name, (kvh, g, d, layers, b, keys) in shapes.items():
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(keys // 2, keys + 1, (b,), generator=gen)
        length = int(lengths.max())
        mask = torch.where(torch.arange(length)[None] < lengths[:, None], 0.0, -torch.inf)[:, None, None]
        for dtype in (torch.bfloat16, torch.float32):
            caches = [
                tuple(torch.randn(b, kvh, length, d, generator=gen).to(dtype) for _ in "kv") for _ in range(layers)
            ]
            q = torch.randn(b, kvh, g, d, generator=gen).to(dtype)
            m = mask.to(dtype)
            ways = {
                "kernel": lambda k, v: kernel.decode_attention(q, k, v, lengths, d**-0.5),
                "sdpa": lambda k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=d**-0.5),
            }
            times = {w: [] for w in ways}
            for _ in range(rounds + 1):  # the first pass warms up
                for w, f in ways.items():
                    t = time.perf_counter()
                    for k, v in caches:
                        f(k, v)
                    times[w].append((time.perf_counter() - t) / layers)
            per_layer = {w: statistics.median(ts[1:]) for w, ts in times.items()}
            read = 2 * int(lengths.sum()) * kvh * d * caches[0][0].element_size()
            row = {"shape": name, "dtype": str(dtype).removeprefix("torch."), "batch": b, "keys_max": keys}
            row |= {"kv_heads": kvh, "group": g, "head_dim": d, "layers": layers}
            row |= {f"{w}_ms_per_layer": round(s * 1e3, 4) for w, s in per_layer.items()}
            row["kernel_bytes_per_s"] = round(read / per_layer["kernel"])
            row["kernel_vs_sdpa"] = round(per_layer["sdpa"] / per_layer["kernel"], 2)
            rows.append(row)
            print("attention", row, file=sys.stderr, flush=True)
    return rows


def prompts_for(model_name: str, tmp: str, batch: int) -> tuple[str, list[list[int]]]:
    if model_name == "smollm2":
        return smollm2_prompts(batch)
    if model_name == "qwen2-150m":
        return random_qwen2(tmp, QWEN2_150M, batch, 200)
    if model_name == "tiny":  # 4 x 200 prompt tokens pass the engine's per-step prefill budget, as real batches do
        return random_qwen2(tmp, TINY, batch, 200)
    raise SystemExit(f"decode.py: unknown model {model_name!r}; choose smollm2, qwen2-150m or tiny")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen2-150m")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gemm", action="store_true", help="only the int8 GEMM against oneDNN at SmolLM2's shapes")
    ap.add_argument("--apply", action="store_true", help="only what one push costs the int8+bf16+head engine, by part")
    ap.add_argument("--attention", action="store_true", help="only decode attention, the kernel against SDPA")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.batches, args.rounds, args.new_tokens = "tiny", "4", 1, 8
    torch.set_num_threads(args.threads)
    if cpu_kernels.kernels() is None:
        raise SystemExit("decode.py: the CPU kernels did not build (see the warning); nothing to compare")
    if args.apply:
        result = {"benchmark": "decode-apply", "machine": machine_info(), "threads": args.threads, "rows": []}
        with tempfile.TemporaryDirectory() as tmp:
            for model_name in args.models.split(","):
                model, _ = prompts_for(model_name, tmp, 2)
                result["rows"].append({"model": model_name, **apply_parts(model, max(args.rounds, 1))})
        emit(result, args.out)
        return result
    if args.attention:
        if not cpu_kernels.kernels().vector_attention:
            raise SystemExit("decode.py --attention: the CPU kernels have no decode attention for this CPU")
        result = {"benchmark": "decode-attention", "machine": machine_info(), "threads": args.threads}
        shapes = {"tiny": (2, 2, 32, 2, 3, 40)} if args.quick else ATTENTION_SHAPES
        result |= {"stream_bytes_per_s": round(stream_bandwidth()), "rows": attention_rows(max(args.rounds, 1), shapes)}
        emit(result, args.out)
        return result
    if args.gemm:
        if not cpu_kernels.kernels().int8_gemm:
            raise SystemExit("decode.py --gemm: the CPU kernels have no int8 GEMM for this CPU")
        gemm = {"benchmark": "decode-gemm", "machine": machine_info(), "int8_gemm": cpu_kernels.kernels().int8_gemm}
        gemm["engine_takes_kernel"] = cpu_kernels.int8_gemm_kernels() is not None
        gemm["rows"] = gemm_rows(GEMM_SHAPES, GEMM_ROWS, 5)
        emit(gemm, args.out)
        return gemm
    bw = stream_bandwidth()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models.split(","):
            for batch in map(int, args.batches.split(",")):
                model, prompts = prompts_for(model_name, tmp, batch)
                for r in run(model, prompts, args.configs.split(","), args.rounds, args.new_tokens, bw):
                    rows.append({"model": model_name, **r})
                    shown = ("config", "batch", "decode_tokens_per_s", "vs_bf16", "prefill_vs_bf16")
                    print(model_name, {k: rows[-1][k] for k in shown}, file=sys.stderr, flush=True)
    kernels = cpu_kernels.kernels()
    result = {
        "benchmark": "decode",
        "machine": machine_info(),
        "stream_bytes_per_s": round(bw),
        "vector_attention": bool(kernels.vector_attention),
        "int8_gemm": kernels.int8_gemm,
        "rows": rows,
    }
    if args.quick and cpu_kernels.int8_gemm_kernels() is not None:
        result["gemm"] = gemm_rows({"tiny": (64, 32)}, [1, 4], 2)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
