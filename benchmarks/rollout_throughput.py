"""Rollout throughput of the embedded engine (fp32 / bf16 / INT8 / FP8) against transformers `generate`,
and continuous against static batching on RL-shaped response lengths (tokens_per_s counts response tokens).

    python benchmarks/rollout_throughput.py [--quick] [--device cuda] [--threads 2] [--out FILE]

Prints one JSON object (design.md section 9). Configurations are measured round-robin, one repeat of
each per round, so that load from other processes spreads over all of them; rows hold medians.
`byte_limits`: a decode step streams every weight once, so the ratio of two configs' weight bytes per step
bounds their speed ratio; each entry gives that limit, the share of it measured, and (CPU) the same ratio over
GEMM time alone (one profiled run per config, `gemm_share`), which separates the kernels from per-step overhead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import OWN, QWEN2_150M, emit, machine_info, step_bytes  # noqa: E402  (benchmarks/common.py)

from rollout_server.engines import GenRequest, load_engine  # noqa: E402

FULL = QWEN2_150M
QUICK = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
)
HF = {"hf-fp32": torch.float32, "hf-bf16": torch.bfloat16}


def build_model(path: str, quick: bool) -> int:
    """Random-init Qwen2 saved as a HF folder; returns its parameter count."""
    torch.manual_seed(0)
    cfg = Qwen2Config(
        **(QUICK if quick else FULL),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


GEMM_OPS = (
    "mkldnn::_linear_pointwise",
    "onednn::qlinear_pointwise",
    "aten::mm",
    "aten::addmm",
    "aten::_int_mm",
    "qurl::int8_gemm",
)


def gemm_share(fn) -> float:
    """Share of one run's operator time spent in weight GEMMs (torch.profiler, CPU): the rest is per-step overhead."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    ops = prof.key_averages()
    total = sum(k.self_cpu_time_total for k in ops)
    return sum(k.self_cpu_time_total for k in ops if k.key in GEMM_OPS) / total if total else 0.0


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


def own_decode(engine, batch: int, prompt_len: int, new_tokens: int, vocab: int):
    reqs = [
        GenRequest(p, max_new_tokens=new_tokens, temperature=1.0, seed=i)
        for i, p in enumerate(prompts(batch, prompt_len, vocab, batch))
    ]
    return lambda: engine.generate(reqs)


def hf_decode(model, batch: int, prompt_len: int, new_tokens: int, vocab: int, device: str):
    ids = torch.tensor(prompts(batch, prompt_len, vocab, batch), device=device)
    kw = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=0,
    )
    return lambda: model.generate(ids, **kw)


def rl_lengths(n: int, quick: bool) -> list[int]:
    """Most responses short, a tail running into the cap: 8 + geometric(mean 80), capped at 256."""
    rng = random.Random(1)
    lo, hi, mean = (2, 16, 6) if quick else (8, 256, 80)
    return [min(hi, lo + int(rng.expovariate(1 / mean))) for _ in range(n)]


