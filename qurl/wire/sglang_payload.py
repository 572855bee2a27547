"""Weight payloads for SGLang engines: checked HF-named tensors, size-capped buckets, SGLang's flattened layout.

Shared by the learner (which builds and sends) and the rollout server (which checks and forwards). Pure torch;
only the serializer and process-group helpers import sglang, lazily, so this module loads without it.
Facts from sglang 0.5.23: `FlattenedTensorBucket` lays tensors back to back as uint8 and refuses a tensor whose
byte offset is not a multiple of its itemsize; `update_weights_from_tensor` takes one serialized payload per TP
rank; `update_weights_from_distributed(load_format="flattened_bucket")` receives one uint8 broadcast per bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from qurl.quant import SCALE_SUFFIXES, SCHEMES, is_quantized_linear
from qurl.wire.frames import BadField, BadFrame, check_shape, check_str

REFIT = tuple(name for name, s in SCHEMES.items() if s.sglang)  # the schemes SGLang refits in place
UPDATE_BUCKET_BYTES = 256 << 20  # one SGLang weight update: a flattened CUDA buffer or one NCCL broadcast
GROUP_NAME = "qurl-weights"  # the weight-update process group of learner rank 0 and the replicas
# tensor dtypes bucket metadata may name (torch names, as SGLang's receivers take them)
META_DTYPES = ("bfloat16", "float16", "float32", "int8", "uint8", "float8_e4m3fn")
MAX_PAYLOAD_BYTES = 64 << 20  # one bucket serialized for one rank, as a WeightRef carries it

Named = list[tuple[str, torch.Tensor]]
Meta = tuple[list[str], list[str], list[list[int]]]  # one bucket's (names, dtype names, shapes), in load order


def check_scheme(scheme: str) -> None:
    """SGLang refits block FP8 in place, INT8 through our loader, and full precision as is; nothing else."""
    if scheme not in REFIT:
        raise ValueError(
            f"scheme {scheme!r} has no SGLang refit; use one of {', '.join(REFIT)} "
            "(FP8 on SGLang is block 128x128: quant.fp8_granularity=block)"
        )


def named_tensors(tensors: Mapping[str, torch.Tensor], scheme: str) -> Named:
    """The (name, tensor) list SGLang loads for `scheme`, after checking codes, scales and their pairing."""
    check_scheme(scheme)
    record = SCHEMES[scheme]
    suffix, code_dtype = record.scale_suffix, record.code_dtype
    for name, t in tensors.items():
        if suffix and name.endswith(suffix) and is_quantized_linear(name[: -len(suffix)]):
            if name[: -len(suffix)] not in tensors:
                raise ValueError(f"{name}: scale without its weight {name[: -len(suffix)]!r}")
            continue
        if not is_quantized_linear(name) or suffix is None:
            continue
        if t.dim() != 2 or t.dtype != code_dtype:
            raise ValueError(f"{name}: {scheme} weight must be 2-D {code_dtype}, got {t.dtype} {tuple(t.shape)}")
        scale = tensors.get(name + suffix)
        want = record.scale_shape(tuple(t.shape))
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != want:
            got = "missing" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
            raise ValueError(f"{name + suffix}: need float32 {want} for {scheme}, got {got}")
    return list(tensors.items())


def _units(named: Named) -> list[Named]:
    """A quantized weight and its scale form one unit, so they always travel in the same bucket."""
    position = {name: i for i, (name, _) in enumerate(named)}
    owner: dict[str, str] = {}
    for name, _ in named:
        for suffix in SCALE_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in position:
                owner[name] = name[: -len(suffix)]
    units: dict[str, Named] = {}
    for name, t in named:
        units.setdefault(owner.get(name, name), []).append((name, t))
    return list(units.values())


def buckets(named: Named, max_bytes: int = UPDATE_BUCKET_BYTES) -> list[Named]:
    """Group tensors into buckets of at most `max_bytes` (a bigger unit goes alone), widest dtype first in each."""
    if max_bytes < 1:
        raise ValueError(f"bucket size must be >= 1 byte, got {max_bytes}")
    out: list[Named] = []
    current: Named = []
    size = 0
    for unit in _units(named):
        unit_bytes = sum(t.numel() * t.element_size() for _, t in unit)
        if current and size + unit_bytes > max_bytes:
            out.append(current)
            current, size = [], 0
        current.extend(unit)
        size += unit_bytes
    if current:
        out.append(current)
    # itemsizes are powers of two, so widest-first keeps every offset a multiple of its itemsize
    return [sorted(b, key=lambda item: -item[1].element_size()) for b in out]


def bucket_meta(bucket: Named) -> Meta:
    """(names, dtype names, shapes) as update_weights_from_distributed takes them."""
    return (
        [n for n, _ in bucket],
        [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        [list(t.shape) for _, t in bucket],
    )


def check_metas(metas: Any, name: str) -> list[Meta]:
    """BadField unless `metas` is a non-empty list of bucket_meta layouts naming each tensor once; lists of lists."""
    if not isinstance(metas, (list, tuple)) or not metas:
        raise BadField(f"{name}: need at least one bucket")
    out, seen = [], set()
    for b, bucket in enumerate(metas):
        if not isinstance(bucket, (list, tuple)) or len(bucket) != 3:
            raise BadField(f"{name}[{b}]: expected [names, dtypes, shapes]")
        names, dtypes, shapes = (list(x) if isinstance(x, (list, tuple)) else None for x in bucket)
        if None in (names, dtypes, shapes) or not names or not len(names) == len(dtypes) == len(shapes):
            raise BadField(f"{name}[{b}]: names, dtypes and shapes must be lists of one equal, non-zero length")
        checked = []
        for tensor, dtype, shape in zip(names, dtypes, shapes):
            check_str(tensor, f"{name}[{b}] name")
            if tensor in seen:
                raise BadField(f"{name}: {tensor} appears twice")
            seen.add(tensor)
            if dtype not in META_DTYPES:
                raise BadField(f"{name}[{b}] {tensor}: dtype {dtype!r} is not one of {META_DTYPES}")
            try:
                checked.append(list(check_shape(list(shape) if isinstance(shape, tuple) else shape, tensor)))
            except BadFrame:
                raise BadField(f"{name}[{b}] {tensor}: shape {shape!r} is not a list of non-negative ints") from None
        out.append((names, dtypes, checked))
    return out


def check_payloads(payloads: list[list[Any]] | None, buckets: int, name: str) -> list[list[Any]]:
    """BadField unless there is one list per bucket of the same non-zero number of per-rank serialized payloads."""
    if payloads is None or len(payloads) != buckets:
        raise BadField(f"{name}: cuda-ipc needs one list per bucket ({buckets})")
    ranks = {len(p) for p in payloads}
    if len(ranks) != 1 or 0 in ranks:
        raise BadField(f"{name}: every bucket needs the same non-zero number of per-rank payloads")
    for item in (item for p in payloads for item in p):
        if not isinstance(item, (bytes, bytearray, memoryview)) or not 0 < len(item) <= MAX_PAYLOAD_BYTES:
            raise BadField(f"{name}: each must be 1 to {MAX_PAYLOAD_BYTES} bytes")
    return payloads


def flatten(bucket: Named) -> torch.Tensor:
    """The bucket's bytes back to back in one uint8 tensor: the buffer a flattened-bucket receiver allocates."""
    if not bucket:
        raise ValueError("cannot flatten an empty bucket")
    parts, offset = [], 0
    for name, t in bucket:
        if offset % t.element_size():
            raise ValueError(
                f"{name}: byte offset {offset} is not a multiple of {t.dtype}'s itemsize; "
                "order a bucket widest dtype first (see buckets())"
            )
        parts.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += parts[-1].numel()
    return torch.cat(parts)


