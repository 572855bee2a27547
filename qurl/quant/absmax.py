"""Symmetric abs-max INT8 / FP8 quantization of one tensor: codes, scales and their inverse (schemes.py names them)."""

from __future__ import annotations

import math

import numpy as np
import torch

from qurl import cpu_kernels

WEIGHT_BITS = (4, 5, 6, 7, 8)  # below 8: a mismatch study knob (codes still stored as int8), not a speed feature
FP8_DTYPE = torch.float8_e4m3fn  # the fp8 codes: e4m3, no inf
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK_SIZE = 128  # side of the square tiles that share one block scale (SGLang's weight_block_size)
FP8_GRANULARITIES = ("tensor", "channel", "block")


def _scale_from_amax(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """amax / qmax, with 1.0 where that is 0 so all-zero slices give zero codes instead of NaN."""
    scale = amax / qmax
    return torch.where(scale > 0, scale, 1.0)


def int_max(bits: int) -> float:
    """Largest symmetric code of a `bits`-bit signed integer grid (127 for 8 bits, 7 for 4)."""
    if bits not in WEIGHT_BITS:
        raise ValueError(f"integer bits must be one of {WEIGHT_BITS}, got {bits!r}")
    return float(2 ** (bits - 1) - 1)


def quantize_int8(x: torch.Tensor, dim: int = -1, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slice symmetric int8 along `dim` (per output channel for a weight, per token for activations);
    bits < 8 uses the same scheme on a coarser grid (codes within +-(2^(bits-1)-1)), stored as int8.

    The rows of a contiguous 2-D CPU matrix go through the CPU kernel's one pass, bit for bit: a push quantizes every
    weight of the model (SmolLM2's int8 lm_head: 13-17 ms against 171-253 ms of torch ops on one AMX Xeon thread)."""
    qmax = int_max(bits)
    if bits == 8 and x.dim() == 2 and dim in (-1, 1) and x.is_contiguous() and (k := cpu_kernels.usable(x)) is not None:
        shifted, scale = k.quantize_uint8_shifted(x)
        return shifted.view(torch.int8).bitwise_xor_(-128), scale  # c + 128 as uint8 -> c as int8: flip the top bit
    x = x.float()
    scale = _scale_from_amax(x.abs().amax(dim=dim, keepdim=True), qmax)
    codes = (x / scale).round_().clamp_(-qmax, qmax).to(torch.int8)
    return codes, scale


def quantize_uint8_shifted(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8(x)'s per-token codes plus 128 as uint8 (oneDNN's zero-point-128 input), in fewer passes.

    |x / scale| <= 127 by construction, so quantize_int8's clamp never acts and the shift cannot wrap.
    """
    scale = _scale_from_amax(x.abs().amax(dim=-1, keepdim=True).float(), 127.0)  # amax is exact in any dtype
    return torch.div(x, scale).round_().add_(128).to(torch.uint8), scale  # bf16 / fp32 divides in fp32


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values that int8 codes stand for."""
    return codes.float() * scale


def _fp8_cast(x: torch.Tensor) -> torch.Tensor:
    # clamp first: out-of-range fp32 -> e4m3fn is NaN on some backends (no inf in e4m3fn)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check_block_input(x: torch.Tensor, block: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"fp8 block quantization needs a 2-D weight, got shape {tuple(x.shape)}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")


def quantize_fp8(
    x: torch.Tensor, granularity: str = "channel", block: int = FP8_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn codes and the fp32 dequantizing multiplier (scale [], [N,1] or [ceil(N/b), ceil(K/b)])."""
    x = x.float()
    if granularity == "tensor":
        scale = _scale_from_amax(x.abs().amax(), FP8_MAX)
        return _fp8_cast(x / scale), scale
    if granularity == "channel":
        scale = _scale_from_amax(x.abs().amax(dim=-1, keepdim=True), FP8_MAX)
        return _fp8_cast(x / scale), scale
    if granularity == "block":
        _check_block_input(x, block)
        n, k = x.shape
        nb, kb = math.ceil(n / block), math.ceil(k / block)
        padded = torch.nn.functional.pad(x, (0, kb * block - k, 0, nb * block - n))
        amax = padded.abs().view(nb, block, kb, block).amax(dim=(1, 3))
        scale = _scale_from_amax(amax, FP8_MAX)
        return _fp8_cast(x / expand_blocks(scale, n, k, block)), scale
    raise ValueError(f"fp8 granularity must be one of {FP8_GRANULARITIES}, got {granularity!r}")


def expand_blocks(scale: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """Per-element copy of block scales, cropped to [n, k]."""
    return scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:n, :k]


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK_SIZE) -> torch.Tensor:
    """fp32 values of fp8 codes; the granularity is read from the scale's shape."""
    values = codes.float()
    if scale.dim() <= 1 and scale.numel() == 1:
        return values * scale
    if scale.dim() == codes.dim() and scale.shape[:-1] == codes.shape[:-1] and scale.shape[-1] == 1:
        return values * scale
    _check_block_input(codes, block)
    n, k = codes.shape
    expected = (math.ceil(n / block), math.ceil(k / block))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"fp8 scale shape {tuple(scale.shape)} fits neither per-tensor, per-channel "
            f"{(n, 1)} nor block-{block} {expected} for codes {(n, k)}"
        )
    return values * expand_blocks(scale, n, k, block)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # compare bit patterns, not values


def changed_indices(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Increasing flat int64 indices of the elements whose bit patterns differ (one shape and dtype): a delta push's
    diff (qurl/wire/delta.py). On the CPU one pass of the CPU kernels, where the torch chain writes a bool tensor and
    reads it twice (SmolLM2's push: 0.100 -> 0.054 s on one AMX Xeon thread)."""
    k = cpu_kernels.kernels() if old.device.type == new.device.type == "cpu" else None
    if k is not None and old.is_contiguous() and new.is_contiguous():
        return k.changed_indices(old, new)
    bits = _BITS[new.element_size()]
    changed = torch.ne(new.reshape(-1).view(bits), old.reshape(-1).view(bits)).cpu().numpy()
    return torch.from_numpy(np.flatnonzero(changed))  # np.flatnonzero: 3-6x torch's nonzero


def changed_fraction(old_codes: torch.Tensor, new_codes: torch.Tensor) -> float:
    """Share of quantized codes that differ between two pushes (the sync/changed_frac metric)."""
    if old_codes.shape != new_codes.shape or old_codes.dtype != new_codes.dtype:
        raise ValueError(
            f"changed_fraction needs equal shape and dtype, got {tuple(old_codes.shape)} {old_codes.dtype}"
            f" vs {tuple(new_codes.shape)} {new_codes.dtype}"
        )
    if old_codes.numel() == 0:
        return 0.0
    return changed_indices(old_codes, new_codes).numel() / old_codes.numel()
