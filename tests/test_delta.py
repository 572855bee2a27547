"""qurl/wire/delta.py: delta weight pushes (issues 11, 20), what a delta carries and what applying one proves.

On the demo model: a delta decoded from the wire rebuilds the full push bit for bit; a bad delta (wrong base,
corrupted values, out-of-range indices) changes nothing; malformed delta frames are ProtocolErrors; the SGLang
adapter's host copy forwards exactly the changed units; the checksum covers every tensor; an fp32 engine's
unquantized tensors go whole where that is smaller, a bf16 engine's travel as small deltas and a corrupted one is
refused by checksum. How a server applies them in order and heals: tests/test_weight_receiver.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_protocol import _edit_header, dec, enc, header_of, rebuild

from qurl.wire import delta, sglang_payload
from qurl.wire.frames import BadField, BadFrame, from_torch
from qurl.wire.protocol import WeightPush, decode, encode
from rollout_server.engines import load_engine
from rollout_server.engines import sglang_engine as se

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(Path(sys.executable).parent / "qurl-rollout-server")


def wire(push: WeightPush) -> WeightPush:
    """The push as a server receives it."""
    return decode(encode(push, sender="learner", session="s", seq=0), secret=None, max_bytes=1 << 30)


def delta_of(old: dict, new: dict, version: int, scheme: str = "int8") -> WeightPush:
    whole, deltas = delta.diff(old, new)
    return delta.delta_push(version, scheme, whole, deltas, delta.checksum(new))


def full_of(tensors: dict, version: int, scheme: str = "int8") -> WeightPush:
    return WeightPush(
        version=version,
        scheme=scheme,
        checksum=delta.checksum(tensors),
        tensors={k: from_torch(v) for k, v in tensors.items()},
    )


def nbytes(push: WeightPush) -> int:
    return sum(t.data.nbytes for t in push.tensors.values())


def same(a: dict, b: dict) -> bool:
    """Bit-for-bit equality of two named tensor sets (fp8 compared as bytes)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and from_torch(a[k]).data.tobytes() == from_torch(b[k]).data.tobytes() for k in a
    )


@pytest.mark.parametrize("scheme", ["int8", "fp8-block"])
def test_delta_round_trip_equals_the_full_push_bit_for_bit(trajectory, scheme):
    v0, v1 = trajectory[scheme][0], trajectory[scheme][1]
    push = wire(delta_of(v0, v1, 1, scheme))
    assert push.mode == "delta" and push.checksum == delta.checksum(v1) != delta.checksum(v0)
    whole, deltas = delta.split_push(push)
    assert deltas, "the weights moved: some code tensors must travel as deltas"
    assert not set(deltas) & set(whole)
    forms = {n.rpartition("@")[2] for n in push.tensors if "@" in n}
    # which tensors take indices and which a bit mask depends on how many codes the demo model's step moved
    # (one fresh demo preparation gave only masks); both encodings must round-trip, whichever appear
    assert "val" in forms and forms & {"idx", "mask"} and forms <= {"idx", "mask", "val"}, forms
    buffers = {k: v.clone() for k, v in v0.items()}
    delta.apply(buffers, whole, deltas, push.checksum)
    assert same(buffers, v1)
    codes = [k for k, v in v1.items() if v.dtype in delta.CODE_DTYPES]
    changed = sum((v1[k].view(torch.uint8) != v0[k].view(torch.uint8)).sum().item() for k in codes)
    total = sum(v1[k].numel() for k in codes)
    assert 0 < changed / total < 0.2
    assert nbytes(push) < nbytes(full_of(v1, 1, scheme))
    print(
        f"{scheme}: {changed / total:.3%} of codes changed; "
        f"delta {nbytes(push)} B, full {nbytes(full_of(v1, 1, scheme))} B"
    )


