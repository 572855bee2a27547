"""qurl.wire.protocol: round trips; every malformed, forged or replayed message is a ProtocolError."""

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from qurl.wire.frames import (
    BUCKET_ALIGN,
    DTYPES,
    MAX_HEADER_BYTES,
    SCHEMA_VERSION,
    BadAuth,
    BadField,
    BadFrame,
    BadHeader,
    ProtocolError,
    Replay,
    ReplayGuard,
    TooLarge,
    WireTensor,
    from_torch,
    mac,
    to_torch,
)
from qurl.wire.protocol import Sample, Status, TrajectoryGroup, WeightPush, WeightRef, decode, encode

SECRET = b"test-secret"
MAX = 1 << 24
FUZZ = settings(
    max_examples=150,
    deadline=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def make_group(n: int = 3, lengths=(5, 1, 9), prompt_id=7, seed: int = 0) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    return TrajectoryGroup(
        prompt_id=prompt_id,
        group_id="g-1",
        server_id="srv-a",
        prompt_ids=rng.integers(0, 500, 6),
        samples=tuple(
            Sample(
                token_ids=rng.integers(0, 500, lengths[i % len(lengths)]),
                logprobs=-rng.random(lengths[i % len(lengths)]),
                versions=np.full(lengths[i % len(lengths)], i),
                reward=0.5 * i,
                finish_reason="stop" if i % 2 else "length",
                reward_details={"correct": i % 2 == 1, "parsed": ["4", 2], "err": None},
            )
            for i in range(n)
        ),
    )


def make_push(bucket_bytes: int = 1 << 20) -> WeightPush:
    g = torch.Generator().manual_seed(0)
    return WeightPush(
        version=3,
        scheme="int8",
        tensors={
            "embed.weight": from_torch(torch.randn(11, 8, generator=g).bfloat16()),
            "layers.0.q.weight": from_torch(torch.randint(-127, 128, (8, 8), dtype=torch.int8)),
            "layers.0.q.weight_scale": from_torch(torch.rand(8, generator=g)),
            "layers.0.fp8.weight": from_torch(torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn)),
            "half": from_torch(torch.randn(3, generator=g).half()),
            "codes": WireTensor(np.arange(200, dtype=np.uint8), "uint8"),
            "idx": np.arange(5, dtype=np.int64),
            "count": np.array(7, dtype=np.int32),  # 0-d
            "empty": np.zeros((0, 4), dtype=np.float32),
        },
        checksum="abc123",
        bucket_bytes=bucket_bytes,
    )


def make_status(kind: str = "heartbeat") -> Status:
    return Status(
        type=kind,
        server_id="srv-a",
        version=4,
        engine="torch",
        quant="int8",
        running=2,
        queued=5,
        counters={"sent": 10, "dropped": 0, "tokens_per_s": 123.5},
        budget=6 if kind == "reply" else None,
    )


def enc(msg, *, secret=None, seq=0, session="sess-1", sender="srv-a") -> list:
    return encode(msg, sender=sender, session=session, seq=seq, secret=secret)


def dec(frames, *, secret=None, max_bytes=MAX, **kw):
    return decode(frames, secret=secret, max_bytes=max_bytes, **kw)


def header_of(frames) -> dict:
    return json.loads(bytes(frames[0]))


def rebuild(frames, header=None, payload=None, secret=None) -> list[bytes]:
    """Frames with a replaced header and/or payload, re-signed with `secret` when given."""
    h = header_of(frames) if header is None else header
    n = len(header_of(frames)["arrays"])
    body = [bytes(memoryview(f).cast("B")) for f in frames[1 : 1 + n]]
    if payload is not None:
        body = payload
    if secret:
        h["auth"] = "hmac-sha256"
    out = [json.dumps(h).encode(), *body]
    if secret:
        out.append(mac(secret, out))
    return out