def rl_runs(engine, lengths: list[int], max_batch: int, prompt_len: int, vocab: int):
    """Continuous batching against two static baselines that admit `max_batch` requests and wait for all of them:
    "static" keeps every row computing until the batch's longest response ends (a fixed batch, as in
    transformers `generate`), "static-shrink" lets finished rows leave the batch early."""
    reqs = [
        GenRequest(p, max_new_tokens=n, temperature=1.0, seed=i)
        for i, (p, n) in enumerate(zip(prompts(len(lengths), prompt_len, vocab, 7), lengths))
    ]
    chunks = [reqs[i : i + max_batch] for i in range(0, len(reqs), max_batch)]

    def static():  # per-row seeds: each row's first max_new_tokens tokens are the ones it would make alone
        for chunk in chunks:
            longest = max(r.max_new_tokens for r in chunk)
            engine.generate([dataclasses.replace(r, max_new_tokens=longest) for r in chunk])

    def static_shrink():
        for chunk in chunks:
            engine.generate(chunk)

    return {"continuous": lambda: engine.generate(reqs), "static": static, "static-shrink": static_shrink}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and few tokens (for tests)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    ap.add_argument("--rl-repeats", type=int, default=None, help="repeats of the RL workload (default: --repeats)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode tokens per sequence (default 64)")
    ap.add_argument("--batches", default=None, help="comma-separated decode batch sizes (default 1,16,64)")
    ap.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated subset of {','.join([*OWN, *HF])} (default: all on CUDA; no fp8 on CPU)",
    )
    ap.add_argument("--rl-requests", type=int, default=None, help="requests in the RL workload (default 64; 0: skip)")
    ap.add_argument("--rl-config", default="int8", choices=list(OWN), help="engine config of the RL workload")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    q = args.quick
    repeats = args.repeats or (1 if q else 3)
    rl_repeats = args.rl_repeats or repeats
    new_tokens = args.new_tokens or (4 if q else 64)
    batches = [int(b) for b in (args.batches or ("1,4" if q else "1,16,64")).split(",")]
    # on CPU fp8 is a correctness path (~0.5 s per step to dequantize the weights): ask for it with --configs
    default = (
        [*OWN, *HF]
        if args.device == "cuda"
        else ["fp32", "bf16", "int8", "int8+head", "int8+bf16", "int8+bf16+head", *HF]
    )
    configs = (args.configs or ",".join(default)).split(",")
    unknown = [c for c in configs if c not in OWN and c not in HF]
    if unknown:
        ap.error(f"unknown config {unknown[0]!r}; allowed: {', '.join([*OWN, *HF])}")
    prompt_len, rl_batch = (4, 4) if q else (16, 16)
    rl_n = args.rl_requests if args.rl_requests is not None else (8 if q else 64)
    lengths = rl_lengths(rl_n, q)
    max_seq = prompt_len + max([new_tokens, *lengths]) + 1

    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        params = build_model(tmp, q)
        vocab = (QUICK if q else FULL)["vocab_size"]
        common = dict(model_params=params, threads=args.threads, device=args.device)
        runs: dict[tuple, tuple[dict, object]] = {}
        warmups = []
        for name in configs:
            if name in OWN:
                quant, dtype, head = OWN[name]
                engine = load_engine(
                    tmp,
                    quant=quant,
                    dtype=dtype,
                    int8_lm_head=head,
                    device=args.device,
                    max_batch=max(batches + [rl_batch]),
                    max_seq_len=max_seq,
                )
                warmups.append(own_decode(engine, max(batches), prompt_len, 2, vocab))
                for b in batches:
                    row = dict(
                        config=name,
                        engine="qurl",
                        dtype=name.split("+")[0].split("-")[0],
                        model_dtype=dtype,
                        quant=quant,
                        int8_lm_head=head,
                        weight_bytes_per_step=step_bytes(engine),
                        batch=b,
                        workload="decode",
                        prompt_len=prompt_len,
                        new_tokens=new_tokens,
                        **common,
                    )
                    runs[(name, b)] = (row, own_decode(engine, b, prompt_len, new_tokens, vocab))
            else:
                model = AutoModelForCausalLM.from_pretrained(tmp, dtype=HF[name]).to(args.device).eval()
                warmups.append(hf_decode(model, max(batches), prompt_len, 2, vocab, args.device))
                for b in batches:
                    row = dict(
                        config=name,
                        engine="hf",
                        dtype=name.split("-")[1],
                        model_dtype=str(HF[name]).split(".")[1],
                        batch=b,
                        workload="decode",
                        prompt_len=prompt_len,
                        new_tokens=new_tokens,
                        **common,
                    )
                    runs[(name, b)] = (row, hf_decode(model, b, prompt_len, new_tokens, vocab, args.device))

        for fn in warmups:  # allocator, kernels, lazy initialisation
            timed(fn, args.device)
        if rl_n:
            quant, dtype, head = OWN[args.rl_config]
            engine = load_engine(
                tmp,
                quant=quant,
                dtype=dtype,
                device=args.device,
                max_batch=rl_batch,
                max_seq_len=max_seq,
                int8_lm_head=head,
            )
            for mode, fn in rl_runs(engine, lengths, rl_batch, prompt_len, vocab).items():
                row = dict(
                    config=args.rl_config,
                    engine="qurl",
                    dtype=args.rl_config.split("+")[0].split("-")[0],
                    model_dtype=dtype,
                    quant=quant,
                    batch=rl_batch,
                    workload="rl",
                    batching=mode,
                    requests=rl_n,
                    response_len_mean=statistics.mean(lengths),
                    response_len_max=max(lengths),
                    response_lens="8 + geometric(mean 80), capped at 256",
                    **common,
                )
                runs[("rl", mode)] = (row, fn)
        times: dict[tuple, list[float]] = {k: [] for k in runs}
        peak: dict[tuple, float] = {}
        for i in range(max(repeats, rl_repeats)):
            for key, (row, fn) in runs.items():
                if i >= (rl_repeats if row["workload"] == "rl" else repeats):
                    continue
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                times[key].append(timed(fn, args.device))
                if args.device == "cuda":
                    peak[key] = max(peak.get(key, 0.0), torch.cuda.max_memory_allocated() / 2**20)
                print(f"# {key}: {times[key][-1]:.2f} s", file=sys.stderr, flush=True)

        shares = {}  # after the timed rounds, on CPU: where a decode step's time goes
        if args.device == "cpu":
            for key, (row, fn) in runs.items():
                if row["engine"] == "qurl" and row["workload"] == "decode":
                    shares[key] = round(gemm_share(fn), 4)

    rows = []
    for key, (row, _) in runs.items():
        tokens = row["batch"] * row["new_tokens"] if row["workload"] == "decode" else sum(lengths)
        seconds = statistics.median(times[key])
        fastest = min(times[key])
        rows.append(
            {
                **row,
                "tokens": tokens,
                "seconds": round(seconds, 4),
                "seconds_min": round(fastest, 4),
                "tokens_per_s": round(tokens / seconds, 2),
                "tokens_per_s_best": round(tokens / fastest, 2),
                "repeats": len(times[key]),
                **({"gemm_share": shares[key]} if key in shares else {}),
                **({"peak_gpu_mb": round(peak[key], 1)} if key in peak else {}),
            }
        )
    result = {
        "benchmark": "rollout_throughput",
        "machine": machine_info(),
        "rows": rows,
        "ratios": ratios(rows, 4 if q else 16),
        # from each row's fastest repeat: on a shared machine, the least disturbed view
        "ratios_best": ratios(rows, 4 if q else 16, "tokens_per_s_best"),
        "byte_limits": byte_limits([r for r in rows if r["workload"] == "decode"], 4 if q else 16),
    }
    emit(result, args.out)
    return result


