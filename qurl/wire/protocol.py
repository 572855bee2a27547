"""Wire messages between rollout servers and the learner (design.md section 5), each declared once.

A message is a frozen dataclass whose fields say how they travel (`wire`): as the header key of their name (the
default), as the 1-D array frame of their name (`array=`), or `packed`: the header keys and arrays of a field that
is neither, with both directions side by side. `encode`, `decode` and validation all read that declaration. Each
field's check runs on construction and decoding constructs, so a message that exists is valid: wire input is
checked where it is decoded, and code that takes a message trusts it. Framing, HMAC and replay: qurl/wire/frames.py.

A TrajectoryGroup sends its samples as four flat arrays (prompt_ids, token_ids, logprobs, versions) plus
per-sample header rows (length, reward, finish_reason, reward_details), so a group costs five frames whatever its
size. A WeightPush sends uint8 buckets "bucket0".."bucketK" and a header list "tensors" of {name, dtype, shape,
nbytes, bucket, offset}; offsets are 64-byte aligned and the receiver gets views, not copies. How a delta push
names its entries: qurl/wire/delta_names.py; the bucket layout a WeightRef carries: qurl/wire/sglang_payload.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

import numpy as np

from qurl.wire import sglang_payload
from qurl.wire.delta_names import check_entries
from qurl.wire.frames import (
    DTYPES,
    ENVELOPE,
    MAX_NAME_CHARS,
    MAX_NDIM,
    Array,
    BadField,
    BadFrame,
    BadHeader,
    ReplayGuard,
    Views,
    WireTensor,
    check_array,
    check_float,
    check_int,
    check_json_dict,
    check_stamp,
    check_str,
    open_frames,
    pack_buckets,
    read_arrays,
    to_frames,
    unpack_buckets,
)

LOGPROB_TOL = 1e-4  # behaviour logprobs may round a hair above 0
FINISH_REASON_CHARS = 64
PUSH_BUCKET_BYTES = 512 << 20  # one uint8 frame of a WeightPush
PUSH_MODES = ("full", "delta")
REF_TRANSPORTS = ("cuda-ipc", "nccl")
# server -> learner: hello, heartbeat, bye, resend_weights (lagging, or a checksum mismatch), eval_result;
# learner -> server: reply (its version and the server's budget), resend_status (say hello again), eval_request
STATUS_TYPES = ("hello", "heartbeat", "bye", "reply", "resend_status", "resend_weights", "eval_request", "eval_result")
# the most each socket takes in one message (libzmq drops a bigger frame, decode a bigger message)
TRAJECTORY_MAX_BYTES = 64 << 20  # a group: prompt + n responses, far below this
CONTROL_MAX_BYTES = 1 << 20
WEIGHTS_MAX_BYTES = 1 << 40  # a full push of a large model; the HMAC and shape checks still apply

Check = Callable[[Any, str], Any]  # (value, field name) -> the value to keep; raises BadField


class Packed(NamedTuple):
    """How a field that is neither one header value nor one array travels, both directions."""

    keys: tuple[str, ...]  # the header keys it writes, in order
    arrays: Mapping[str, str] | None  # its arrays by name and dtype; None: it owns (and checks) every array
    encode: Callable[[Any], tuple[dict, list[Array]]]  # message -> (header part, arrays)
    decode: Callable[[dict, Views], Any]  # (header, arrays) -> the field's value, before its check


def wire(check: Check | None, *, array: str | None = None, packed: Packed | None = None, **default: Any) -> Any:
    """A message field: `check` validates it (None: the message's __post_init__, against other fields); it travels
    as the header key of its name, as the 1-D `array` frame of its name and that dtype, or as `packed` says."""
    return field(metadata={"check": check, "array": array, "packed": packed}, **default)


class Message:
    """A wire message: every field's check runs on construction, in field order."""

    KIND: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata["check"] is not None:
                object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name), f.name))


