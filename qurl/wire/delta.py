"""Delta weight pushes: send only the tensor elements that changed, and prove the result by checksum.

Most int8 / fp8 codes do not move between two optimizer steps (docs/paper.md section 4), and neither do most
elements of the unquantized tensors (embeddings, lm_head, norms, biases) once the learner has cast them to the
engine's dtype (bf16 on GPU engines: a 1e-6 update rarely crosses a bf16 rounding step). So a push of a quantized
scheme for version V may carry, per tensor, the new values of what changed since V-1 (compared as bit patterns)
and where they go (flat indices, or a bit mask when many changed), whichever of that and the whole tensor is
smaller. Every such push carries `checksum` of the resulting state, every tensor of it, so a server proves its
buffers equal the learner's. A push of `none` (no codes) is always full and its checksum covers nothing: a delta
base on an SGLang server would be a host copy of the whole model per replica (design.md section 5).
A delta applies only on top of exactly V-1 (the server checks its version); `apply` is all or nothing.
How the entries are named (X@val with X@idx or X@mask), and the rule every push is checked by: qurl/wire/delta_names.py.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from qurl.quant import CODE_DTYPES, changed_indices
from qurl.wire.delta_names import DELTA_INDEX, DELTA_MASK, DELTA_VALUES
from qurl.wire.frames import BadFrame, ProtocolError, WireTensor, from_torch, to_torch
from qurl.wire.protocol import WeightPush


class Delta(NamedTuple):
    """The changed elements of one tensor: strictly increasing flat indices and their new values."""

    indices: torch.Tensor  # int32 (int64 for tensors of 2**31 elements or more), 1-D
    values: torch.Tensor  # 1-D, the tensor's dtype


class ChecksumMismatch(ProtocolError):
    """The tensors after applying a push differ from the learner's: the server needs a full push."""