def assert_group_equal(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    assert (a.prompt_id, a.group_id, a.server_id) == (b.prompt_id, b.group_id, b.server_id)
    assert type(a.prompt_id) is type(b.prompt_id)
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples):
        for f in ("token_ids", "logprobs", "versions"):
            u, v = getattr(x, f), getattr(y, f)
            assert u.dtype == v.dtype and np.array_equal(u, v), f
        assert (x.reward, x.finish_reason, x.reward_details) == (
            y.reward,
            y.finish_reason,
            y.reward_details,
        )


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("prompt_id", [7, "gsm8k/train/00012"])
def test_trajectory_group_round_trip(secret, prompt_id):
    g = make_group(prompt_id=prompt_id)
    out = dec(enc(g, secret=secret), secret=secret, replay_guard=ReplayGuard())
    assert isinstance(out, TrajectoryGroup)
    assert_group_equal(g, out)
    assert out.samples[0].token_ids.dtype == np.int32
    assert out.samples[0].logprobs.dtype == np.float32


def test_trajectory_frames_are_few_and_views():
    g = make_group(n=8, lengths=(256,))
    frames = enc(g)
    assert len(frames) == 5  # header + prompt, tokens, logprobs, versions, whatever the group size
    mutable = [bytearray(memoryview(f).cast("B")) for f in frames]
    out = dec(mutable)
    mutable[1][0:4] = np.int32(499).tobytes()
    assert out.prompt_ids[0] == 499  # decoded arrays alias the frames: no copy


@pytest.mark.parametrize("secret", [None, SECRET])
def test_weight_push_round_trip_through_torch(secret):
    push = make_push()
    out = dec(enc(push, secret=secret), secret=secret)
    assert isinstance(out, WeightPush)
    assert (out.version, out.scheme, out.mode, out.checksum) == (3, "int8", "full", "abc123")
    assert list(out.tensors) == list(push.tensors)
    for name, sent in push.tensors.items():
        got = out.tensors[name]
        assert got.dtype == sent.dtype and got.data.shape == sent.data.shape, name
        a, b = to_torch(*sent), to_torch(*got)
        assert a.dtype == b.dtype == getattr(torch, sent.dtype)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    fp8 = to_torch(*out.tensors["layers.0.fp8.weight"])
    assert fp8.dtype == torch.float8_e4m3fn and fp8.float().abs().sum() > 0


def test_weight_push_buckets():
    push = make_push(bucket_bytes=256)
    frames = enc(push)
    h = header_of(frames)
    buckets = [memoryview(f).nbytes for f in frames[1:]]
    assert len(buckets) > 2
    for e in h["tensors"]:
        assert e["offset"] % BUCKET_ALIGN == 0
        alone = sum(x["bucket"] == e["bucket"] for x in h["tensors"] if x["nbytes"]) == 1
        assert buckets[e["bucket"]] <= 256 or alone
    out = dec(frames)
    for name, sent in push.tensors.items():
        assert np.array_equal(out.tensors[name].data, sent.data), name
    single = header_of(enc(make_push()))
    assert {e["bucket"] for e in single["tensors"]} == {0}  # default: one flat buffer


@pytest.mark.parametrize("kind", ["hello", "heartbeat", "bye", "reply", "resend_status", "resend_weights"])
def test_status_round_trip(kind):
    s = make_status(kind)
    out = dec(enc(s, secret=SECRET), secret=SECRET, kinds=("status",))
    assert vars(out) == vars(s)
    assert out.counters == {"sent": 10, "dropped": 0, "tokens_per_s": 123.5}
    assert type(out.counters["sent"]) is int