def views(flat: torch.Tensor, meta: Meta) -> Named:
    """The bucket's tensors as views of a buffer laid out by flatten(), in bucket_meta's order."""
    out, offset = [], 0
    for name, dtype, shape in zip(*meta, strict=True):
        dt = getattr(torch, dtype)
        size = math.prod(shape) * dt.itemsize
        out.append((name, flat[offset : offset + size].view(dt).view(shape)))
        offset += size
    if offset != flat.numel():
        raise ValueError(f"bucket metadata covers {offset} bytes, the buffer holds {flat.numel()}")
    return out


def _prepare_reductions(bucket: Named) -> None:
    """CUDA tensors need SGLang's patched reducers (device by UUID); with them active, CPU tensors cannot be pickled."""
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from torch.multiprocessing import reductions

    devices = {t.device.type for _, t in bucket}
    if devices - {"cpu", "cuda"} or len(devices) != 1:
        raise ValueError(f"a bucket's tensors must all be on cpu or all on cuda, got {sorted(devices)}")
    if "cuda" in devices:
        monkey_patch_torch_reductions()
    elif hasattr(reductions, "_reduce_tensor_original"):
        raise ValueError(
            "SGLang's CUDA tensor reducers are active in this process and cannot pickle CPU tensors; "
            "serialize CPU buckets in a process that never sent CUDA tensors to SGLang"
        )


