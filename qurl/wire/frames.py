"""The frames of every wire message (design.md section 5): header envelope, raw arrays, HMAC, replay stamps.

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
This module knows no message kind (qurl/wire/protocol.py declares those) and needs only numpy.

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
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

SCHEMA_VERSION = 1
AUTH_SCHEME = "hmac-sha256"
MAC_BYTES = 32
MAX_HEADER_BYTES = 4 << 20
MAX_NAME_CHARS = 512
MAX_NDIM = 8
BUCKET_ALIGN = 64
ENVELOPE = ("kind", "schema", "sender", "session", "seq", "auth", "arrays")

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

Array = tuple[str, str, np.ndarray]  # (name, logical dtype, data) of one payload frame
Views = dict[str, tuple[str, np.ndarray]]  # received arrays: name -> (logical dtype, read-only view)


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


def check_str(value: Any, name: str, *, max_chars: int = MAX_NAME_CHARS, empty: bool = False) -> str:
    """A str of at most max_chars, non-empty unless `empty`."""
    if not isinstance(value, str):
        raise BadField(f"{name}: expected str, got {type(value).__name__}")
    if not empty and not value:
        raise BadField(f"{name}: must not be empty")
    if len(value) > max_chars:
        raise BadField(f"{name}: longer than {max_chars} chars")
    return value


def check_int(value: Any, name: str, *, lo: int | None = 0) -> int:
    """An int (not a bool) of at least lo."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadField(f"{name}: expected int, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise BadField(f"{name}: {value} is below {lo}")
    return value


def check_float(value: Any, name: str) -> float:
    """A finite real number, as float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadField(f"{name}: expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise BadField(f"{name}: {value} is not finite")
    return value


def check_json_dict(value: Any, name: str) -> dict:
    """A dict with str keys (JSON values are whatever json.loads gave)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise BadField(f"{name}: expected a JSON object with str keys")
    return value


def check_array(value: Any, dtype: np.dtype, name: str) -> np.ndarray:
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


def check_shape(value: Any, name: str) -> tuple[int, ...]:
    """A header shape: a list of at most MAX_NDIM non-negative ints (BadFrame otherwise)."""
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise BadFrame(f"{name}: shape must be a list of at most {MAX_NDIM} ints")
    for d in value:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise BadFrame(f"{name}: shape {value} has an entry that is not a non-negative int")
    return tuple(value)


# ---------------------------------------------------------------------------------------------
# tensors (torch imported lazily)


class WireTensor(NamedTuple):
    """An array plus its logical dtype; bf16 / fp8 are raw uint16 / uint8 words in `data`."""

    data: np.ndarray
    dtype: str


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


