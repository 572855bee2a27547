"""Wire protocol between rollout servers and the learner (design.md section 5).

A message is a list of frames:

    frame 0      UTF-8 JSON header: {"kind", "schema", "sender", "session", "seq", "auth",
                 ...message fields..., "arrays": [{"name", "dtype", "shape", "nbytes"}, ...]}
    frame 1..n   one raw little-endian buffer per entry of "arrays", in order
    frame n+1    only when header "auth" == "hmac-sha256": the 32-byte HMAC-SHA256 (key = the
                 shared secret) over every earlier frame, each fed as an 8-byte little-endian
                 length followed by its bytes (so frame boundaries are authenticated too)

No pickle, no eval: headers are JSON, payloads are raw arrays of allow-listed dtypes. bfloat16 and
float8_e4m3fn travel as raw 2-byte / 1-byte words; numpy holds them as uint16 / uint8 next to
their logical dtype name (`WireTensor`), and `to_torch` / `from_torch` reinterpret without a copy.

Message fields sit in the header next to the envelope. A TrajectoryGroup sends its samples as
four flat arrays (prompt_ids, token_ids, logprobs, versions) plus per-sample header rows (length,
reward, finish_reason, reward_details), so a group costs five frames whatever its size. A
WeightPush sends uint8 buckets "bucket0".."bucketK" and a header list "tensors" of {name, dtype,
shape, nbytes, bucket, offset}; offsets are 64-byte aligned and the receiver gets views, not copies.

Replay protection: every sender stamps its messages with its id, a random per-socket session
nonce and a sequence number that rises with each message (gaps are fine: PUB/SUB may drop).
`ReplayGuard` (one per receiving socket) remembers the highest seq accepted per (sender,
session), so a restarted server (new nonce, seq from 0) is accepted and a replayed frame (known
nonce, seq not above the last) is refused. With a secret set, the MAC covers the stamp, so only
holders of the secret can open sessions; the guard forgets the oldest session after
`max_sessions` newer ones (4096 by default), and only then could that session's frames replay.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import warnings
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Union

import numpy as np

SCHEMA_VERSION = 1
AUTH_SCHEME = "hmac-sha256"
MAC_BYTES = 32
MAX_HEADER_BYTES = 4 << 20
DEFAULT_BUCKET_BYTES = 512 << 20
LOGPROB_TOL = 1e-4  # behaviour logprobs may round a hair above 0
MAX_NAME_CHARS = 512
MAX_NDIM = 8
BUCKET_ALIGN = 64

# logical dtype name -> numpy storage dtype (explicitly little-endian)
DTYPES: dict[str, np.dtype] = {
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "float8_e4m3fn": np.dtype("u1"),
}
FINISH_REASON_CHARS = 64
PUSH_MODES = ("full", "delta")
# a delta push names a changed tensor X as "X@val" (the new elements, X's dtype) plus where they go: either
# "X@idx" (strictly increasing flat int32 / int64 indices) or "X@mask" (uint8, one bit per flat element from
# element 0, least significant bit first, as many bytes as reach the last change); tensors sent whole keep their name
DELTA_INDEX, DELTA_MASK, DELTA_VALUES = "@idx", "@mask", "@val"
INDEX_DTYPES = ("int32", "int64")
# server -> learner: hello, heartbeat, bye, resend_weights (lagging, or a checksum mismatch);
# learner -> server: reply (its version and the server's budget), resend_status (say hello again)
REF_TRANSPORTS = ("cuda-ipc", "nccl")
# tensor dtypes a weight reference may name (torch names, as SGLang's receivers take them)
REF_DTYPES = ("bfloat16", "float16", "float32", "int8", "uint8", "float8_e4m3fn")
MAX_REF_PAYLOAD_BYTES = 64 << 20
STATUS_TYPES = ("hello", "heartbeat", "bye", "reply", "resend_status", "resend_weights", "eval_request",
                "eval_result")


class ProtocolError(ValueError):
    """A message broke the protocol; receivers log, count and drop it."""


class BadHeader(ProtocolError):
    """Frame 0 is not a valid header (JSON, kind, schema, envelope fields)."""


class BadField(ProtocolError):
    """A message field has the wrong type or an impossible value."""


class BadFrame(ProtocolError):
    """The payload frames do not match what the header declares."""


class BadAuth(ProtocolError):
    """The HMAC is missing or wrong."""


class Replay(ProtocolError):
    """The (sender, session, seq) stamp was already seen: a replayed or duplicated frame."""


class TooLarge(ProtocolError):
    """The message or its header exceeds the receiver's size limit."""


