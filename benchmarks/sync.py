"""Weight-sync benchmark: full INT8 pushes against delta pushes (qurl/wire/delta.py) after real AdamW steps.

For the demo model (its learning rate, 1.5e-4) and a ~160M random Qwen2 (hidden 1024, 8 layers, untied, as in
rollout_throughput.py; learning rate 1e-6, an RL fine-tuning rate), with invariant scaling s=1, 1.5 and 2 (q/k/v):
train with AdamW on next-token loss over the demo's arithmetic text, build after each step the engine's tensors as
the learner does (learner/weight_sync/tensors.py: int8 codes, the rest in the engine's dtype, per
--engine-dtypes), and per
push and engine dtype report the share of int8 codes that changed, wire bytes of the full and the delta push (all
tensors, and the codes + scales alone), of the push as it was before issue 20 (`codes_only_`: deltas of the codes
and scales only, every other tensor whole) side by side, encode seconds (diff, checksum, protocol encode) and apply
seconds (decode, checks, in-place apply into a TorchEngine of that dtype, checksum). Summary rows give medians and
the mean bytes per push when every full_every-th push is full. Checksum rows time CRC-32 (what qurl.wire.delta uses)
against blake2b on the same tensors (a bf16 engine's push).

    python benchmarks/sync.py [--quick] [--threads 1] [--pushes N] [--engine-dtypes float32,bfloat16] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import zlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN2_150M, emit, machine_info  # noqa: E402  (benchmarks/common.py)

from learner.weight_sync.tensors import engine_tensors  # noqa: E402
from qurl.quant import CODE_DTYPES, SCALE_SUFFIXES  # noqa: E402
from qurl.quant.invariant_scaling import apply_invariant_scaling  # noqa: E402
from qurl.wire import delta  # noqa: E402
from qurl.wire.frames import from_torch  # noqa: E402
from qurl.wire.protocol import WeightPush, decode, encode  # noqa: E402
from rollout_server.engines import load_engine  # noqa: E402

LARGE = QWEN2_150M
QUICK = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
)
DEMO_LR, LARGE_LR = 1.5e-4, 1e-6
SCALED = ("q_proj", "k_proj", "v_proj")  # what invariant scaling divides by s (targets qkv)
SCALES = (1.0, 1.5, 2.0)
FULL_EVERY = 10
ENGINE_DTYPES = ("float32", "bfloat16")
BATCH, SEQ = 8, 32


def demo_dir() -> str:
    path = os.environ.get(
        "QURL_DEMO_DIR",
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "qurl-demo"),
    )
    if not os.path.isfile(os.path.join(path, "model", "config.json")):
        raise SystemExit(f"sync.py: no demo at {path}; run qurl-prepare-demo or set QURL_DEMO_DIR")
    return path


def batches(demo: str, count: int) -> list[torch.Tensor]:
    """[BATCH, SEQ] token batches of the demo's problems and answers, in the demo tokenizer's ids."""
    tok = AutoTokenizer.from_pretrained(os.path.join(demo, "model"))
    with open(os.path.join(demo, "train.jsonl")) as f:
        rows = [json.loads(line) for _, line in zip(range(BATCH * count * 4), f)]
    ids = [i for r in rows for i in tok(f"{r['problem']} {r['answer']}\n")["input_ids"]]
    need = BATCH * SEQ
    return [torch.tensor(ids[k * need : (k + 1) * need]).view(BATCH, SEQ) for k in range(count)]


def random_model(path: str, quick: bool) -> None:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        **(QUICK if quick else LARGE),
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)


def wire_bytes(frames: list) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def codes_and_scales(tensors: dict[str, torch.Tensor]) -> set[str]:
    """Names of the int8 codes and their scales: all that a delta push covered before issue 20."""
    codes = {name for name, t in tensors.items() if t.dtype in CODE_DTYPES}
    return codes | {c + s for c in codes for s in SCALE_SUFFIXES if c + s in tensors}


def code_bytes(push: WeightPush, quant: set[str]) -> int:
    """Bytes of the codes and scales part of a push (whole or as idx / val pairs)."""
    return sum(t.data.nbytes for name, t in push.tensors.items() if name.rpartition("@")[0] in quant or name in quant)


def changed_share(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], names: list[str]) -> float:
    return sum((new[k] != old[k]).sum().item() for k in names) / sum(new[k].numel() for k in names)


def run(
    model_name: str,
    path: str,
    lr: float,
    s: float,
    data: list[torch.Tensor],
    threads: int,
    dtypes: tuple[str, ...] = ENGINE_DTYPES,
) -> list[dict]:
    """Per push and engine dtype: changed share, bytes and seconds of the full and the delta push of one version."""
    model = AutoModelForCausalLM.from_pretrained(path)
    if s != 1.0:
        apply_invariant_scaling(model, s, ("qkv",))
    engines = {dt: load_engine(path, quant="int8", dtype=dt, max_batch=1, max_seq_len=16) for dt in dtypes}
    names = set(next(iter(engines.values())).weights)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def tensors(dtype: str) -> dict[str, torch.Tensor]:
        state = {k: v.detach() for k, v in model.state_dict().items() if k in names}
        return engine_tensors(state, "int8", 8, getattr(torch, dtype), tied=False)

    prev = {dt: tensors(dt) for dt in dtypes}
    for dt, engine in engines.items():
        engine.update_weights(prev[dt], 0)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for version, batch in enumerate(data, start=1):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for dt, engine in engines.items():
            old, new = prev[dt], tensors(dt)
            head = {"kind": "push", "model": model_name, "model_params": params, "lr": lr, "s": s}
            rows.append({**head, "engine_dtype": dt, "threads": threads, **push_row(engine, old, new, version)})
            prev[dt] = new
    return rows


def push_row(engine, prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor], version: int) -> dict:
    """One version's full, delta and codes-only delta push, encoded, and the first two applied into `engine`."""
    quant = codes_and_scales(new)
    codes = [k for k in new if new[k].dtype == torch.int8]
    scaled = [k for k in codes if k.split(".")[-2] in SCALED]
    t0 = time.perf_counter()
    full = WeightPush(
        version=version,
        scheme="int8",
        checksum=delta.checksum(new),
        tensors={k: from_torch(v) for k, v in new.items()},
    )
    full_frames = encode(full, sender="learner", session="s", seq=3 * version)
    t1 = time.perf_counter()
    whole, deltas = delta.diff(prev, new)
    push = delta.delta_push(version, "int8", whole, deltas, delta.checksum(new))
    delta_frames = encode(push, sender="learner", session="s", seq=3 * version + 1)
    t2 = time.perf_counter()
    got = decode(delta_frames, secret=None, max_bytes=1 << 40)
    engine.apply_delta(*delta.split_push(got), version, got.checksum)
    t3 = time.perf_counter()
    got = decode(full_frames, secret=None, max_bytes=1 << 40)
    named, _ = delta.split_push(got)
    assert delta.checksum(named) == got.checksum
    engine.update_weights(named, version)
    t4 = time.perf_counter()
    old = delta.delta_push(version, "int8", *delta.diff({k: prev[k] for k in quant}, new), full.checksum)
    old_bytes = wire_bytes(encode(old, sender="learner", session="s", seq=3 * version + 2))
    return {
        "version": version,
        "changed_frac": changed_share(prev, new, codes),
        "changed_frac_qkv": changed_share(prev, new, scaled),
        "changed_frac_other": changed_share(prev, new, [k for k in codes if k not in scaled]),
        "delta_tensors": len(deltas),
        "full_bytes": wire_bytes(full_frames),
        "delta_bytes": wire_bytes(delta_frames),
        "bytes_ratio": wire_bytes(delta_frames) / wire_bytes(full_frames),
        "codes_only_delta_bytes": old_bytes,
        "codes_only_bytes_ratio": old_bytes / wire_bytes(full_frames),
        "full_code_bytes": code_bytes(full, quant),
        "delta_code_bytes": code_bytes(push, quant),
        "code_bytes_ratio": code_bytes(push, quant) / code_bytes(full, quant),
        "full_encode_s": t1 - t0,
        "delta_encode_s": t2 - t1,
        "delta_apply_s": t3 - t2,
        "full_apply_s": t4 - t3,
    }