def test_a_bad_delta_changes_nothing(model_dir, trajectory):
    v0, v1 = trajectory["int8"][0], trajectory["int8"][1]
    engine = load_engine(model_dir, quant="int8", max_batch=1, max_seq_len=16)
    before = {k: v.clone() for k, v in engine.weights.items()}
    whole, deltas = delta.diff(v0, v1)
    name = next(iter(deltas))
    d = deltas[name]
    corrupted = {**deltas, name: delta.Delta(d.indices, d.values.clone().add_(1).clamp_(-127, 127))}
    with pytest.raises(delta.ChecksumMismatch, match="learner's have"):
        engine.apply_delta(whole, corrupted, 1, delta.checksum(v1))
    assert engine.version == 0 and same(engine.weights, before)
    numel = engine.weights[name].numel()
    out_of_range = {**deltas, name: delta.Delta(torch.tensor([numel], dtype=torch.int32), d.values[:1])}
    with pytest.raises(BadFrame, match="out of range"):
        engine.apply_delta(whole, out_of_range, 1, delta.checksum(v1))
    with pytest.raises(BadFrame, match="does not hold"):
        engine.apply_delta({**whole, "model.bogus.weight": torch.zeros(2)}, deltas, 1, delta.checksum(v1))
    lying = {k: (v[:-1] if k == "model.norm.weight" else v) for k, v in whole.items()}
    with pytest.raises(BadFrame, match="model.norm.weight"):
        engine.apply_delta(lying, deltas, 1, delta.checksum(v1))
    assert engine.version == 0 and same(engine.weights, before)
    engine.apply_delta(whole, deltas, 1, delta.checksum(v1))
    assert engine.version == 1 and same(engine.weights, v1)


def _small_delta() -> WeightPush:
    old = {"l.q_proj.weight": torch.zeros(64, 64, dtype=torch.int8), "l.q_proj.weight_scale": torch.ones(64, 1)}
    new = {"l.q_proj.weight": old["l.q_proj.weight"].clone(), "l.q_proj.weight_scale": torch.ones(64, 1)}
    new["l.q_proj.weight"][1, 2] = 5
    new["l.q_proj.weight"][46, 56] = -7  # two changes far apart: indices are smaller than a mask
    push = delta_of(old, new, 2)
    assert set(push.tensors) == {"l.q_proj.weight@idx", "l.q_proj.weight@val"}
    return push


def _entry(name: str, key: str, value, **more):
    def edit(h):
        next(e for e in h["tensors"] if e["name"] == name).update({key: value, **more})

    return _edit_header(edit)


def _swap_values(frames):
    """Indices [66, 3000] written as [3000, 66]: the same bytes, not increasing."""
    h = header_of(frames)
    bucket = bytearray(frames[1])
    e = next(e for e in h["tensors"] if e["name"] == "l.q_proj.weight@idx")
    o = e["offset"]
    bucket[o : o + 4], bucket[o + 4 : o + 8] = bucket[o + 4 : o + 8], bucket[o : o + 4]
    return rebuild(frames, header=h, payload=[bytes(bucket)])


MALFORMED = [
    (_entry("l.q_proj.weight@idx", "shape", [3]), BadFrame, "do not fit"),  # a lying shape
    (
        _entry("l.q_proj.weight@idx", "shape", [1], nbytes=4),
        BadField,
        "places 1 elements but carries 2",
    ),  # consistent frame, unequal pair
    (_entry("l.q_proj.weight@idx", "dtype", "float32"), BadField, "int32 or int64"),
    (_entry("l.q_proj.weight@idx", "name", "l.q_proj.weight@index"), BadField, "named X@idx"),
    (_entry("l.q_proj.weight@val", "name", "l.v_proj.weight@val"), BadField, "pair l.q_proj.weight@val is missing"),
    (_entry("l.q_proj.weight@idx", "name", "l.q_proj.weight"), BadField, "both whole and as a delta"),
    (_entry("l.q_proj.weight@idx", "name", "l.k_proj.weight@idx"), BadField, "pair l.k_proj.weight@val is missing"),
    (_edit_header(lambda h: h.update(mode="full")), BadField, "this push is full"),
    (_edit_header(lambda h: h.update(checksum=None)), BadField, "must carry the checksum"),
    (_swap_values, BadField, "strictly increasing"),
]


def _mask_delta() -> WeightPush:
    """Half the codes change: the positions travel as a bit mask."""
    old = {"l.q_proj.weight": torch.zeros(4, 4, dtype=torch.int8), "l.q_proj.weight_scale": torch.ones(4, 1)}
    new = {"l.q_proj.weight": old["l.q_proj.weight"].clone(), "l.q_proj.weight_scale": torch.ones(4, 1)}
    new["l.q_proj.weight"].view(-1)[::2] = 3
    push = delta_of(old, new, 2)
    assert set(push.tensors) == {"l.q_proj.weight@mask", "l.q_proj.weight@val"}
    return push


MASK_MALFORMED = [
    (_entry("l.q_proj.weight@val", "shape", [7], nbytes=7), BadField, "places 8 elements but carries 7"),
    (_entry("l.q_proj.weight@mask", "dtype", "int8"), BadField, "mask is uint8"),
    (_entry("l.q_proj.weight@mask", "name", "l.q_proj.weight@idx"), BadField, "int32 or int64"),
]