def test_torch_conversion_is_zero_copy():
    t = torch.randn(4, 6).bfloat16()
    wt = from_torch(t)
    assert wt.dtype == "bfloat16" and wt.data.dtype == np.dtype("<u2")
    assert wt.data.ctypes.data == t.data_ptr()
    back = to_torch(*wt)
    assert back.data_ptr() == t.data_ptr() and torch.equal(back, t)
    strided = torch.randn(6, 4).t()
    assert torch.equal(to_torch(*from_torch(strided)), strided)
    with pytest.raises(BadField, match="float64"):
        from_torch(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(BadField):
        to_torch(np.zeros(2, np.float32), "bfloat16")


# ---------------------------------------------------------------------------------------------
# construction checks (encode and decode share them)


def _sample(**kw):
    base = dict(token_ids=[1, 2, 3], logprobs=[-0.1, -2.0, 0.0], versions=[0, 0, 1], reward=1.0, finish_reason="stop")
    base.update(kw)
    return Sample(**base)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(token_ids=[]), "at least one token"),
        (dict(logprobs=[-0.1, -2.0]), "lengths differ"),
        (dict(versions=[0, 0]), "lengths differ"),
        (dict(logprobs=[-0.1, 0.5, -1.0]), "above 0"),
        (dict(logprobs=[-0.1, float("nan"), -1.0]), "not finite"),
        (dict(logprobs=[-0.1, -float("inf"), -1.0]), "not finite"),
        (dict(versions=[0, -1, 0]), "negative version"),
        (dict(token_ids=[1, -2, 3]), "negative token"),
        (dict(token_ids=[1, 2**40, 3]), "outside int32"),
        (dict(token_ids=[1.5, 2.0, 3.0]), "cannot become int32"),
        (dict(reward=float("nan")), "not finite"),
        (dict(reward="1"), "expected a number"),
        (dict(finish_reason=""), "empty"),
        (dict(reward_details=[1]), "JSON object"),
    ],
)
def test_sample_rejects(kw, match):
    with pytest.raises(BadField, match=match):
        _sample(**kw)


def test_sample_accepts_rounding_above_zero():
    assert _sample(logprobs=[-0.1, 5e-5, 0.0]).logprobs.dtype == np.float32


def test_message_construction_rejects():
    with pytest.raises(BadField, match="samples"):
        TrajectoryGroup(prompt_id=1, group_id="g", server_id="s", prompt_ids=[1], samples=())
    with pytest.raises(BadField, match="prompt_id"):
        TrajectoryGroup(prompt_id=True, group_id="g", server_id="s", prompt_ids=[1], samples=(_sample(),))
    with pytest.raises(BadField, match="not allowed"):
        WeightPush(version=1, scheme="int8", tensors={"w": np.zeros(2, np.float64)})
    with pytest.raises(BadField, match="storage"):
        WeightPush(version=1, scheme="bf16", tensors={"w": WireTensor(np.zeros(2, np.int8), "bfloat16")})
    with pytest.raises(BadField, match="mode"):
        WeightPush(version=1, scheme="int8", tensors={}, mode="patch")
    with pytest.raises(BadField, match="type"):
        Status(type="reboot", server_id="s", version=0)
    with pytest.raises(BadField, match="counters.x"):
        Status(type="hello", server_id="s", version=0, counters={"x": float("inf")})


# ---------------------------------------------------------------------------------------------
# each malformed message gets its own error class and a message naming the problem


def _edit_header(edit):
    def mutate(frames):
        h = header_of(frames)
        edit(h)
        return rebuild(frames, header=h)

    return mutate


def _edit_payload(index, edit):
    def mutate(frames):
        h = header_of(frames)
        body = [bytearray(memoryview(f).cast("B")) for f in frames[1:]]
        edit(body[index])
        return rebuild(frames, header=h, payload=[bytes(b) for b in body])

    return mutate


def _set(path, value):
    def edit(h):
        node = h
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _drop(key):
    return lambda h: h.pop(key)