def _text(max_chars: int = MAX_NAME_CHARS, empty: bool = False) -> Check:
    return lambda value, name: check_str(value, name, max_chars=max_chars, empty=empty)


def _count(lo: int = 0) -> Check:
    return lambda value, name: check_int(value, name, lo=lo)


def _optional(check: Check) -> Check:
    return lambda value, name: value if value is None else check(value, name)


def _one_of(options: tuple[str, ...]) -> Check:
    def check(value: Any, name: str) -> str:
        if value not in options:
            raise BadField(f"{name}: {value!r} is not one of {options}")
        return value

    return check


# ---------------------------------------------------------------------------------------------
# trajectory_group

SAMPLE_ARRAYS = {"token_ids": "int32", "logprobs": "float32", "versions": "int32"}  # per token; concatenated
SAMPLE_ROW = ("length", "reward", "finish_reason", "reward_details")  # per sample, in the header


@dataclass(frozen=True, eq=False)
class Sample:
    """One sampled response with what the learner needs to train on it off-policy."""

    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], behaviour policy
    versions: np.ndarray  # int32 [T], weight version that produced each token
    reward: float
    finish_reason: str
    reward_details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        tok, lp, ver = (check_array(getattr(self, n), DTYPES[d], n) for n, d in SAMPLE_ARRAYS.items())
        if len(tok) < 1:
            raise BadField("token_ids: a sample needs at least one token")
        if not len(tok) == len(lp) == len(ver):
            raise BadField(f"sample lengths differ: token_ids {len(tok)}, logprobs {len(lp)}, versions {len(ver)}")
        if tok.min() < 0:
            raise BadField("token_ids: negative token id")
        if not np.isfinite(lp).all():
            raise BadField("logprobs: not finite")
        if lp.max() > LOGPROB_TOL:
            raise BadField(f"logprobs: {float(lp.max())} is above 0")
        if ver.min() < 0:
            raise BadField("versions: negative version")
        object.__setattr__(self, "token_ids", tok)
        object.__setattr__(self, "logprobs", lp)
        object.__setattr__(self, "versions", ver)
        object.__setattr__(self, "reward", check_float(self.reward, "reward"))
        check_str(self.finish_reason, "finish_reason", max_chars=FINISH_REASON_CHARS)
        check_json_dict(self.reward_details, "reward_details")


def _samples_out(group: TrajectoryGroup) -> tuple[dict, list[Array]]:
    rows = [
        dict(zip(SAMPLE_ROW, (len(s.token_ids), s.reward, s.finish_reason, s.reward_details))) for s in group.samples
    ]
    return {"samples": rows}, [
        (n, d, np.concatenate([getattr(s, n) for s in group.samples])) for n, d in SAMPLE_ARRAYS.items()
    ]


def _samples_in(h: dict, arrays: Views) -> tuple[Sample, ...]:
    rows = h["samples"]
    if not isinstance(rows, list) or not rows:
        raise BadField("samples: expected a non-empty list")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or set(r) != set(SAMPLE_ROW):
            raise BadField(f"samples[{i}]: expected {', '.join(SAMPLE_ROW)}")
        check_int(r["length"], f"samples[{i}].length", lo=1)
    total = sum(r["length"] for r in rows)
    for name in SAMPLE_ARRAYS:
        if len(arrays[name][1]) != total:
            raise BadFrame(f"{name}: {len(arrays[name][1])} entries, sample lengths sum to {total}")
    samples, pos = [], 0
    for r in rows:
        end = pos + r["length"]
        per_token = {name: arrays[name][1][pos:end] for name in SAMPLE_ARRAYS}
        samples.append(
            Sample(
                **per_token, reward=r["reward"], finish_reason=r["finish_reason"], reward_details=r["reward_details"]
            )
        )
        pos = end
    return tuple(samples)


def _prompt_id(value: Any, name: str) -> str | int:
    return check_str(value, name) if isinstance(value, str) else check_int(value, name, lo=None)