def serialize_named(bucket: Named, tp_size: int) -> list[bytes]:
    """One payload per TP rank holding the bucket as (name, tensor) pairs (for load_format=None or a custom loader)."""
    from sglang.srt.utils import MultiprocessingSerializer

    _prepare_reductions(bucket)
    return [MultiprocessingSerializer.serialize(list(bucket)) for _ in range(tp_size)]


def serialize_flattened(bucket: Named, tp_size: int) -> list[bytes]:
    """One payload per TP rank holding the bucket as SGLang's flattened bucket (load_format="flattened_bucket")."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    _prepare_reductions(bucket)
    b = FlattenedTensorBucket(named_tensors=list(bucket))
    payload = {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}
    return [MultiprocessingSerializer.serialize(payload) for _ in range(tp_size)]


def update_group_layout(replicas: int, tp_size: int) -> tuple[int, list[int]]:
    """World size of the weight-update group (learner rank 0 + every replica's TP ranks), each replica's rank offset."""
    if replicas < 1 or tp_size < 1:
        raise ValueError(f"need replicas >= 1 and tp_size >= 1, got {replicas} and {tp_size}")
    return 1 + replicas * tp_size, [1 + r * tp_size for r in range(replicas)]


def group_address(endpoint: str) -> tuple[str, int]:
    """(host, port) of sync.group_endpoint; `auto` is for qurl-async to resolve before it starts the processes."""
    if endpoint == "auto":
        raise ValueError("sync.group_endpoint=auto: give tcp://HOST:PORT when starting this process by hand")
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not host or not port.isdigit():
        raise ValueError(f"sync.group_endpoint={endpoint!r} is not tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def open_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
    timeout_s: float = 3600.0,
):
    """Join as rank 0 the group that replicas join with init_weights_update_group(rank_offset, world_size); wait up to
    timeout_s for them (SGLang's default is 30 minutes)."""
    from datetime import timedelta

    from sglang.srt.utils import init_custom_process_group

    return init_custom_process_group(
        backend=backend,
        init_method=f"tcp://{master_address}:{master_port}",
        timeout=timedelta(seconds=timeout_s),
        world_size=world_size,
        rank=0,
        group_name=group_name,
    )


def broadcast_buckets(bucket_list: Iterable[Named], group, device: torch.device | str) -> None:
    """Send each bucket as one flattened broadcast from rank 0, in the order the replicas receive them."""
    for bucket in bucket_list:
        torch.distributed.broadcast(flatten(bucket).to(device), src=0, group=group)