def summaries(rows: list[dict]) -> list[dict]:
    """One summary per engine dtype of one (model, s) run's push rows."""
    dtypes = dict.fromkeys(r["engine_dtype"] for r in rows)
    return [summary([r for r in rows if r["engine_dtype"] == dt]) for dt in dtypes]


def summary(rows: list[dict]) -> dict:
    """Medians over the pushes of one (model, s, engine dtype), and mean wire bytes per push with every
    FULL_EVERY-th full (also for the codes-only deltas of before issue 20)."""
    med = {
        k: statistics.median(r[k] for r in rows)
        for k in (
            "changed_frac",
            "changed_frac_qkv",
            "changed_frac_other",
            "bytes_ratio",
            "codes_only_bytes_ratio",
            "code_bytes_ratio",
            "full_bytes",
            "delta_bytes",
            "codes_only_delta_bytes",
            "full_encode_s",
            "delta_encode_s",
            "delta_apply_s",
            "full_apply_s",
        )
    }
    mean_push = (med["full_bytes"] + (FULL_EVERY - 1) * med["delta_bytes"]) / FULL_EVERY
    mean_old = (med["full_bytes"] + (FULL_EVERY - 1) * med["codes_only_delta_bytes"]) / FULL_EVERY
    first = rows[0]
    return {
        "kind": "summary",
        **{k: first[k] for k in ("model", "model_params", "lr", "s", "engine_dtype", "threads")},
        "pushes": len(rows),
        **med,
        "full_every": FULL_EVERY,
        "mean_bytes_per_push": mean_push,
        "mean_bytes_ratio": mean_push / med["full_bytes"],
        "codes_only_mean_bytes_ratio": mean_old / med["full_bytes"],
    }