def ratios(rows: list[dict], batch: int, measure: str = "tokens_per_s") -> dict:
    """Throughput ratios between rows of this run, at decode batch `batch` and on the RL workload."""
    tps = {}
    for r in rows:
        if r["workload"] == "decode" and r["batch"] == batch:
            tps[r["config"]] = r[measure]
        elif r["workload"] == "rl":
            tps[r["batching"]] = r[measure]
    pairs = [
        ("int8", "fp32"),
        ("int8", "bf16"),
        ("int8+bf16", "fp32"),
        ("int8+bf16", "bf16"),
        ("int8+head", "fp32"),
        ("int8+head", "bf16"),
        ("int8+bf16+head", "bf16"),
        ("int8+bf16+head", "fp32"),
        ("bf16", "fp32"),
        ("fp8", "fp32"),
        ("fp8-channel+bf16", "bf16"),
        ("fp32", "hf-fp32"),
        ("bf16", "hf-bf16"),
        ("int8", "hf-fp32"),
        ("int8+bf16", "hf-bf16"),
        ("continuous", "static"),
        ("continuous", "static-shrink"),
    ]
    out = {}
    for a, b in pairs:
        if a in tps and b in tps:
            out[f"{a}/{b}" + ("" if a == "continuous" else f"@batch{batch}")] = round(tps[a] / tps[b], 3)
    return out


def byte_limits(rows: list[dict], batch: int) -> dict:
    """Per own config against fp32 and bf16: the speed-up its weight bytes allow, and the share of it measured."""
    by = {r["config"]: r for r in rows if r.get("weight_bytes_per_step") and r["batch"] == batch}
    out = {}
    for a, ra in by.items():
        for b in ("fp32", "bf16"):
            if b in by and a != b:
                limit = by[b]["weight_bytes_per_step"] / ra["weight_bytes_per_step"]
                got = ra["tokens_per_s"] / by[b]["tokens_per_s"]
                entry = {"limit": round(limit, 3), "share_of_limit": round(got / limit, 3)}
                if ra.get("gemm_share") and by[b].get("gemm_share"):  # the same ratio over GEMM time alone
                    gemm = got * by[b]["gemm_share"] / ra["gemm_share"]
                    entry.update(gemm_only=round(gemm, 3), gemm_only_share_of_limit=round(gemm / limit, 3))
                out[f"{a}/{b}@batch{batch}"] = entry
    return out


if __name__ == "__main__":
    main()