@pytest.mark.parametrize(
    "base, mutate, error, match", [(_small_delta, *m) for m in MALFORMED] + [(_mask_delta, *m) for m in MASK_MALFORMED]
)
def test_malformed_delta_frames_are_protocol_errors(base, mutate, error, match):
    """Index and bit-mask deltas alike: every malformation is a ProtocolError naming what is wrong."""
    frames = enc(base())
    assert dec(frames).mode == "delta"
    with pytest.raises(error, match=match):
        dec(mutate(frames))


def test_negative_delta_index_is_a_protocol_error():
    push = _small_delta()
    tensors = dict(push.tensors)
    tensors["l.q_proj.weight@idx"] = from_torch(torch.tensor([-1, 6], dtype=torch.int32))
    with pytest.raises(BadField, match=">= 0"):
        WeightPush(version=2, scheme="int8", tensors=tensors, mode="delta", checksum=push.checksum)


@pytest.mark.parametrize("scheme", ["int8", "fp8-block"])
def test_sglang_host_copy_forwards_changed_units(model_dir, trajectory, scheme):
    versions = trajectory[scheme]
    host: dict = {}
    se.keep_host_copy(host, versions[0], scheme)
    assert set(host) == set(versions[0]), "a quantized scheme's delta base is every tensor"
    expected = se.expected_tensors(model_dir, scheme)

    def unit(name: str) -> str:
        return name.removesuffix("_scale_inv").removesuffix("_scale")

    for v in (1, 2):
        whole, deltas = delta.split_push(wire(delta_of(versions[v - 1], versions[v], v, scheme)))
        sent = se.apply_to_host(host, whole, deltas, delta.checksum(versions[v]))
        assert same(host, versions[v])
        assert {unit(k) for k in sent} == {unit(k) for k in [*deltas, *whole]}, "only what changed goes"
        for code in (k for k in sent if versions[v][k].dtype in delta.CODE_DTYPES):
            assert {n for n in host if unit(n) == code} <= set(sent), "a code tensor goes with its scale"
        se.check_push(expected, sent, partial=True)
        sglang_payload.named_tensors(sent, scheme)  # codes and scales pair up as SGLang loads them
    with pytest.raises(delta.ChecksumMismatch):
        se.apply_to_host(host, whole, deltas, "crc32:00000000")
    assert same(host, versions[2])
    plain = {k: t for k, t in versions[0].items() if t.dtype not in delta.CODE_DTYPES}
    none_host: dict = {}
    se.keep_host_copy(none_host, plain, "none")
    assert not none_host, "rollout.quant=none takes full pushes only: no host copy of the whole model"


def test_checksum_covers_every_tensor_of_a_quantized_push(trajectory):
    v = trajectory["int8"][1]
    assert delta.checked_names(v) == sorted(v)
    changed = dict(v, **{"model.norm.weight": v["model.norm.weight"] + 1})
    assert delta.checksum(changed) != delta.checksum(v)  # unquantized tensors are deltas too: covered
    name = next(k for k in v if k.endswith("_scale"))
    assert delta.checksum(dict(v, **{name: v[name] * 2})) != delta.checksum(v)
    code = name.removesuffix("_scale")
    flipped = v[code].clone()
    flipped.view(-1)[0] ^= 1
    assert delta.checksum(dict(v, **{code: flipped})) != delta.checksum(v)
    plain = {k: t for k, t in v.items() if t.dtype not in delta.CODE_DTYPES}  # a push of rollout.quant=none
    assert delta.checked_names(plain) == []
    assert delta.checksum(plain) == delta.checksum(dict(plain, **{"model.norm.weight": v["model.norm.weight"] + 1}))


def test_fp32_unquantized_tensors_go_whole_where_that_is_smaller(trajectory):
    v0, v1 = trajectory["int8"][0], trajectory["int8"][1]
    plain = {k for k, t in v1.items() if t.dtype == torch.float32 and not k.endswith("_scale")}
    whole, deltas = delta.diff(v0, v1)
    assert plain <= set(whole), "every fp32 element moved: each whole tensor is smaller than its delta"
    norm = "model.norm.weight"
    few = dict(v1, **{norm: v0[norm].clone()})
    few[norm][3] += 1
    whole, deltas = delta.diff(v0, few)
    assert norm not in whole and deltas[norm].indices.tolist() == [3] and deltas[norm].values.dtype == torch.float32
    whole, deltas = delta.diff(v0, dict(v1, **{norm: v0[norm]}))
    assert norm not in whole and norm not in deltas, "an unchanged tensor is left out"


# -- a bf16 engine at an RL learning rate: the unquantized tensors travel as small deltas ---------------------------