def scaling_ratios(rows: list[dict]) -> dict[str, float]:
    """Changed share of the scaled (q/k/v) and the other codes at s over s = 1: Adam predicts about s and 1.

    From the first engine dtype's summaries: the codes do not depend on the dtype of the other tensors.
    """
    dtype = next(r["engine_dtype"] for r in rows if r["kind"] == "summary")
    runs = [r for r in rows if r["kind"] == "summary" and r["engine_dtype"] == dtype]
    base = {r["model"]: r for r in runs if r["s"] == 1.0}
    out = {}
    for r in runs:
        if r["s"] != 1.0 and base[r["model"]]["changed_frac_qkv"] > 0:
            for part in ("qkv", "other"):
                out[f"{r['model']}/s{r['s']:g}/changed_{part}"] = round(
                    r[f"changed_frac_{part}"] / base[r["model"]][f"changed_frac_{part}"], 3
                )
    return out


def checksum_rows(model_name: str, path: str, repeats: int = 3) -> list[dict]:
    """Seconds to checksum a bf16 engine's int8 push (every tensor): CRC-32 (qurl.wire.delta) against blake2b."""
    state = {k: v for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}
    q = engine_tensors(state, "int8", 8, torch.bfloat16, tied=False)
    checked = {k: q[k] for k in delta.checked_names(q)}
    nbytes = sum(t.numel() * t.element_size() for t in checked.values())

    def blake() -> str:
        h = hashlib.blake2b(digest_size=16)
        for k in sorted(checked):
            h.update(from_torch(checked[k]).data)
        return h.hexdigest()

    def crc_only() -> int:
        crc = 0
        for k in sorted(checked):
            crc = zlib.crc32(from_torch(checked[k]).data, crc)
        return crc

    out = []
    for name, fn in (
        ("qurl.wire.delta.checksum", lambda: delta.checksum(checked)),
        ("crc32", crc_only),
        ("blake2b-128", blake),
    ):
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out.append(
            {
                "kind": "checksum",
                "model": model_name,
                "hash": name,
                "bytes": nbytes,
                "seconds": statistics.median(times),
                "repeats": repeats,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny random model instead of the ~160M one, 2 pushes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pushes", type=int, default=None, help="pushes per run (default 6 demo, 3 large, 2 quick)")
    ap.add_argument("--engine-dtypes", default=",".join(ENGINE_DTYPES), help="the engines' dtypes, comma-separated")
    ap.add_argument("--scales", default=",".join(f"{s:g}" for s in SCALES), help="invariant scaling s values")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtypes = tuple(args.engine_dtypes.split(","))
    scales = tuple(float(s) for s in args.scales.split(","))
    torch.set_num_threads(args.threads)
    demo = demo_dir()
    demo_pushes = args.pushes or (2 if args.quick else 6)
    large_pushes = args.pushes or (2 if args.quick else 3)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        large = os.path.join(tmp, "large")
        random_model(large, args.quick)
        large_name = "qwen2-random-quick" if args.quick else "qwen2-random-160m"
        for name, path, lr, pushes in (
            ("demo", os.path.join(demo, "model"), DEMO_LR, demo_pushes),
            (large_name, large, LARGE_LR, large_pushes),
        ):
            data = batches(demo, pushes)
            for s in scales:
                runs = run(name, path, lr, s, data, args.threads, dtypes)
                rows += runs + summaries(runs)
            rows += checksum_rows(name, path)
    out = {"benchmark": "sync", "machine": machine_info(), "rows": rows, "ratios": scaling_ratios(rows)}
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
