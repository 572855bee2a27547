"""Delta weight pushes (issues 11, 20): what a delta carries, how servers apply it, and how they heal.

Unit level on the demo model: a delta decoded from the wire rebuilds the full push bit for bit; an engine after
N deltas equals an engine after one full push of the same version, in the same buffers; a bad delta (wrong base,
corrupted values, out-of-range indices) changes nothing; malformed delta frames are ProtocolErrors; the learner's
sender honours sync.full_every; the SGLang adapter's host copy forwards exactly the changed units; a bf16 engine at
lr 1e-6 takes every tensor (embeddings, norms too) as small exact deltas, refuses a corrupted one by checksum, and an
fp32 engine's unquantized tensors go whole where that is smaller. End to end: a
real rollout server process against the learner's real WeightSender detects a corrupted delta and a missed
version, asks for a full push, and is healed by it.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from test_protocol import _edit_header, dec, enc, header_of, rebuild
from transformers import AutoModelForCausalLM

from learner.budget import Budget
from learner.control_plane import ControlPlane
from learner.publisher import engine_tensors
from learner.weight_sender import WeightSender
from qurl import delta, sglang_payload, transport
from qurl.frames import BadField, BadFrame, from_torch
from qurl.protocol import Status, WeightPush, decode, encode
from qurl.quant import quantize_state_dict
from rollout_server.engines import GenRequest, load_engine
from rollout_server.engines import sglang_engine as se
from rollout_server.weights import WeightReceiver

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(Path(sys.executable).parent / "qurl-rollout-server")
STEP = 3e-5  # per-version weight move: a few percent of int8 codes change, as after a real optimizer step


@pytest.fixture(scope="module")
def model_dir(demo_dir) -> str:
    return str(Path(demo_dir) / "model")


def engine_state(model_dir: str) -> dict[str, torch.Tensor]:
    """The demo checkpoint's tensors that the engine loads (a tied lm_head left out), as fresh copies."""
    names = set(load_engine(model_dir, quant="int8", max_batch=1, max_seq_len=16).weights)
    return {
        k: v.detach().clone()
        for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()
        if k in names
    }


@pytest.fixture(scope="module")
def trajectory(model_dir):
    """scheme -> quantized engine tensors of versions 0..6, the weights moving by STEP per version."""
    state = engine_state(model_dir)
    gen = torch.Generator().manual_seed(0)
    states = []
    for _ in range(7):
        states.append({k: v.clone() for k, v in state.items()})
        for v in state.values():
            v.add_(STEP * torch.randn(v.shape, generator=gen))
    return {scheme: [quantize_state_dict(s, scheme) for s in states] for scheme in ("int8", "fp8-block")}


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


def test_engine_after_deltas_equals_engine_after_a_full_push(model_dir, trajectory):
    versions = trajectory["int8"]
    a = load_engine(model_dir, quant="int8", max_batch=2, max_seq_len=32)
    b = load_engine(model_dir, quant="int8", max_batch=2, max_seq_len=32)
    ptrs = {k: v.data_ptr() for k, v in a.weights.items()}
    requests = []
    receiver = WeightReceiver(
        a,
        "int8",
        {"weight_pushes_applied": 0, "weight_pushes_rejected": 0, "weight_pushes_ignored": 0},
        lambda: requests.append(a.version),
    )
    receiver.apply([wire(full_of(versions[1], 1))])
    # out of order and with a repeat: the receiver sorts and applies each version once
    receiver.apply([wire(delta_of(versions[v - 1], versions[v], v)) for v in (3, 2, 4, 2)])
    assert a.version == 4 and receiver.counters["weight_deltas_applied"] == 3 and not requests
    b.update_weights({k: v.clone() for k, v in versions[4].items()}, 4)
    assert same(a.weights, b.weights) and same(a.weights, versions[4])
    assert ptrs == {k: v.data_ptr() for k, v in a.weights.items()}, "a delta must write into the existing buffers"
    req = [GenRequest([3, 5, 7, 11], n=1, max_new_tokens=6, temperature=0)]
    assert a.generate(req)[0].samples[0].logprobs == b.generate(req)[0].samples[0].logprobs  # derived copies too

    # a missed version: the delta for 6 does not apply on 4; the receiver asks for a full push, changes nothing
    receiver.apply([wire(delta_of(versions[5], versions[6], 6))])
    assert a.version == 4 and same(a.weights, versions[4]) and requests == [4] and receiver.need_full
    assert receiver.counters["weight_deltas_without_base"] == 1
    receiver.apply([wire(full_of(versions[6], 6))])
    assert a.version == 6 and same(a.weights, versions[6]) and not receiver.need_full


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