def _bf16_engine(model_dir, versions):
    engine = load_engine(model_dir, quant="int8", dtype="bfloat16", max_batch=2, max_seq_len=32)
    engine.update_weights({k: v.clone() for k, v in versions[1].items()}, 1)
    return engine


def test_bf16_corrupted_unquantized_tensor_is_refused_by_checksum(model_dir, bf16_versions):
    versions = bf16_versions
    engine = _bf16_engine(model_dir, versions)
    before = {k: v.clone() for k, v in engine.weights.items()}
    whole, deltas = delta.split_push(wire(delta_of(versions[1], versions[2], 2)))
    embed, norm = "model.embed_tokens.weight", "model.norm.weight"
    d = deltas[embed]
    flipped = d.values.clone()
    flipped.view(torch.int16)[0] ^= 1  # one bf16 ulp off
    with pytest.raises(delta.ChecksumMismatch, match="learner's have"):
        engine.apply_delta(whole, {**deltas, embed: delta.Delta(d.indices, flipped)}, 2, delta.checksum(versions[2]))
    assert engine.version == 1 and same(engine.weights, before)
    wrong = versions[2][norm].clone()
    wrong.view(torch.int16)[0] ^= 1
    with pytest.raises(delta.ChecksumMismatch):  # a whole tensor is written only once the checksum holds
        engine.apply_delta({**whole, norm: wrong}, deltas, 2, delta.checksum(versions[2]))
    assert engine.version == 1 and same(engine.weights, before)
    engine.apply_delta(whole, deltas, 2, delta.checksum(versions[2]))
    assert engine.version == 2 and same(engine.weights, versions[2])


def test_sync_benchmark_quick(tmp_path):
    out = tmp_path / "sync.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/sync.py"), "--quick", "--out", str(out)],
        check=True,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        timeout=300,
    )
    report = json.loads(out.read_text())
    assert report["benchmark"] == "sync" and {"cpu", "cores", "torch", "python"} <= set(report["machine"])
    summaries = [r for r in report["rows"] if r["kind"] == "summary"]
    assert sorted((r["model"], r["s"], r["engine_dtype"]) for r in summaries) == sorted(
        (m, s, dt) for m in ("demo", "qwen2-random-quick") for s in (1.0, 1.5, 2.0) for dt in ("float32", "bfloat16")
    )
    for r in summaries:
        assert 0 < r["changed_frac"] < 1 and r["full_every"] == 10
        assert min(r["changed_frac_qkv"], r["changed_frac_other"]) <= r["changed_frac"]
        assert r["changed_frac"] <= max(r["changed_frac_qkv"], r["changed_frac_other"])
        assert r["delta_bytes"] < r["full_bytes"]  # codes that barely move cost less as a delta
        assert r["delta_bytes"] <= r["codes_only_delta_bytes"]  # deltas of every tensor never cost more
    small_lr_bf16 = next(r for r in summaries if r["lr"] == 1e-6 and r["engine_dtype"] == "bfloat16")
    assert small_lr_bf16["bytes_ratio"] < 0.5 * small_lr_bf16["codes_only_bytes_ratio"]
    assert set(report["ratios"]) == {
        f"{m}/s{s}/changed_{p}" for m in ("demo", "qwen2-random-quick") for s in ("1.5", "2") for p in ("qkv", "other")
    }
    assert {r["hash"] for r in report["rows"] if r["kind"] == "checksum"} >= {"qurl.wire.delta.checksum", "blake2b-128"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_diff_chooses_delta_or_whole_by_the_written_rule_at_every_count(dtype):
    """The smaller of (indices or bit mask) + values and the whole tensor, at every number of changed elements,
    with the changes at the front or the back (the mask's length follows the last index)."""
    n, size = 64, torch.empty(0, dtype=dtype).element_size()
    old = {"c": torch.zeros(n, dtype=torch.int8), "t": torch.zeros(n, dtype=dtype)}  # a code makes it checked
    for k in range(n + 1):
        for where in (range(k), range(n - k, n)):
            t = torch.zeros(n, dtype=dtype)
            t[list(where)] = 1
            whole, deltas = delta.diff(old, {"c": old["c"], "t": t})
            last = max(where, default=-1)
            smaller = min(4 * k, (last + 8) // 8) + k * size < n * size
            if k == 0:
                assert "t" not in whole and "t" not in deltas
            elif smaller:
                assert deltas["t"].indices.tolist() == list(where) and "t" not in whole, (k, where)
            else:
                assert "t" in whole and "t" not in deltas, (k, where)