# ---------------------------------------------------------------------------------------------
# field checks (shared by construction and decoding, so both sides enforce the same rules)


def _str(value: Any, name: str, *, max_chars: int = MAX_NAME_CHARS, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise BadField(f"{name}: expected str, got {type(value).__name__}")
    if not empty and not value:
        raise BadField(f"{name}: must not be empty")
    if len(value) > max_chars:
        raise BadField(f"{name}: longer than {max_chars} chars")
    return value


def _int(value: Any, name: str, *, lo: int | None = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadField(f"{name}: expected int, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise BadField(f"{name}: {value} is below {lo}")
    return value


def _float(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadField(f"{name}: expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise BadField(f"{name}: {value} is not finite")
    return value


def _json_dict(value: Any, name: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise BadField(f"{name}: expected a JSON object with str keys")
    return value


def _array(value: Any, dtype: np.dtype, name: str) -> np.ndarray:
    """1-D array of `dtype`; integer inputs must fit, float targets take any real numbers."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise BadField(f"{name}: expected a 1-D array, got shape {arr.shape}")
    if arr.dtype == dtype:
        return arr
    if arr.size == 0:
        return arr.astype(dtype)
    if dtype.kind == "i" and arr.dtype.kind in "iu":
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise BadField(f"{name}: values outside {dtype.name}")
        return arr.astype(dtype)
    if dtype.kind == "f" and arr.dtype.kind in "fiu":
        return arr.astype(dtype)
    raise BadField(f"{name}: dtype {arr.dtype.name} cannot become {dtype.name}")


# ---------------------------------------------------------------------------------------------
# messages

I32 = DTYPES["int32"]
F32 = DTYPES["float32"]


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
        tok = _array(self.token_ids, I32, "token_ids")
        lp = _array(self.logprobs, F32, "logprobs")
        ver = _array(self.versions, I32, "versions")
        if len(tok) < 1:
            raise BadField("token_ids: a sample needs at least one token")
        if not len(tok) == len(lp) == len(ver):
            raise BadField(
                f"sample lengths differ: token_ids {len(tok)}, logprobs {len(lp)}, "
                f"versions {len(ver)}"
            )
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
        object.__setattr__(self, "reward", _float(self.reward, "reward"))
        _str(self.finish_reason, "finish_reason", max_chars=FINISH_REASON_CHARS)
        _json_dict(self.reward_details, "reward_details")


@dataclass(frozen=True, eq=False)
class TrajectoryGroup:
    """All samples of one prompt, sent as soon as they are scored so the learner never waits."""

    KIND: ClassVar[str] = "trajectory_group"
    prompt_id: Union[str, int]
    group_id: str
    server_id: str
    prompt_ids: np.ndarray  # int32 [P]
    samples: tuple[Sample, ...]

    def __post_init__(self) -> None:
        if isinstance(self.prompt_id, str):
            _str(self.prompt_id, "prompt_id")
        else:
            _int(self.prompt_id, "prompt_id", lo=None)
        _str(self.group_id, "group_id")
        _str(self.server_id, "server_id")
        prompt = _array(self.prompt_ids, I32, "prompt_ids")
        if len(prompt) < 1 or prompt.min() < 0:
            raise BadField("prompt_ids: need at least one non-negative token id")
        object.__setattr__(self, "prompt_ids", prompt)
        samples = tuple(self.samples)
        if not samples or not all(isinstance(s, Sample) for s in samples):
            raise BadField("samples: need at least one Sample")
        object.__setattr__(self, "samples", samples)


class WireTensor(NamedTuple):
    """An array plus its logical dtype; bf16 / fp8 are raw uint16 / uint8 words in `data`."""

    data: np.ndarray
    dtype: str


@dataclass(frozen=True, eq=False)
class WeightPush:
    """New policy weights for the rollout engine, sent as buckets of at most bucket_bytes.

    Tensors keep their order; a tensor larger than bucket_bytes gets a bucket of its own.
    """

    KIND: ClassVar[str] = "weight_push"
    version: int
    scheme: str  # quantization scheme the tensors are in, e.g. "int8", "fp8", "bf16"
    tensors: Mapping[str, WireTensor]
    mode: str = "full"  # "full" or "delta": only what changed since version - 1 (qurl/delta.py)
    checksum: str | None = None  # of the codes and scales after applying (qurl.delta.checksum)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __post_init__(self) -> None:
        _int(self.version, "version")
        _str(self.scheme, "scheme", max_chars=64)
        if self.mode not in PUSH_MODES:
            raise BadField(f"mode: {self.mode!r} is not one of {PUSH_MODES}")
        if self.checksum is not None:
            _str(self.checksum, "checksum", max_chars=256)
        _int(self.bucket_bytes, "bucket_bytes", lo=1)
        if not isinstance(self.tensors, Mapping):
            raise BadField(f"tensors: expected a mapping, got {type(self.tensors).__name__}")
        tensors = {}
        for name, t in self.tensors.items():
            _str(name, "tensor name")
            if isinstance(t, np.ndarray):
                t = WireTensor(t, t.dtype.name)
            if not isinstance(t, WireTensor):
                raise BadField(f"tensor {name}: expected WireTensor, got {type(t).__name__}")
            storage = DTYPES.get(t.dtype)
            if storage is None:
                raise BadField(f"tensor {name}: dtype {t.dtype!r} is not allowed")
            if t.data.dtype != storage or t.data.ndim > MAX_NDIM:
                raise BadField(
                    f"tensor {name}: {t.dtype} needs {storage.name} storage with <= {MAX_NDIM} "
                    f"dims, got {t.data.dtype.name} {t.data.shape}"
                )
            tensors[name] = t
        _check_delta_pairs(tensors, self.mode)
        if self.mode == "delta" and self.checksum is None:
            raise BadField("checksum: a delta push must carry the checksum of the codes it results in")
        object.__setattr__(self, "tensors", tensors)


def _check_delta_pairs(tensors: Mapping[str, WireTensor], mode: str) -> None:
    """Every X@val has one X@idx or X@mask that places exactly its values; indices rise from 0 up; X is not also whole."""
    parts = (DELTA_INDEX, DELTA_MASK, DELTA_VALUES)
    for name, t in tensors.items():
        if "@" not in name:
            continue
        base, _, part = name.rpartition("@")
        if mode != "delta":
            raise BadField(f"tensor {name}: '@' names are delta entries, and this push is {mode}")
        if not base or "@" + part not in parts:
            raise BadField(f"tensor {name}: a delta entry is named X{DELTA_INDEX}, X{DELTA_MASK} or X{DELTA_VALUES}")
        if base in tensors:
            raise BadField(f"tensor {base}: sent both whole and as a delta")
        if "@" + part != DELTA_VALUES:
            if base + DELTA_VALUES not in tensors:
                raise BadField(f"tensor {name}: its pair {base}{DELTA_VALUES} is missing")
            continue
        where = [base + p for p in (DELTA_INDEX, DELTA_MASK) if base + p in tensors]
        if len(where) != 1:
            raise BadField(f"tensor {name}: needs exactly one of its pairs {base}{DELTA_INDEX} or {base}{DELTA_MASK}, "
                           f"got {len(where)}")
        pos = tensors[where[0]]
        if t.data.ndim != 1 or pos.data.ndim != 1:
            raise BadField(f"tensor {base}: delta entries must be 1-D, got {list(pos.data.shape)} and {list(t.data.shape)}")
        if where[0].endswith(DELTA_MASK):
            if pos.dtype != "uint8":
                raise BadField(f"tensor {base}: a delta mask is uint8, got {pos.dtype}")
            count = int(np.bitwise_count(pos.data).sum())
        else:
            if pos.dtype not in INDEX_DTYPES:
                raise BadField(f"tensor {base}: delta indices must be {' or '.join(INDEX_DTYPES)}, got {pos.dtype}")
            idx = pos.data
            if len(idx) and (idx[0] < 0 or not (np.diff(idx) > 0).all()):
                raise BadField(f"tensor {base}: delta indices must be >= 0 and strictly increasing")
            count = len(idx)
        if count != len(t.data):
            raise BadField(f"tensor {base}: the delta places {count} elements but carries {len(t.data)} values")


@dataclass(frozen=True, eq=False)
class Status:
    """Control-channel message: a server's hello / heartbeat / bye, or the learner's answer."""

    KIND: ClassVar[str] = "status"
    type: str
    server_id: str
    version: int  # the sender's weight version (the learner's in a reply)
    engine: str = ""
    quant: str = ""
    running: int = 0
    queued: int = 0
    counters: Mapping[str, float] = field(default_factory=dict)
    budget: int | None = None  # reply: the grant, groups this server may have admitted in its life (learner/budget.py)

    def __post_init__(self) -> None:
        if self.type not in STATUS_TYPES:
            raise BadField(f"type: {self.type!r} is not one of {STATUS_TYPES}")
        _str(self.server_id, "server_id")
        _int(self.version, "version")
        _str(self.engine, "engine", max_chars=64, empty=True)
        _str(self.quant, "quant", max_chars=64, empty=True)
        _int(self.running, "running")
        _int(self.queued, "queued")
        counters = {
            k: v if type(v) is int else _float(v, f"counters.{k}")
            for k, v in _json_dict(self.counters, "counters").items()
        }
        object.__setattr__(self, "counters", counters)
        if self.budget is not None:
            _int(self.budget, "budget")


@dataclass(frozen=True, eq=False)
class WeightRef:
    """A push whose tensors travel outside ZeroMQ (sync.transport cuda-ipc or nccl): what to load, not the bytes.

    buckets: one (names, dtypes, shapes) per bucket, in load order. nccl: each bucket is one flattened broadcast
    from learner rank 0, right after this message. cuda-ipc: payloads[b][i] is bucket b serialized for global
    rank i (replica * tp_size + tp rank): opaque bytes that only SGLang's scheduler opens, with its allow-list
    unpickler; the rollout server never unpickles them, and the HMAC covers them like every frame.
    """

    KIND: ClassVar[str] = "weight_ref"
    version: int
    scheme: str
    transport: str
    buckets: Sequence[tuple[Sequence[str], Sequence[str], Sequence[Sequence[int]]]]
    payloads: Sequence[Sequence[bytes]] = ()

    def __post_init__(self) -> None:
        _int(self.version, "version")
        _str(self.scheme, "scheme", max_chars=64)
        if self.transport not in REF_TRANSPORTS:
            raise BadField(f"transport: {self.transport!r} is not one of {REF_TRANSPORTS}")
        if not isinstance(self.buckets, (list, tuple)) or not self.buckets:
            raise BadField("buckets: need at least one bucket")
        buckets, seen = [], set()
        for b, bucket in enumerate(self.buckets):
            if not isinstance(bucket, (list, tuple)) or len(bucket) != 3:
                raise BadField(f"buckets[{b}]: expected [names, dtypes, shapes]")
            names, dtypes, shapes = (list(x) if isinstance(x, (list, tuple)) else None for x in bucket)
            if names is None or dtypes is None or shapes is None or not names or not len(names) == len(dtypes) == len(shapes):
                raise BadField(f"buckets[{b}]: names, dtypes and shapes must be lists of one equal, non-zero length")
            checked = []
            for name, dtype, shape in zip(names, dtypes, shapes):
                _str(name, f"buckets[{b}] name")
                if name in seen:
                    raise BadField(f"buckets: {name} appears twice")
                seen.add(name)
                if dtype not in REF_DTYPES:
                    raise BadField(f"buckets[{b}] {name}: dtype {dtype!r} is not one of {REF_DTYPES}")
                try:
                    checked.append(list(_shape(list(shape) if isinstance(shape, tuple) else shape, name)))
                except BadFrame:
                    raise BadField(f"buckets[{b}] {name}: shape {shape!r} is not a list of non-negative ints") from None
            buckets.append((names, dtypes, checked))
        object.__setattr__(self, "buckets", buckets)
        payloads = [list(p) for p in self.payloads] if isinstance(self.payloads, (list, tuple)) else None
        if self.transport == "nccl" and payloads:
            raise BadField("payloads: an nccl reference carries none (the buckets follow as broadcasts)")
        if self.transport == "cuda-ipc":
            if payloads is None or len(payloads) != len(buckets):
                raise BadField(f"payloads: cuda-ipc needs one list per bucket ({len(buckets)})")
            ranks = {len(p) for p in payloads}
            if len(ranks) != 1 or 0 in ranks:
                raise BadField("payloads: every bucket needs the same non-zero number of per-rank payloads")
            for p in payloads:
                for item in p:
                    if not isinstance(item, (bytes, bytearray, memoryview)) or not 0 < len(item) <= MAX_REF_PAYLOAD_BYTES:
                        raise BadField(f"payloads: each must be 1 to {MAX_REF_PAYLOAD_BYTES} bytes")
        object.__setattr__(self, "payloads", [[bytes(x) for x in p] for p in payloads or []])

    @property
    def ranks(self) -> int:
        """Per-rank payloads in each bucket (cuda-ipc); 0 for nccl."""
        return len(self.payloads[0]) if self.payloads else 0


Message = Union[TrajectoryGroup, WeightPush, Status, WeightRef]
KINDS: dict[str, type] = {c.KIND: c for c in (TrajectoryGroup, WeightPush, Status, WeightRef)}


# ---------------------------------------------------------------------------------------------
# torch interop (torch imported lazily: the protocol itself needs only numpy)


def from_torch(tensor: Any) -> WireTensor:
    """CPU tensor -> WireTensor sharing its memory (a copy only if it is on GPU or strided)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise BadField(f"tensor dtype {name} is not allowed on the wire")
    if name == "bfloat16":
        return WireTensor(t.view(torch.int16).numpy().view(DTYPES[name]), name)
    if name == "float8_e4m3fn":
        return WireTensor(t.view(torch.uint8).numpy(), name)
    return WireTensor(t.numpy(), name)


def to_torch(array: np.ndarray, dtype_name: str) -> Any:
    """Array of a logical dtype -> torch tensor on the same memory; copy_ it, do not write it."""
    import torch

    if dtype_name not in DTYPES or array.dtype != DTYPES[dtype_name]:
        raise BadField(f"array of {array.dtype.name} is not {dtype_name} storage")
    if dtype_name == "bfloat16":
        array, view = array.view(np.int16), torch.bfloat16
    elif dtype_name == "float8_e4m3fn":
        view = torch.float8_e4m3fn
    else:
        view = None
    with warnings.catch_warnings():  # received frames may be read-only; callers only read them
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(array)
    return t.view(view) if view is not None else t


# ---------------------------------------------------------------------------------------------
# replay guard


class ReplayGuard:
    """Highest accepted seq per (sender, session); refuses anything not above it."""

    def __init__(self, max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        self._last: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.last_stamp: tuple[str, str, int] | None = None  # of the last accepted message, for the learner's books

    def check(self, sender: str, session: str, seq: int) -> None:
        last = self._last.get((sender, session))
        if last is not None and seq <= last:
            raise Replay(f"replay from {sender}/{session}: seq {seq} <= last accepted {last}")

    def commit(self, sender: str, session: str, seq: int) -> None:
        key = (sender, session)
        self._last[key] = seq
        self.last_stamp = (sender, session, seq)
        self._last.move_to_end(key)
        if len(self._last) > self.max_sessions:  # oldest session forgotten, documented limit
            self._last.popitem(last=False)


# ---------------------------------------------------------------------------------------------
# encode


def _mac(secret: bytes, frames: Sequence[Any]) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for f in frames:
        mv = memoryview(f).cast("B")
        h.update(struct.pack("<Q", mv.nbytes))
        h.update(mv)
    return h.digest()


def _raw(arr: np.ndarray, storage: np.dtype) -> np.ndarray:
    """Contiguous little-endian bytes of arr as a flat uint8 view (no copy when already so)."""
    return np.ascontiguousarray(arr, dtype=storage).reshape(-1).view(np.uint8)


def _desc(name: str, dtype: str, arr: np.ndarray) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(arr.shape), "nbytes": int(arr.nbytes)}


def _pack(push: WeightPush) -> tuple[list[dict], list[np.ndarray]]:
    """Tensors -> header entries and uint8 buckets; a tensor above bucket_bytes gets its own."""
    entries: list[dict] = []
    groups: list[list[tuple[int, np.ndarray]]] = [[]]
    size = 0
    for name, (data, dtype) in push.tensors.items():
        start = -(-size // BUCKET_ALIGN) * BUCKET_ALIGN
        if groups[-1] and start + data.nbytes > push.bucket_bytes:
            groups.append([])
            start = 0
        groups[-1].append((start, data))
        size = start + data.nbytes
        entry = _desc(name, dtype, data)
        entry.update(bucket=len(groups) - 1, offset=start)
        entries.append(entry)
    buckets = []
    for group in groups:
        end = group[-1][0] + group[-1][1].nbytes if group else 0
        buf = np.empty(end, np.uint8)
        pos = 0
        for start, data in group:
            buf[pos:start] = 0
            buf[start : start + data.nbytes] = _raw(data, data.dtype)
            pos = start + data.nbytes
        buckets.append(buf)
    return entries, buckets


def _fields(msg: Message) -> tuple[dict, list[tuple[str, str, np.ndarray]]]:
    """Header fields and (name, dtype, array) payload of one message."""
    if isinstance(msg, TrajectoryGroup):
        s = msg.samples
        fields = {
            "prompt_id": msg.prompt_id,
            "group_id": msg.group_id,
            "server_id": msg.server_id,
            "samples": [
                {
                    "length": len(x.token_ids),
                    "reward": x.reward,
                    "finish_reason": x.finish_reason,
                    "reward_details": x.reward_details,
                }
                for x in s
            ],
        }
        arrays = [
            ("prompt_ids", "int32", msg.prompt_ids),
            ("token_ids", "int32", np.concatenate([x.token_ids for x in s])),
            ("logprobs", "float32", np.concatenate([x.logprobs for x in s])),
            ("versions", "int32", np.concatenate([x.versions for x in s])),
        ]
        return fields, arrays
    if isinstance(msg, WeightPush):
        entries, buckets = _pack(msg)
        fields = {
            "version": msg.version,
            "scheme": msg.scheme,
            "mode": msg.mode,
            "checksum": msg.checksum,
            "bucket_bytes": msg.bucket_bytes,
            "tensors": entries,
        }
        return fields, [(f"bucket{i}", "uint8", b) for i, b in enumerate(buckets)]
    if isinstance(msg, Status):
        fields = {
            k: getattr(msg, k)
            for k in ("type", "server_id", "version", "engine", "quant", "running", "queued")
        }
        fields.update(counters=dict(msg.counters), budget=msg.budget)
        return fields, []
    if isinstance(msg, WeightRef):
        fields = {"version": msg.version, "scheme": msg.scheme, "transport": msg.transport,
                  "buckets": [list(b) for b in msg.buckets], "ranks": msg.ranks}
        return fields, [(f"payload{b}.{i}", "uint8", np.frombuffer(x, np.uint8))
                        for b, p in enumerate(msg.payloads) for i, x in enumerate(p)]
    raise TypeError(f"not a protocol message: {type(msg).__name__}")


def encode(
    msg: Message, *, sender: str, session: str, seq: int, secret: bytes | None = None
) -> list[Any]:
    """Message -> frames for zmq send_multipart(copy=False); frames may alias msg's arrays."""
    fields, arrays = _fields(msg)
    header = {
        "kind": msg.KIND,
        "schema": SCHEMA_VERSION,
        "sender": _str(sender, "sender"),
        "session": _str(session, "session", max_chars=64),
        "seq": _int(seq, "seq"),
        "auth": AUTH_SCHEME if secret is not None else None,
        **fields,
        "arrays": [_desc(name, dtype, arr) for name, dtype, arr in arrays],
    }
    frames: list[Any] = [
        json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    ]
    frames += [_raw(arr, DTYPES[dtype]) for _, dtype, arr in arrays]
    if secret is not None:
        frames.append(_mac(secret, frames))
    return frames


# ---------------------------------------------------------------------------------------------
# decode

_ENVELOPE = ("kind", "schema", "sender", "session", "seq", "auth", "arrays")
_FIELDS = {
    "trajectory_group": ("prompt_id", "group_id", "server_id", "samples"),
    "weight_push": ("version", "scheme", "mode", "checksum", "bucket_bytes", "tensors"),
    "status": (
        "type", "server_id", "version", "engine", "quant", "running", "queued", "counters",
        "budget",
    ),
    "weight_ref": ("version", "scheme", "transport", "buckets", "ranks"),
}
_ARRAYS = {
    "trajectory_group": {
        "prompt_ids": "int32", "token_ids": "int32", "logprobs": "float32", "versions": "int32",
    },
    "status": {},
}


def _reject_constant(name: str) -> None:
    raise BadHeader(f"header holds the non-finite number {name}")


def _header(frame: memoryview) -> dict:
    if frame.nbytes > MAX_HEADER_BYTES:
        raise TooLarge(f"header is {frame.nbytes} bytes, limit {MAX_HEADER_BYTES}")
    try:
        header = json.loads(bytes(frame).decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise BadHeader(f"frame 0 is not a UTF-8 JSON header: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise BadHeader(f"header is a JSON {type(header).__name__}, expected an object")
    return header


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise BadFrame(f"{name}: shape must be a list of at most {MAX_NDIM} ints")
    for d in value:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise BadFrame(f"{name}: shape {value} has an entry that is not a non-negative int")
    return tuple(value)


def _arrays(descs: Any, frames: Sequence[memoryview]) -> dict[str, tuple[str, np.ndarray]]:
    """Check each declared array against its frame; return name -> (dtype, read-only view)."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    for i, (d, frame) in enumerate(zip(descs, frames)):
        if not isinstance(d, dict) or set(d) != {"name", "dtype", "shape", "nbytes"}:
            raise BadFrame(f"arrays[{i}]: expected keys name, dtype, shape, nbytes")
        name = d["name"]
        if not isinstance(name, str) or not name or name in out:
            raise BadFrame(f"arrays[{i}]: name missing or repeated")
        storage = DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
        if storage is None:
            raise BadFrame(f"{name}: dtype {d['dtype']!r} is not allowed")
        shape = _shape(d["shape"], name)
        nbytes = d["nbytes"]
        want = math.prod(shape) * storage.itemsize
        if not (type(nbytes) is int and nbytes == want == frame.nbytes):
            raise BadFrame(
                f"{name}: shape {list(shape)} x {d['dtype']} is {want} bytes, header says "
                f"{nbytes!r}, frame has {frame.nbytes}"
            )
        out[name] = (d["dtype"], np.frombuffer(frame, dtype=storage).reshape(shape))
    return out


def _fixed_arrays(kind: str, arrays: dict[str, tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    expected = _ARRAYS[kind]
    if set(arrays) != set(expected):
        raise BadFrame(f"{kind}: arrays {sorted(arrays)}, expected {sorted(expected)}")
    for name, (dtype, arr) in arrays.items():
        if dtype != expected[name] or arr.ndim != 1:
            raise BadFrame(f"{name}: {dtype} {list(arr.shape)}, expected 1-D {expected[name]}")
    return {name: arr for name, (_, arr) in arrays.items()}


def _trajectory(h: dict, arrays: dict[str, tuple[str, np.ndarray]]) -> TrajectoryGroup:
    a = _fixed_arrays("trajectory_group", arrays)
    rows = h["samples"]
    if not isinstance(rows, list) or not rows:
        raise BadField("samples: expected a non-empty list")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or set(r) != {
            "length", "reward", "finish_reason", "reward_details",
        }:
            raise BadField(f"samples[{i}]: expected length, reward, finish_reason, reward_details")
        _int(r["length"], f"samples[{i}].length", lo=1)
    total = sum(r["length"] for r in rows)
    for name in ("token_ids", "logprobs", "versions"):
        if len(a[name]) != total:
            raise BadFrame(f"{name}: {len(a[name])} entries, sample lengths sum to {total}")
    samples, pos = [], 0
    for r in rows:
        end = pos + r["length"]
        samples.append(
            Sample(
                token_ids=a["token_ids"][pos:end],
                logprobs=a["logprobs"][pos:end],
                versions=a["versions"][pos:end],
                reward=r["reward"],
                finish_reason=r["finish_reason"],
                reward_details=r["reward_details"],
            )
        )
        pos = end
    return TrajectoryGroup(
        prompt_id=h["prompt_id"],
        group_id=h["group_id"],
        server_id=h["server_id"],
        prompt_ids=a["prompt_ids"],
        samples=tuple(samples),
    )


def _weight_push(h: dict, arrays: dict[str, tuple[str, np.ndarray]]) -> WeightPush:
    buckets = []
    for i, (name, (dtype, arr)) in enumerate(arrays.items()):
        if name != f"bucket{i}" or dtype != "uint8" or arr.ndim != 1:
            raise BadFrame(f"weight_push: array {i} is {name} {dtype}, expected bucket{i} uint8")
        buckets.append(arr)
    entries = h["tensors"]
    if not isinstance(entries, list):
        raise BadField("tensors: expected a list")
    keys = {"name", "dtype", "shape", "nbytes", "bucket", "offset"}
    tensors: dict[str, WireTensor] = {}
    spans: list[tuple[int, int, int, str]] = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or set(e) != keys:
            raise BadField(f"tensors[{i}]: expected keys {sorted(keys)}")
        name = _str(e["name"], f"tensors[{i}].name")
        if name in tensors:
            raise BadField(f"tensors: {name} appears twice")
        storage = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if storage is None:
            raise BadFrame(f"{name}: dtype {e['dtype']!r} is not allowed")
        shape = _shape(e["shape"], name)
        b = _int(e["bucket"], f"{name}.bucket")
        off = _int(e["offset"], f"{name}.offset")
        n = math.prod(shape) * storage.itemsize
        fits = b < len(buckets) and off + n <= len(buckets[b])
        if type(e["nbytes"]) is not int or e["nbytes"] != n or not fits:
            raise BadFrame(
                f"{name}: {n} bytes of {list(shape)} x {e['dtype']} at bucket {b} offset {off} "
                f"do not fit (header nbytes {e['nbytes']!r}, {len(buckets)} buckets)"
            )
        view = buckets[b][off : off + n].view(storage).reshape(shape)
        tensors[name] = WireTensor(view, e["dtype"])
        spans.append((b, off, off + n, name))
    spans.sort()
    for (b0, _, end0, n0), (b1, start1, _, n1) in zip(spans, spans[1:]):
        if b0 == b1 and start1 < end0:
            raise BadFrame(f"tensors {n0} and {n1} overlap in bucket {b0}")
    return WeightPush(
        version=h["version"],
        scheme=h["scheme"],
        tensors=tensors,
        mode=h["mode"],
        checksum=h["checksum"],
        bucket_bytes=h["bucket_bytes"],
    )


def _status(h: dict, arrays: dict[str, tuple[str, np.ndarray]]) -> Status:
    _fixed_arrays("status", arrays)
    return Status(**{k: h[k] for k in _FIELDS["status"]})


def _weight_ref(h: dict, arrays: dict[str, tuple[str, np.ndarray]]) -> WeightRef:
    buckets, ranks = h["buckets"], _int(h["ranks"], "ranks")
    if not isinstance(buckets, list):
        raise BadField("buckets: expected a list")
    want = [f"payload{b}.{i}" for b in range(len(buckets)) for i in range(ranks)]
    if list(arrays) != want or any(d != "uint8" or a.ndim != 1 for d, a in arrays.values()):
        raise BadFrame(f"weight_ref: arrays {list(arrays)[:4]}..., expected {len(want)} uint8 payloads "
                       f"payload<bucket>.<rank> in order")
    payloads = [[arrays[f"payload{b}.{i}"][1].tobytes() for i in range(ranks)] for b in range(len(buckets))]
    return WeightRef(version=h["version"], scheme=h["scheme"], transport=h["transport"], buckets=buckets,
                     payloads=payloads if ranks else ())


_BUILD = {"trajectory_group": _trajectory, "weight_push": _weight_push, "status": _status, "weight_ref": _weight_ref}


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
    if not isinstance(frames, Sequence) or not frames:
        raise BadFrame("empty message")
    views = []
    for f in frames:
        try:
            views.append(memoryview(f).cast("B"))
        except (TypeError, ValueError):
            raise BadFrame(f"frame of type {type(f).__name__} is not a flat buffer") from None
    total = sum(v.nbytes for v in views)
    if total > max_bytes:
        raise TooLarge(f"message is {total} bytes, limit {max_bytes}")
    if secret is not None:
        if len(views) < 2 or views[-1].nbytes != MAC_BYTES:
            raise BadAuth("message carries no HMAC but a secret is set")
        if not hmac.compare_digest(_mac(secret, views[:-1]), bytes(views[-1])):
            raise BadAuth("HMAC does not match")
    h = _header(views[0])
    missing = [k for k in _ENVELOPE if k not in h]
    if missing:
        raise BadHeader(f"header lacks {', '.join(missing)}")
    kind = h["kind"]
    if not isinstance(kind, str) or kind not in KINDS:
        raise BadHeader(f"unknown kind {kind!r}")
    if type(h["schema"]) is not int or h["schema"] != SCHEMA_VERSION:
        raise BadHeader(f"schema {h['schema']!r}, this build speaks {SCHEMA_VERSION}")
    if h["auth"] not in (None, AUTH_SCHEME):
        raise BadHeader(f"auth {h['auth']!r} is not {AUTH_SCHEME!r} or null")
    if secret is not None and h["auth"] != AUTH_SCHEME:
        raise BadAuth("header does not declare the HMAC")
    try:
        sender = _str(h["sender"], "sender")
        session = _str(h["session"], "session", max_chars=64)
        seq = _int(h["seq"], "seq")
    except BadField as e:
        raise BadHeader(str(e)) from None
    if replay_guard is not None:
        replay_guard.check(sender, session, seq)
    if kinds is not None and kind not in kinds:
        raise BadHeader(f"kind {kind} is not accepted here (expects {', '.join(sorted(kinds))})")
    allowed = set(_ENVELOPE) | set(_FIELDS[kind])
    extra = sorted(set(h) - allowed)
    missing = [k for k in _FIELDS[kind] if k not in h]
    if extra or missing:
        raise BadHeader(f"{kind} header: unknown {extra}, missing {missing}")
    descs = h["arrays"]
    if not isinstance(descs, list):
        raise BadHeader("arrays: expected a list")
    expected = 1 + len(descs) + (h["auth"] is not None)
    if len(views) != expected:
        raise BadFrame(f"{len(views)} frames, header declares {expected}")
    msg = _BUILD[kind](h, _arrays(descs, views[1 : 1 + len(descs)]))
    if replay_guard is not None:
        replay_guard.commit(sender, session, seq)
    return msg