def test_sender_honours_full_every(trajectory):
    versions = trajectory["int8"]
    ctx = zmq.Context()
    try:
        pub = transport.bind(ctx, zmq.PUB, "tcp://127.0.0.1:*", secret=None, max_bytes=1 << 20)
        router = transport.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", secret=None, max_bytes=1 << 20)

        def sender(full_every: int, scheme: str = "int8") -> WeightSender:
            plane = ControlPlane(
                transport.Sender(pub, "learner"),
                transport.Receiver(router, secret=None, max_bytes=1 << 20),
                transport.Sender(router, "learner"),
                budget=Budget(0, 1, lambda: (0, {})),
            )
            return WeightSender(plane, scheme, full_every=full_every)

        s = sender(3)
        modes = [s.build(v, versions[v])[0].mode for v in range(1, 7)]
        assert modes == ["full", "delta", "full", "delta", "delta", "full"]  # v1: nothing to build on
        push, stats = s.build(7, versions[0])  # a lagging server gets the whole current version
        assert s.plane._full.mode == "full" and s.plane._full.version == 7 and stats.mode == "delta"
        assert stats.bytes == nbytes(push) < stats.full_bytes == nbytes(s.plane._full)
        assert [sender(1).build(v, versions[v])[0].mode for v in (1, 2, 3)] == ["full"] * 3
        s = sender(3)
        s.build(1, versions[1])
        assert s.build(5, versions[2])[0].mode == "full"  # not built on the version before: whole
        plain = {k: v for k, v in versions[1].items() if v.is_floating_point() and not k.endswith("_scale")}
        s = sender(10, "none")
        assert [s.build(v, plain)[0].mode for v in (1, 2)] == ["full", "full"]  # no codes: nothing to delta
    finally:
        ctx.destroy(linger=0)


def test_a_heartbeat_lagging_just_after_a_push_gets_no_full_repush(trajectory):
    """Heartbeats sent before a delta landed must not each bring a full push; a hello or a request does."""
    versions = trajectory["int8"]
    ctx = zmq.Context()
    try:
        pub = transport.bind(ctx, zmq.PUB, "tcp://127.0.0.1:*", secret=None, max_bytes=1 << 20)
        router = transport.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", secret=None, max_bytes=1 << 20)
        plane = ControlPlane(
            transport.Sender(pub, "learner"),
            transport.Receiver(router, secret=None, max_bytes=1 << 20),
            transport.Sender(router, "learner"),
            budget=Budget(0, 1, lambda: (0, {})),
        )
        sender = WeightSender(plane, "int8", full_every=10)
        plane.start()
        dealer = transport.connect(ctx, zmq.DEALER, router.last_endpoint.decode(), max_bytes=1 << 20)
        tx, rx = transport.Sender(dealer, "srv"), transport.Receiver(dealer, secret=None, max_bytes=1 << 20)

        def say(kind: str, version: int) -> None:
            """Send, then wait for the reply to a current heartbeat: the control thread is done with `kind`."""
            tx.send(Status(type=kind, server_id="srv", version=version))
            tx.send(Status(type="heartbeat", server_id="srv", version=2))
            assert rx.recv(timeout_ms=5000).type == "reply" and rx.recv(timeout_ms=5000).type == "reply"

        sender.publish(1, versions[1])
        sender.publish(2, versions[2])
        say("heartbeat", 1)
        assert plane.repushes == 0
        say("resend_weights", 1)
        assert plane.repushes == 1
        plane.close()
    finally:
        ctx.destroy(linger=0)


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

LR = 1e-6


@pytest.fixture(scope="module")
def bf16_versions(model_dir):
    """int8 engine tensors of versions 0..6 as the learner builds them for a bf16 engine, weights moving by LR
    per version with Adam's step shape (every element, by about the learning rate)."""
    state = engine_state(model_dir)
    gen = torch.Generator().manual_seed(1)
    versions = []
    for _ in range(7):
        versions.append(engine_tensors(dict(state), "int8", 8, torch.bfloat16, tied=False))
        for v in state.values():
            v.sub_(LR * torch.sign(torch.randn(v.shape, generator=gen)))
    return versions


def _bf16_engine(model_dir, versions):
    engine = load_engine(model_dir, quant="int8", dtype="bfloat16", max_batch=2, max_seq_len=32)
    engine.update_weights({k: v.clone() for k, v in versions[1].items()}, 1)
    return engine