def checked_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Sorted names deltas may touch and checksums cover: every tensor of a quantized push, none without codes."""
    if not any(t.dtype in CODE_DTYPES for t in tensors.values()):
        return []
    return sorted(tensors)


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """CRC-32 over name, dtype, shape and bytes of every checked tensor in name order ('crc32:' + 8 hex digits).

    A guard against applying to the wrong base or a bad delta, not against an attacker (transport.secret's
    HMAC is); CRC-32 reads memory faster than blake2b (1.7-5x here: benchmarks/sync.py measures both).
    """
    crc = 0
    for name in checked_names(tensors):
        t = tensors[name]
        crc = zlib.crc32(f"{name}|{t.dtype}|{tuple(t.shape)}".encode(), crc)
        crc = zlib.crc32(from_torch(t).data, crc)
    return f"crc32:{crc:08x}"


def diff(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, Delta]]:
    """(whole, deltas) taking `old` to `new`: per checked tensor the smaller of its delta and itself, the rest whole.

    Unchanged checked tensors are left out; a tensor `old` lacks, or holds in another shape or dtype, goes whole.
    """
    checked = set(checked_names(new))
    whole: dict[str, torch.Tensor] = {}
    deltas: dict[str, Delta] = {}
    for name, t in new.items():
        prev = old.get(name)
        if name not in checked or prev is None or prev.shape != t.shape or prev.dtype != t.dtype:
            whole[name] = t
            continue
        flat = t.reshape(-1)
        idx = changed_indices(prev, t)
        count = idx.numel()
        if count == 0:
            continue
        if (count + 7) // 8 + count * t.element_size() >= t.numel() * t.element_size():
            # whole whatever the indices: neither their list nor their mask is under one bit per changed element
            whole[name] = t
            continue
        if t.numel() < 2**31:
            idx = idx.to(torch.int32)
        if min(_index_bytes(idx), _mask_bytes(idx)) + count * t.element_size() < t.numel() * t.element_size():
            deltas[name] = Delta(idx, flat[idx.long()])
        else:
            whole[name] = t
    return whole, deltas


def _index_bytes(idx: torch.Tensor) -> int:
    return idx.numel() * idx.element_size()


def _mask_bytes(idx: torch.Tensor) -> int:
    return (int(idx[-1]) + 8) // 8 if idx.numel() else 0


def _mask(idx: torch.Tensor) -> np.ndarray:
    """Bit i of the result (LSB first) is set iff i is in idx; as many bytes as reach the last index."""
    bits = np.zeros(_mask_bytes(idx) * 8, dtype=bool)
    bits[idx.numpy()] = True
    return np.packbits(bits, bitorder="little")


def delta_push(
    version: int, scheme: str, whole: Mapping[str, torch.Tensor], deltas: Mapping[str, Delta], checksum: str
) -> WeightPush:
    """The wire form of a delta push: whole tensors under their names, deltas as X@val with X@idx or X@mask."""
    tensors = {name: from_torch(t) for name, t in whole.items()}
    for name, d in deltas.items():
        if _mask_bytes(d.indices) < _index_bytes(d.indices):
            tensors[name + DELTA_MASK] = WireTensor(_mask(d.indices), "uint8")
        else:
            tensors[name + DELTA_INDEX] = from_torch(d.indices)
        tensors[name + DELTA_VALUES] = from_torch(d.values)
    return WeightPush(version=version, scheme=scheme, tensors=tensors, mode="delta", checksum=checksum)


def split_push(push: WeightPush) -> tuple[dict[str, torch.Tensor], dict[str, Delta]]:
    """Inverse of delta_push (torch views of the frames); also reads a full push as (all tensors, no deltas)."""
    whole: dict[str, torch.Tensor] = {}
    deltas: dict[str, Delta] = {}
    for name, t in push.tensors.items():
        if name.endswith(DELTA_VALUES):
            base = name[: -len(DELTA_VALUES)]
            if base + DELTA_MASK in push.tensors:
                bits = np.unpackbits(push.tensors[base + DELTA_MASK].data, bitorder="little")
                indices = torch.from_numpy(np.flatnonzero(bits))
            else:
                indices = to_torch(push.tensors[base + DELTA_INDEX].data, push.tensors[base + DELTA_INDEX].dtype)
            deltas[base] = Delta(indices, to_torch(t.data, t.dtype))
        elif not name.endswith((DELTA_INDEX, DELTA_MASK)):
            whole[name] = to_torch(t.data, t.dtype)
    return whole, deltas


def check(buffers: Mapping[str, torch.Tensor], whole: Mapping[str, torch.Tensor], deltas: Mapping[str, Delta]) -> None:
    """BadFrame naming the first tensor of a push that does not fit `buffers`.

    Unknown names, a wrong shape or dtype, an index out of range.
    """
    for name, t in whole.items():
        dst = buffers.get(name)
        if dst is None:
            raise BadFrame(f"push names {name!r}, which the engine does not hold")
        if tuple(t.shape) != tuple(dst.shape) or t.dtype != dst.dtype:
            raise BadFrame(
                f"{name}: push has {t.dtype} {list(t.shape)}, the engine holds {dst.dtype} {list(dst.shape)}"
            )
    checked = set(checked_names(buffers))
    for name, d in deltas.items():
        dst = buffers.get(name)
        if dst is None:
            raise BadFrame(f"delta for {name!r}, which the engine does not hold")
        if name not in checked:
            raise BadFrame(f"delta for {name!r}: the engine holds no quantized codes and takes full pushes only")
        if d.values.dtype != dst.dtype:
            raise BadFrame(f"{name}: delta values are {d.values.dtype}, the engine holds {dst.dtype}")
        if not dst.is_contiguous():
            raise BadFrame(f"{name}: the engine's buffer is not contiguous, a flat delta cannot address it")
        if d.indices.dim() != 1 or d.indices.shape != d.values.shape:
            raise BadFrame(f"{name}: {list(d.indices.shape)} delta indices for {list(d.values.shape)} values")
        if d.indices.numel() and not 0 <= int(d.indices.min()) <= int(d.indices.max()) < dst.numel():
            raise BadFrame(
                f"{name}: delta indices {int(d.indices.min())}..{int(d.indices.max())} are out of range "
                f"for {list(dst.shape)}"
            )


@torch.no_grad()
def apply(
    buffers: Mapping[str, torch.Tensor], whole: Mapping[str, torch.Tensor], deltas: Mapping[str, Delta], expected: str
) -> None:
    """Write a push into `buffers` in place, all or nothing, without a whole copy of anything for undo.

    Checked first; deltas are written in place (their old elements kept), the would-be state (those buffers, the
    push's whole tensors in place of theirs) is checksummed, and only on a match are the whole tensors copied in.
    Raises BadFrame (does not fit) or ChecksumMismatch; either way `buffers` are left exactly as they were.
    """
    check(buffers, whole, deltas)
    undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (flat buffer, indices, old values)
    for name, d in deltas.items():
        flat, idx = buffers[name].view(-1), d.indices.long()
        undo.append((flat, idx, flat[idx]))
        flat[idx] = d.values.to(flat.device)
    got = checksum({**buffers, **whole})
    if got != expected:
        for flat, idx, old in reversed(undo):
            flat[idx] = old
        raise ChecksumMismatch(f"the tensors after the push have {got}, the learner's have {expected}")
    for name, t in whole.items():
        buffers[name].copy_(t)