def _prompt_ids(value: Any, name: str) -> np.ndarray:
    prompt = check_array(value, DTYPES["int32"], name)
    if len(prompt) < 1 or prompt.min() < 0:
        raise BadField(f"{name}: need at least one non-negative token id")
    return prompt


def _samples(value: Any, name: str) -> tuple[Sample, ...]:
    samples = tuple(value)
    if not samples or not all(isinstance(s, Sample) for s in samples):
        raise BadField(f"{name}: need at least one Sample")
    return samples


@dataclass(frozen=True, eq=False)
class TrajectoryGroup(Message):
    """All samples of one prompt, sent as soon as they are scored so the learner never waits."""

    KIND: ClassVar[str] = "trajectory_group"
    prompt_id: str | int = wire(_prompt_id)
    group_id: str = wire(_text())
    server_id: str = wire(_text())
    prompt_ids: np.ndarray = wire(_prompt_ids, array="int32")  # [P]
    samples: tuple[Sample, ...] = wire(_samples, packed=Packed(("samples",), SAMPLE_ARRAYS, _samples_out, _samples_in))


# ---------------------------------------------------------------------------------------------
# weight_push


def _tensors(value: Any, name: str) -> dict[str, WireTensor]:
    if not isinstance(value, Mapping):
        raise BadField(f"{name}: expected a mapping, got {type(value).__name__}")
    tensors = {}
    for tensor, t in value.items():
        check_str(tensor, "tensor name")
        if isinstance(t, np.ndarray):
            t = WireTensor(t, t.dtype.name)
        if not isinstance(t, WireTensor):
            raise BadField(f"tensor {tensor}: expected WireTensor, got {type(t).__name__}")
        storage = DTYPES.get(t.dtype)
        if storage is None:
            raise BadField(f"tensor {tensor}: dtype {t.dtype!r} is not allowed")
        if t.data.dtype != storage or t.data.ndim > MAX_NDIM:
            raise BadField(
                f"tensor {tensor}: {t.dtype} needs {storage.name} storage with <= {MAX_NDIM} dims, got "
                f"{t.data.dtype.name} {t.data.shape}"
            )
        tensors[tensor] = t
    return tensors


def _buckets_out(push: WeightPush) -> tuple[dict, list[Array]]:
    entries, buckets = pack_buckets(push.tensors, push.bucket_bytes)
    return {"tensors": entries}, [(f"bucket{i}", "uint8", b) for i, b in enumerate(buckets)]


def _buckets_in(h: dict, arrays: Views) -> dict[str, WireTensor]:
    buckets = []
    for i, (name, (dtype, arr)) in enumerate(arrays.items()):
        if name != f"bucket{i}" or dtype != "uint8" or arr.ndim != 1:
            raise BadFrame(f"weight_push: array {i} is {name} {dtype}, expected bucket{i} uint8")
        buckets.append(arr)
    return unpack_buckets(h["tensors"], buckets)


@dataclass(frozen=True, eq=False, kw_only=True)
class WeightPush(Message):
    """New policy weights for the rollout engine, sent as buckets of at most bucket_bytes.

    Tensors keep their order; a tensor larger than bucket_bytes gets a bucket of its own.
    """

    KIND: ClassVar[str] = "weight_push"
    version: int = wire(_count())
    scheme: str = wire(_text(64))  # quantization scheme the tensors are in, e.g. "int8", "fp8", "bf16"
    mode: str = wire(_one_of(PUSH_MODES), default="full")  # "delta": only what changed since version - 1
    checksum: str | None = wire(_optional(_text(256)), default=None)  # of the codes and scales after applying
    bucket_bytes: int = wire(_count(1), default=PUSH_BUCKET_BYTES)
    tensors: Mapping[str, WireTensor] = wire(_tensors, packed=Packed(("tensors",), None, _buckets_out, _buckets_in))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_entries(self.tensors, self.mode)
        if self.mode == "delta" and self.checksum is None:
            raise BadField("checksum: a delta push must carry the checksum of the codes it results in")