def _halve_as_int64(h):
    a = h["arrays"][0]
    a["dtype"], a["shape"] = "int64", [a["shape"][0] // 2]


def _logprob(value):
    return _edit_payload(2, lambda b: b.__setitem__(slice(0, 4), np.float32(value).tobytes()))


GROUP_CASES = [
    (_edit_header(_set(["schema"], SCHEMA_VERSION + 1)), BadHeader, "schema"),
    (_edit_header(_set(["schema"], True)), BadHeader, "schema"),
    (_edit_header(_set(["kind"], "pickle")), BadHeader, "unknown kind"),
    (_edit_header(_drop("sender")), BadHeader, "lacks sender"),
    (_edit_header(_drop("samples")), BadHeader, "missing"),
    (_edit_header(_set(["exec"], "rm -rf")), BadHeader, "unknown"),
    (_edit_header(_set(["seq"], -1)), BadHeader, "seq"),
    (_edit_header(_set(["sender"], 5)), BadHeader, "sender"),
    (_edit_header(_set(["auth"], "none-at-all")), BadHeader, "auth"),
    (_edit_header(_set(["arrays"], {})), BadHeader, "arrays"),
    (_edit_header(_set(["arrays", 1, "dtype"], "float64")), BadFrame, "not allowed"),
    (_edit_header(_set(["arrays", 1, "dtype"], "object")), BadFrame, "not allowed"),
    (_edit_header(_set(["arrays", 1, "shape"], [-1])), BadFrame, "non-negative"),
    (_edit_header(_set(["arrays", 1, "shape"], [10**6])), BadFrame, "frame has"),
    (_edit_header(_set(["arrays", 1, "shape"], [1] * 9)), BadFrame, "at most"),
    (_edit_header(_set(["arrays", 1, "nbytes"], 4)), BadFrame, "header says"),
    (_edit_header(_set(["arrays", 1, "name"], "prompt_ids")), BadFrame, "repeated"),
    (_edit_header(_halve_as_int64), BadFrame, "expected 1-D int32"),
    (_edit_header(_set(["samples", 0, "length"], 6)), BadFrame, "sum to"),
    (_edit_header(_set(["samples", 0, "length"], 0)), BadField, "below 1"),
    (_edit_header(_set(["samples", 0, "reward"], "1")), BadField, "reward"),
    (_edit_header(_set(["samples", 0, "extra"], 1)), BadField, "samples"),
    (_edit_header(_set(["prompt_id"], 1.5)), BadField, "prompt_id"),
    (_logprob(0.5), BadField, "above 0"),
    (_logprob(float("nan")), BadField, "not finite"),
    (_edit_payload(3, lambda b: b.__setitem__(slice(0, 4), np.int32(-3).tobytes())), BadField, "negative version"),
    (lambda f: f[:-1], BadFrame, "header declares"),
    (lambda f: [*f, b"extra"], BadFrame, "header declares"),
    (lambda f: [b"\xff\xfe{", *f[1:]], BadHeader, "UTF-8 JSON"),
    (lambda f: [b"[1, 2]", *f[1:]], BadHeader, "JSON list"),
    (lambda f: [b"[" * 100_000 + b"]" * 100_000, *f[1:]], BadHeader, "JSON"),
    (lambda f: [bytes(f[0]).replace(b'"reward":0.0', b'"reward":NaN'), *f[1:]], BadHeader, "non-finite"),
    (lambda f: [b" " * (MAX_HEADER_BYTES + 1), *f[1:]], TooLarge, "header"),
    (lambda f: [], BadFrame, "empty"),
    (lambda f: [f[0], "text frame"], BadFrame, "buffer"),
]


@pytest.mark.parametrize("mutate, error, match", GROUP_CASES)
def test_bad_trajectory_messages(mutate, error, match):
    with pytest.raises(error, match=match):
        dec(mutate(enc(make_group())), max_bytes=MAX_HEADER_BYTES * 2)


def _tensor(i, key, value):
    return _edit_header(_set(["tensors", i, key], value))


PUSH_CASES = [
    (_tensor(0, "offset", 10**9), BadFrame, "do not fit"),
    (_tensor(0, "bucket", 5), BadFrame, "do not fit"),
    (_tensor(0, "dtype", "float64"), BadFrame, "not allowed"),
    (_tensor(0, "nbytes", 1), BadFrame, "do not fit"),
    (_tensor(0, "shape", [2, -2]), BadFrame, "non-negative"),
    (_tensor(1, "offset", 0), BadFrame, "overlap"),
    (_tensor(1, "name", "embed.weight"), BadField, "twice"),
    (_edit_header(_set(["arrays", 0, "name"], "weights")), BadFrame, "bucket0"),
    (_edit_header(_set(["mode"], "patch")), BadField, "mode"),
    (_edit_header(_set(["version"], -1)), BadField, "version"),
]


@pytest.mark.parametrize("mutate, error, match", PUSH_CASES)
def test_bad_weight_pushes(mutate, error, match):
    with pytest.raises(error, match=match):
        dec(mutate(enc(make_push())))


def test_kind_filter_and_status_fields():
    with pytest.raises(BadHeader, match="not accepted here"):
        dec(enc(make_status()), kinds=("trajectory_group",))
    bad = _edit_header(_set(["counters"], {"x": "many"}))(enc(make_status()))
    with pytest.raises(BadField, match="counters.x"):
        dec(bad)


def test_size_limit():
    frames = enc(make_group())
    total = sum(memoryview(f).nbytes for f in frames)
    assert dec(frames, max_bytes=total)
    with pytest.raises(TooLarge, match=f"{total} bytes"):
        dec(frames, max_bytes=total - 1)


def test_authentication():
    g = make_group()
    with pytest.raises(BadAuth, match="no HMAC"):
        dec(enc(g), secret=SECRET)
    with pytest.raises(BadAuth, match="does not match"):
        dec(enc(g, secret=b"other"), secret=SECRET)
    signed = enc(g, secret=SECRET)
    flipped = [*signed]
    payload = bytearray(memoryview(signed[2]).cast("B"))
    payload[0] ^= 1
    flipped[2] = bytes(payload)
    with pytest.raises(BadAuth, match="does not match"):
        dec(flipped, secret=SECRET)
    with pytest.raises(BadAuth):  # frames moved across a boundary change the MAC input
        dec([signed[0], bytes(signed[1]) + bytes(signed[2][:4]), bytes(signed[2][4:]), *signed[3:]], secret=SECRET)
    # a signed message whose header claims no MAC is refused by a receiver that has a secret
    h = header_of(signed)
    h["auth"] = None
    unsigned_header = rebuild(signed, header=h)
    with pytest.raises(BadAuth, match="does not declare"):
        dec([*unsigned_header, mac(SECRET, unsigned_header)], secret=SECRET)
    # a receiver without a secret still accepts a signed message (it simply cannot check it)
    assert_group_equal(dec(signed), g)


def test_replay_guard():
    guard = ReplayGuard()
    g = make_group()
    first = enc(g, secret=SECRET, seq=0)
    assert dec(first, secret=SECRET, replay_guard=guard)
    with pytest.raises(Replay, match="seq 0 <= last accepted 0"):
        dec(first, secret=SECRET, replay_guard=guard)
    assert dec(enc(g, secret=SECRET, seq=5), secret=SECRET, replay_guard=guard)
    with pytest.raises(Replay):
        dec(enc(g, secret=SECRET, seq=3), secret=SECRET, replay_guard=guard)
    # a restarted server: new session nonce, seq from 0 again
    assert dec(enc(g, secret=SECRET, seq=0, session="sess-2"), secret=SECRET, replay_guard=guard)
    # the old session stays closed
    with pytest.raises(Replay):
        dec(enc(g, secret=SECRET, seq=5), secret=SECRET, replay_guard=guard)
    # a rejected message does not advance the guard
    bad = _logprob(0.5)(enc(g, seq=9, session="sess-3"))
    with pytest.raises(BadField):
        dec(bad, replay_guard=guard)
    assert dec(enc(g, seq=1, session="sess-3"), replay_guard=guard)


def test_replay_guard_forgets_oldest_session_only():
    guard = ReplayGuard(max_sessions=2)
    for s in ("a", "b", "c"):
        guard.commit("srv", s, 4)
    guard.check("srv", "a", 0)  # forgotten: the documented limit
    with pytest.raises(Replay):
        guard.check("srv", "c", 4)


# ---------------------------------------------------------------------------------------------
# fuzzing: random bytes and mutations never escape as anything but a ProtocolError


def try_decode(frames, **kw):
    """The message, or the ProtocolError; any other exception fails the test."""
    try:
        return dec(frames, **kw)
    except ProtocolError as e:
        assert str(e) and "\n" not in str(e)
        return e


@pytest.mark.timeout(120)
@FUZZ
@given(
    frames=st.lists(st.binary(max_size=300), max_size=6),
    secret=st.sampled_from([None, SECRET]),
    guard=st.booleans(),
)
def test_fuzz_random_bytes(frames, secret, guard):
    with pytest.raises(ProtocolError):
        dec(frames, secret=secret, replay_guard=ReplayGuard() if guard else None)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.mark.timeout(120)
@FUZZ
@given(
    header=st.dictionaries(st.text(max_size=12), json_values, max_size=8),
    payload=st.lists(st.binary(max_size=64), max_size=4),
)
def test_fuzz_random_json_headers(header, payload):
    with pytest.raises(ProtocolError):
        dec([json.dumps(header).encode(), *payload])


messages = st.one_of(
    st.builds(
        make_group,
        n=st.integers(1, 4),
        lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
        prompt_id=st.one_of(st.integers(-5, 2**40), st.text(min_size=1, max_size=10)),
        seed=st.integers(0, 100),
    ),
    st.builds(make_push, bucket_bytes=st.integers(1, 4096)),
    st.sampled_from(["hello", "heartbeat", "reply"]).map(make_status),
)


def _header_paths(h: dict) -> list[list]:
    """Every key path in the header, so a mutation can reach any nested field."""
    out = []

    def walk(node, path):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            out.append([*path, k])
            if isinstance(v, (dict, list)):
                walk(v, [*path, k])

    walk(h, [])
    return out


@pytest.mark.timeout(180)
@FUZZ
@given(msg=messages, data=st.data(), secret=st.sampled_from([None, SECRET]))
def test_fuzz_lying_headers(msg, data, secret):
    """Signed but wrong headers (lying shapes, dtypes, sizes, fields) reach full validation."""
    frames = enc(msg)
    h = header_of(frames)
    path = data.draw(st.sampled_from(_header_paths(h)))
    node = h
    for key in path[:-1]:
        node = node[key]
    leaf = path[-1]
    value = data.draw(
        st.one_of(
            json_values,
            st.sampled_from([*DTYPES, "float64", "object", "<f8", "bool", ""]),
            st.lists(st.integers(-3, 2**40), max_size=3),
            st.integers(-(2**63), 2**63),
            st.just(None),
        )
    )
    if data.draw(st.booleans()) and isinstance(node, dict):
        node.pop(leaf)
    else:
        node[leaf] = value
    out = try_decode(rebuild(frames, header=h, secret=secret), secret=secret)
    if not isinstance(out, ProtocolError):  # a harmless edit: the result must be a valid message
        assert try_decode(enc(out)).__class__ is out.__class__


@pytest.mark.timeout(180)
@FUZZ
@given(msg=messages, data=st.data(), secret=st.sampled_from([None, SECRET]))
def test_fuzz_damaged_frames(msg, data, secret):
    """Truncated, missing, extra, swapped and flipped frames: BadAuth when signed, else typed."""
    frames = [bytes(memoryview(f).cast("B")) for f in enc(msg, secret=secret)]
    i = data.draw(st.integers(0, len(frames) - 1))
    op = data.draw(st.sampled_from(["truncate", "drop", "insert", "flip", "swap"]))
    damaged = list(frames)
    if op == "truncate":
        assume(len(frames[i]) > 0)
        damaged[i] = frames[i][: data.draw(st.integers(0, len(frames[i]) - 1))]
    elif op == "drop":
        del damaged[i]
    elif op == "insert":
        damaged.insert(i, data.draw(st.binary(max_size=64)))
    elif op == "flip":
        assume(len(frames[i]) > 0)
        pos = data.draw(st.integers(0, len(frames[i]) - 1))
        damaged[i] = frames[i][:pos] + bytes([frames[i][pos] ^ 0xFF]) + frames[i][pos + 1 :]
    else:
        j = data.draw(st.integers(0, len(frames) - 1))
        damaged[i], damaged[j] = damaged[j], damaged[i]
    assume(damaged != frames)
    out = try_decode(damaged, secret=secret)
    if secret is not None:
        assert isinstance(out, BadAuth), out
    elif not isinstance(out, ProtocolError):
        # payload bytes flipped, or two equal-sized payload frames swapped: still well-formed
        assert op in ("flip", "swap") and damaged[0] == frames[0]


@pytest.mark.timeout(60)
@FUZZ
@given(msg=messages, cut=st.integers(1, 10**6))
def test_fuzz_oversize(msg, cut):
    frames = enc(msg, secret=SECRET)
    total = sum(memoryview(f).nbytes for f in frames)
    with pytest.raises(TooLarge):
        dec(frames, secret=SECRET, max_bytes=max(0, total - cut))


@pytest.mark.timeout(60)
@FUZZ
@given(key=st.binary(min_size=1, max_size=40), strip=st.booleans())
def test_fuzz_bad_keys(key, strip):
    assume(key != SECRET)
    frames = enc(make_status(), secret=key)
    with pytest.raises(BadAuth):
        dec(frames[:-1] if strip else frames, secret=SECRET)


@pytest.mark.timeout(60)
@FUZZ
@given(stamps=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 6)), max_size=25))
def test_fuzz_replays(stamps):
    """Accepted exactly when seq is above the last accepted of that session."""
    guard, last = ReplayGuard(), {}
    msg = make_status()
    for session, seq in stamps:
        out = try_decode(enc(msg, secret=SECRET, session=session, seq=seq), secret=SECRET, replay_guard=guard)
        if seq > last.get(session, -1):
            assert isinstance(out, Status)
            last[session] = seq
        else:
            assert isinstance(out, Replay)