def pack_buckets(tensors: dict[str, WireTensor], bucket_bytes: int) -> tuple[list[dict], list[np.ndarray]]:
    """Tensors -> header entries and uint8 buckets, each 64-byte aligned; a tensor above bucket_bytes gets its own."""
    entries: list[dict] = []
    groups: list[list[tuple[int, np.ndarray]]] = [[]]
    size = 0
    for name, (data, dtype) in tensors.items():
        start = -(-size // BUCKET_ALIGN) * BUCKET_ALIGN
        if groups[-1] and start + data.nbytes > bucket_bytes:
            groups.append([])
            start = 0
        groups[-1].append((start, data))
        size = start + data.nbytes
        entries.append({**_desc(name, dtype, data), "bucket": len(groups) - 1, "offset": start})
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


def unpack_buckets(entries: Any, buckets: list[np.ndarray]) -> dict[str, WireTensor]:
    """Inverse of pack_buckets: views of the buckets, after checking that every entry fits and none overlap."""
    if not isinstance(entries, list):
        raise BadField("tensors: expected a list")
    keys = {"name", "dtype", "shape", "nbytes", "bucket", "offset"}
    tensors: dict[str, WireTensor] = {}
    spans: list[tuple[int, int, int, str]] = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or set(e) != keys:
            raise BadField(f"tensors[{i}]: expected keys {sorted(keys)}")
        name = check_str(e["name"], f"tensors[{i}].name")
        if name in tensors:
            raise BadField(f"tensors: {name} appears twice")
        storage = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if storage is None:
            raise BadFrame(f"{name}: dtype {e['dtype']!r} is not allowed")
        shape = check_shape(e["shape"], name)
        b = check_int(e["bucket"], f"{name}.bucket")
        off = check_int(e["offset"], f"{name}.offset")
        n = math.prod(shape) * storage.itemsize
        fits = b < len(buckets) and off + n <= len(buckets[b])
        if type(e["nbytes"]) is not int or e["nbytes"] != n or not fits:
            raise BadFrame(
                f"{name}: {n} bytes of {list(shape)} x {e['dtype']} at bucket {b} offset {off} "
                f"do not fit (header nbytes {e['nbytes']!r}, {len(buckets)} buckets)"
            )
        tensors[name] = WireTensor(buckets[b][off : off + n].view(storage).reshape(shape), e["dtype"])
        spans.append((b, off, off + n, name))
    spans.sort()
    for (b0, _, end0, n0), (b1, start1, _, n1) in zip(spans, spans[1:]):
        if b0 == b1 and start1 < end0:
            raise BadFrame(f"tensors {n0} and {n1} overlap in bucket {b0}")
    return tensors


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
# framing


def mac(secret: bytes, frames: Sequence[Any]) -> bytes:
    """HMAC-SHA256 over the frames, each as its 8-byte little-endian length and its bytes."""
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


def to_frames(
    kind: str, fields: dict, arrays: list[Array], *, sender: str, session: str, seq: int, secret: bytes | None
) -> list[Any]:
    """Header fields and arrays -> frames for zmq send_multipart(copy=False); frames may alias the arrays."""
    header = {
        "kind": kind,
        "schema": SCHEMA_VERSION,
        "sender": check_str(sender, "sender"),
        "session": check_str(session, "session", max_chars=64),
        "seq": check_int(seq, "seq"),
        "auth": AUTH_SCHEME if secret is not None else None,
        **fields,
        "arrays": [_desc(name, dtype, arr) for name, dtype, arr in arrays],
    }
    frames: list[Any] = [json.dumps(header, separators=(",", ":"), allow_nan=False).encode()]
    frames += [_raw(arr, DTYPES[dtype]) for _, dtype, arr in arrays]
    if secret is not None:
        frames.append(mac(secret, frames))
    return frames


def _reject_constant(name: str) -> None:
    raise BadHeader(f"header holds the non-finite number {name}")


def _header(view: memoryview) -> dict:
    if view.nbytes > MAX_HEADER_BYTES:
        raise TooLarge(f"header is {view.nbytes} bytes, limit {MAX_HEADER_BYTES}")
    try:
        header = json.loads(bytes(view).decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise BadHeader(f"frame 0 is not a UTF-8 JSON header: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise BadHeader(f"header is a JSON {type(header).__name__}, expected an object")
    return header


def open_frames(frames: Sequence[Any], *, secret: bytes | None, max_bytes: int) -> tuple[list[memoryview], dict]:
    """Frames -> (flat views, header): sizes, then the MAC (before any parsing), then the header's envelope keys."""
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
        if not hmac.compare_digest(mac(secret, views[:-1]), bytes(views[-1])):
            raise BadAuth("HMAC does not match")
    h = _header(views[0])
    missing = [k for k in ENVELOPE if k not in h]
    if missing:
        raise BadHeader(f"header lacks {', '.join(missing)}")
    return views, h


def check_stamp(h: dict, secret: bytes | None) -> tuple[str, str, int]:
    """(sender, session, seq) of a header whose schema and auth this build accepts."""
    if type(h["schema"]) is not int or h["schema"] != SCHEMA_VERSION:
        raise BadHeader(f"schema {h['schema']!r}, this build speaks {SCHEMA_VERSION}")
    if h["auth"] not in (None, AUTH_SCHEME):
        raise BadHeader(f"auth {h['auth']!r} is not {AUTH_SCHEME!r} or null")
    if secret is not None and h["auth"] != AUTH_SCHEME:
        raise BadAuth("header does not declare the HMAC")
    try:
        sender, session = check_str(h["sender"], "sender"), check_str(h["session"], "session", max_chars=64)
        return sender, session, check_int(h["seq"], "seq")
    except BadField as e:
        raise BadHeader(str(e)) from None


def read_arrays(h: dict, views: list[memoryview]) -> Views:
    """Check each declared array against its frame, and the frame count; name -> (dtype, read-only view)."""
    descs = h["arrays"]
    if not isinstance(descs, list):
        raise BadHeader("arrays: expected a list")
    expected = 1 + len(descs) + (h["auth"] is not None)
    if len(views) != expected:
        raise BadFrame(f"{len(views)} frames, header declares {expected}")
    out: Views = {}
    for i, (d, view) in enumerate(zip(descs, views[1 : 1 + len(descs)])):
        if not isinstance(d, dict) or set(d) != {"name", "dtype", "shape", "nbytes"}:
            raise BadFrame(f"arrays[{i}]: expected keys name, dtype, shape, nbytes")
        name = d["name"]
        if not isinstance(name, str) or not name or name in out:
            raise BadFrame(f"arrays[{i}]: name missing or repeated")
        storage = DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
        if storage is None:
            raise BadFrame(f"{name}: dtype {d['dtype']!r} is not allowed")
        shape = check_shape(d["shape"], name)
        nbytes = d["nbytes"]
        want = math.prod(shape) * storage.itemsize
        if not (type(nbytes) is int and nbytes == want == view.nbytes):
            raise BadFrame(
                f"{name}: shape {list(shape)} x {d['dtype']} is {want} bytes, header says "
                f"{nbytes!r}, frame has {view.nbytes}"
            )
        out[name] = (d["dtype"], np.frombuffer(view, dtype=storage).reshape(shape))
    return out