# ---------------------------------------------------------------------------------------------
# status


def _numbers(value: Any, name: str) -> dict[str, float]:
    return {k: v if type(v) is int else check_float(v, f"{name}.{k}") for k, v in check_json_dict(value, name).items()}


@dataclass(frozen=True, eq=False)
class Status(Message):
    """Control-channel message: a server's hello / heartbeat / bye, or the learner's answer."""

    KIND: ClassVar[str] = "status"
    type: str = wire(_one_of(STATUS_TYPES))
    server_id: str = wire(_text())
    version: int = wire(_count())  # the sender's weight version (the learner's in a reply)
    engine: str = wire(_text(64, empty=True), default="")
    quant: str = wire(_text(64, empty=True), default="")
    running: int = wire(_count(), default=0)
    queued: int = wire(_count(), default=0)
    counters: Mapping[str, float] = wire(_numbers, default_factory=dict)
    # reply: the grant, groups this server may have admitted in its life (learner/budget.py)
    budget: int | None = wire(_optional(_count()), default=None)


# ---------------------------------------------------------------------------------------------
# weight_ref


def _payloads_out(ref: WeightRef) -> tuple[dict, list[Array]]:
    return {"ranks": ref.ranks}, [
        (f"payload{b}.{i}", "uint8", np.frombuffer(x, np.uint8))
        for b, p in enumerate(ref.payloads)
        for i, x in enumerate(p)
    ]


def _payloads_in(h: dict, arrays: Views) -> Sequence[Sequence[bytes]]:
    buckets, ranks = h["buckets"], check_int(h["ranks"], "ranks")
    if not isinstance(buckets, list):
        raise BadField("buckets: expected a list")
    want = [f"payload{b}.{i}" for b in range(len(buckets)) for i in range(ranks)]
    if list(arrays) != want or any(d != "uint8" or a.ndim != 1 for d, a in arrays.values()):
        raise BadFrame(
            f"weight_ref: arrays {list(arrays)[:4]}..., expected {len(want)} uint8 payloads "
            f"payload<bucket>.<rank> in order"
        )
    payloads = [[arrays[f"payload{b}.{i}"][1].tobytes() for i in range(ranks)] for b in range(len(buckets))]
    return payloads if ranks else ()