def test_json_number_limits():
    """Huge integers and overflowing floats in a header end as typed errors."""
    g = enc(make_group())
    huge = bytes(g[0]).replace(b'"reward":0.0', b'"reward":1' + b"0" * 5000)
    assert isinstance(try_decode([huge, *g[1:]]), BadHeader)
    inf = bytes(g[0]).replace(b'"reward":0.0', b'"reward":1e999')
    assert isinstance(try_decode([inf, *g[1:]]), BadField)


# -- the WeightRef message ---------------------------------------------------------------------------

META = (["a.weight", "a.weight_scale_inv"], ["float8_e4m3fn", "float32"], [[256, 128], [2, 1]])


def test_weight_ref_round_trips_with_hmac_and_strict_decoding():
    ref = WeightRef(
        version=7,
        scheme="fp8-block",
        transport="cuda-ipc",
        buckets=[META, (["b"], ["bfloat16"], [[3]])],
        payloads=[[b"rank0-b0", b"rank1-b0"], [b"rank0-b1", b"rank1-b1"]],
    )
    frames = encode(ref, sender="learner", session="s", seq=1, secret=b"key")
    got = decode(frames, secret=b"key", max_bytes=1 << 20, kinds=("weight_push", "weight_ref"))
    assert isinstance(got, WeightRef) and got.version == 7 and got.ranks == 2
    assert got.buckets[0] == (META[0], META[1], META[2]) and got.payloads[1] == [b"rank0-b1", b"rank1-b1"]
    tampered = list(frames)
    tampered[2] = bytes(b"x" * len(bytes(tampered[2])))
    with pytest.raises(BadAuth):
        decode(tampered, secret=b"key", max_bytes=1 << 20)
    unsigned = encode(ref, sender="learner", session="s", seq=1)
    with pytest.raises(BadFrame):  # a payload frame left out
        decode(unsigned[:-1], secret=None, max_bytes=1 << 20)
    nccl = WeightRef(version=1, scheme="none", transport="nccl", buckets=[(["w"], ["bfloat16"], [(4, 4)])])
    back = decode(encode(nccl, sender="l", session="s", seq=0), secret=None, max_bytes=1 << 20)
    assert back.transport == "nccl" and back.payloads == [] and back.buckets[0][2] == [[4, 4]]


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(transport="rdma"), "transport"),
        (dict(buckets=[]), "at least one bucket"),
        (dict(buckets=[(["w"], ["float64"], [[2]])]), "dtype"),
        (dict(buckets=[(["w"], ["float32"], [[-1]])]), "shape"),
        (dict(buckets=[(["w", "w"], ["float32"] * 2, [[1], [1]])]), "twice"),
        (dict(buckets=[(["w"], ["float32", "int8"], [[1]])]), "equal"),
        (dict(transport="nccl", payloads=[[b"x"]]), "nccl reference carries none"),
        (dict(payloads=[]), "one list per bucket"),
        (dict(payloads=[[b""]]), "bytes"),
    ],
)
def test_weight_ref_refuses_bad_fields(kwargs, fragment):
    fields = dict(
        version=1, scheme="none", transport="cuda-ipc", buckets=[(["w"], ["float32"], [[2]])], payloads=[[b"p"]]
    )
    fields.update(kwargs)
    with pytest.raises(BadField, match=fragment):
        WeightRef(**fields)