def test_bf16_engine_takes_small_exact_deltas_of_every_tensor(model_dir, bf16_versions):
    versions = bf16_versions
    engine = _bf16_engine(model_dir, versions)
    ptrs = {k: v.data_ptr() for k, v in engine.weights.items()}
    counters = {"weight_pushes_applied": 0, "weight_pushes_rejected": 0, "weight_pushes_ignored": 0}
    receiver = WeightReceiver(engine, "int8", counters, lambda: pytest.fail("no full push should be needed"))
    embed = "model.embed_tokens.weight"
    for v in range(2, 7):
        push = wire(delta_of(versions[v - 1], versions[v], v))
        bf16 = {k for k, t in versions[v].items() if t.dtype == torch.bfloat16}
        assert not bf16 & set(push.tensors), "no unquantized bf16 tensor travels whole at this learning rate"
        _, deltas = delta.split_push(push)
        assert embed in deltas and deltas[embed].indices.numel() < 0.05 * versions[v][embed].numel()
        assert nbytes(push) <= 0.10 * nbytes(full_of(versions[v], v)), (nbytes(push), nbytes(full_of(versions[v], v)))
        receiver.apply([push])
        assert engine.version == v and same(engine.weights, versions[v]), f"version {v} not bit-equal"
    assert counters["weight_deltas_applied"] == 5 and counters["weight_pushes_rejected"] == 0
    assert ptrs == {k: t.data_ptr() for k, t in engine.weights.items()}


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


# -- end to end: a real server process, the learner's real WeightSender and ControlPlane -----------------------------


def test_corrupted_delta_and_missed_version_heal_through_a_full_push(demo_dir, trajectory, tmp_path):
    versions = trajectory["int8"]
    ctx = zmq.Context()
    pull = transport.bind(ctx, zmq.PULL, "tcp://127.0.0.1:*", secret=None, max_bytes=1 << 26)
    pub = transport.bind(ctx, zmq.PUB, "tcp://127.0.0.1:*", secret=None, max_bytes=1 << 20, hwm=4)
    router = transport.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", secret=None, max_bytes=1 << 20)
    plane = ControlPlane(
        transport.Sender(pub, "learner"),
        transport.Receiver(router, secret=None, max_bytes=1 << 20),
        transport.Sender(router, "learner"),
        budget=Budget(0, 1, lambda: (0, {})),
    )
    sender = WeightSender(plane, "int8", full_every=100)
    plane.start()
    endpoints = [
        f"transport.{n}={s.last_endpoint.decode()}"
        for n, s in (("trajectories", pull), ("weights", pub), ("control", router))
    ]
    demo = Path(demo_dir)
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                SERVER,
                "--config",
                str(ROOT / "configs/demo-cpu.yaml"),
                f"model.path={demo / 'model'}",
                f"data.train_files=[{demo / 'train.jsonl'}]",
                "data.eval_files=[]",
                f"run.dir={tmp_path / 'run'}",
                "rollout.quant=int8",
                "train.batch_prompts=1",
                "async.max_staleness=0",
                "rollout.n_samples=2",
                "rollout.sampling.max_new_tokens=4",
                "reward.workers=1",
                "log.interval_s=1",
                *endpoints,
            ],
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def wait(what: str, until, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"server exited with {proc.returncode}"
            server = next(iter(plane.servers.values()), None)
            if server is not None and until(server):
                return server.counters
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last counters {server and server.counters}")

    try:
        wait("hello", lambda s: True, timeout_s=90)
        for v in (1, 2, 3):
            sender.publish(v, versions[v])
            wait(f"version {v}", lambda s, v=v: s.version == v)
        c = wait("counters of version 3", lambda s: s.counters.get("weight_deltas_applied") == 2)
        assert c["weight_checksum_mismatches"] == 0 and c["weight_pushes_applied"] == 3

        push, _ = sender.build(4, versions[4])  # the sender now holds the true version 4; the server gets a corrupt one
        whole, deltas = delta.split_push(push)
        name = next(iter(deltas))
        values = deltas[name].values.clone()
        values[0] = 127 if values[0] != 127 else -127
        sender.send(
            delta.delta_push(
                4, "int8", whole, {**deltas, name: delta.Delta(deltas[name].indices, values)}, push.checksum
            )
        )
        c = wait("the full push after a checksum mismatch", lambda s: s.version == 4)
        assert c["weight_checksum_mismatches"] == 1 and c["weight_full_requests"] >= 1
        assert c["weight_deltas_applied"] == 2 and c["weight_pushes_applied"] == 4

        sender.build(5, versions[5])  # built but never sent: the server misses version 5
        sender.publish(6, versions[6])
        c = wait("the full push after a missed version", lambda s: s.version == 6)
        assert c["weight_deltas_without_base"] == 1 and c["weight_checksum_mismatches"] == 1
        sender.publish(7, versions[0])  # and the healed base carries deltas again
        c = wait("a delta on the healed base", lambda s: s.counters.get("weight_deltas_applied") == 3)
        assert c["weight_checksum_mismatches"] == 1 and c["weight_pushes_rejected"] == 1
        print(f"server counters: {c}; sender repushes {plane.repushes}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        plane.close()
        ctx.destroy(linger=0)
        print(log_path.read_text()[-3000:])


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
    assert {r["hash"] for r in report["rows"] if r["kind"] == "checksum"} >= {"qurl.delta.checksum", "blake2b-128"}