@dataclass(frozen=True, eq=False)
class WeightRef(Message):
    """A push whose tensors travel outside ZeroMQ (sync.transport cuda-ipc or nccl): what to load, not the bytes.

    buckets: one sglang_payload.bucket_meta per bucket, in load order. nccl: each bucket is one flattened broadcast
    from learner rank 0, right after this message. cuda-ipc: payloads[b][i] is bucket b serialized for global
    rank i (replica * tp_size + tp rank): opaque bytes that only SGLang's scheduler opens, with its allow-list
    unpickler; the rollout server never unpickles them, and the HMAC covers them like every frame.
    """

    KIND: ClassVar[str] = "weight_ref"
    version: int = wire(_count())
    scheme: str = wire(_text(64))
    transport: str = wire(_one_of(REF_TRANSPORTS))
    buckets: Sequence[sglang_payload.Meta] = wire(sglang_payload.check_metas)
    payloads: Sequence[Sequence[bytes]] = wire(
        None, packed=Packed(("ranks",), None, _payloads_out, _payloads_in), default=()
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        payloads = [list(p) for p in self.payloads] if isinstance(self.payloads, (list, tuple)) else None
        if self.transport == "nccl" and payloads:
            raise BadField("payloads: an nccl reference carries none (the buckets follow as broadcasts)")
        if self.transport == "cuda-ipc":
            payloads = sglang_payload.check_payloads(payloads, len(self.buckets), "payloads")
        object.__setattr__(self, "payloads", [[bytes(x) for x in p] for p in payloads or []])

    @property
    def ranks(self) -> int:
        """Per-rank payloads in each bucket (cuda-ipc); 0 for nccl."""
        return len(self.payloads[0]) if self.payloads else 0


KINDS: dict[str, type[Message]] = {c.KIND: c for c in (TrajectoryGroup, WeightPush, Status, WeightRef)}


# ---------------------------------------------------------------------------------------------
# encode and decode, from the declarations above


@functools.cache
def _layout(cls: type[Message]) -> tuple[tuple[str, ...], dict[str, str] | None]:
    """(header keys in order, every array by name and dtype; None where a packed field owns them) of a kind."""
    keys: list[str] = []
    arrays: dict[str, str] = {}
    owned = False
    for f in fields(cls):
        array, packed = f.metadata["array"], f.metadata["packed"]
        if packed is not None:
            keys += packed.keys
            arrays.update(packed.arrays or {})
            owned = owned or packed.arrays is None
        elif array is not None:
            arrays[f.name] = array
        else:
            keys.append(f.name)
    return tuple(keys), None if owned else arrays


def encode(msg: Message, *, sender: str, session: str, seq: int, secret: bytes | None = None) -> list[Any]:
    """Message -> frames for zmq send_multipart(copy=False); frames may alias msg's arrays."""
    if not isinstance(msg, Message):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    header: dict = {}
    arrays: list[Array] = []
    for f in fields(msg):
        array, packed = f.metadata["array"], f.metadata["packed"]
        if packed is not None:
            part, more = packed.encode(msg)
            header.update(part)
            arrays += more
        elif array is not None:
            arrays.append((f.name, array, getattr(msg, f.name)))
        else:
            header[f.name] = getattr(msg, f.name)
    return to_frames(msg.KIND, header, arrays, sender=sender, session=session, seq=seq, secret=secret)


def _check_fixed(kind: str, expected: Mapping[str, str], arrays: Views) -> None:
    if set(arrays) != set(expected):
        raise BadFrame(f"{kind}: arrays {sorted(arrays)}, expected {sorted(expected)}")
    for name, (dtype, arr) in arrays.items():
        if dtype != expected[name] or arr.ndim != 1:
            raise BadFrame(f"{name}: {dtype} {list(arr.shape)}, expected 1-D {expected[name]}")


def decode(
    frames: Sequence[Any],
    *,
    secret: bytes | None,
    max_bytes: int,
    replay_guard: ReplayGuard | None = None,
    kinds: Collection[str] | None = None,
) -> Message:
    """Frames -> message, or a ProtocolError subclass naming the first thing that is wrong.

    Order: sizes, MAC (before any parsing when a secret is set), header, replay, kind, arrays,
    fields; the replay guard only advances once the whole message is valid. The returned arrays
    are read-only views of the frames (no copy).
    """
    views, h = open_frames(frames, secret=secret, max_bytes=max_bytes)
    kind = h["kind"]
    if not isinstance(kind, str) or kind not in KINDS:
        raise BadHeader(f"unknown kind {kind!r}")
    sender, session, seq = check_stamp(h, secret)
    if replay_guard is not None:
        replay_guard.check(sender, session, seq)
    if kinds is not None and kind not in kinds:
        raise BadHeader(f"kind {kind} is not accepted here (expects {', '.join(sorted(kinds))})")
    cls = KINDS[kind]
    keys, fixed = _layout(cls)
    extra = sorted(set(h) - set(ENVELOPE) - set(keys))
    missing = [k for k in keys if k not in h]
    if extra or missing:
        raise BadHeader(f"{kind} header: unknown {extra}, missing {missing}")
    arrays = read_arrays(h, views)
    if fixed is not None:
        _check_fixed(kind, fixed, arrays)
    values = {}
    for f in fields(cls):
        array, packed = f.metadata["array"], f.metadata["packed"]
        values[f.name] = packed.decode(h, arrays) if packed else arrays[f.name][1] if array else h[f.name]
    msg = cls(**values)
    if replay_guard is not None:
        replay_guard.commit(sender, session, seq)
    return msg
