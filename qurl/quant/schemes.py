"""The quantization-scheme registry: one record per scheme (codes, scale name and layout, what the engines load),
the rollout.quant settings that name them, and the state dicts the learner pushes and the engines hold."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qurl.quant.absmax import FP8_BLOCK_SIZE, FP8_DTYPE, dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8

_LINEAR = re.compile(r"(^|\.)(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")

Quantizer = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
Dequantizer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Scheme:
    """How the rollout actor's projection weights travel and are held; every file that names a scheme reads this."""

    name: str  # WeightPush.scheme and load_engine's quant
    code_dtype: torch.dtype | None = None  # dtype of a projection's codes; None: projections stay full precision
    scale_suffix: str | None = None  # `X.weight` + suffix names the fp32 dequantizing multiplier (SGLang naming)
    quantize: Quantizer | None = None  # (weight [N, K], bits) -> (codes, scale)
    dequantize: Dequantizer | None = None  # (codes, scale) -> fp32 values
    block: int | None = None  # side of the square tiles sharing one scale; None: one scale per output row
    sglang: bool = False  # SGLang refits it in place (design.md section 4)

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the scale held next to a quantized [N, K] weight."""
        n, k = weight_shape
        if self.block is None:
            return (n, 1)
        return (math.ceil(n / self.block), math.ceil(k / self.block))


def _int_rows(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8(weight, dim=-1, bits=bits)


def _fp8_rows(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bits is always 8: e4m3 has one grid."""
    return quantize_fp8(weight, "channel")


def _fp8_blocks(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bits is always 8: e4m3 has one grid."""
    return quantize_fp8(weight, "block", FP8_BLOCK_SIZE)


NONE = Scheme("none", sglang=True)
INT8 = Scheme("int8", torch.int8, "_scale", _int_rows, dequantize_int8, sglang=True)
FP8_CHANNEL = Scheme("fp8-channel", FP8_DTYPE, "_scale", _fp8_rows, dequantize_fp8)
FP8_BLOCK = Scheme("fp8-block", FP8_DTYPE, "_scale_inv", _fp8_blocks, dequantize_fp8, block=FP8_BLOCK_SIZE, sglang=True)
SCHEMES: dict[str, Scheme] = {s.name: s for s in (NONE, INT8, FP8_CHANNEL, FP8_BLOCK)}
FP8_BY_GRANULARITY = {"channel": FP8_CHANNEL, "block": FP8_BLOCK}  # rollout.quant=fp8: quant.fp8_granularity -> scheme
ALIASES = {"fp8": FP8_BLOCK.name}  # rollout.quant=fp8 at the default granularity, as load_engine takes it
QUANT_SETTINGS = (NONE.name, INT8.name, *ALIASES)  # the values of rollout.quant
CODE_DTYPES = tuple(dict.fromkeys(s.code_dtype for s in SCHEMES.values() if s.code_dtype is not None))
SCALE_SUFFIXES = tuple(dict.fromkeys(s.scale_suffix for s in SCHEMES.values() if s.scale_suffix is not None))


def lookup(name: str) -> Scheme:
    """The record of a scheme name or alias: the one check of a quant setting, where it enters."""
    scheme = SCHEMES.get(ALIASES.get(name, name))
    if scheme is None:
        raise ValueError(
            f"unknown quant {name!r}; allowed: {tuple(SCHEMES)}, or the alias "
            + ", ".join(f"{a!r} for {s!r}" for a, s in ALIASES.items())
        )
    return scheme


def scheme_for(quant: str, fp8_granularity: str = "block") -> str:
    """Map the config pair (rollout.quant, quant.fp8_granularity) to a scheme name."""
    if quant in ALIASES:
        if fp8_granularity not in FP8_BY_GRANULARITY:
            raise ValueError(
                f"quant.fp8_granularity must be one of {tuple(FP8_BY_GRANULARITY)}, got {fp8_granularity!r}"
            )
        return FP8_BY_GRANULARITY[fp8_granularity].name
    if quant not in QUANT_SETTINGS:
        raise ValueError(f"rollout.quant must be one of {QUANT_SETTINGS}, got {quant!r}")
    return quant


def is_quantized_linear(name: str) -> bool:
    """True for the attention and MLP projection weights that the rollout engine holds quantized."""
    return _LINEAR.search(name) is not None


def _quantizable(name: str, tensor: torch.Tensor) -> bool:
    if not is_quantized_linear(name):
        return False
    if tensor.dim() != 2:
        raise ValueError(f"{name}: a projection weight must be 2-D, got shape {tuple(tensor.shape)}")
    return True


def quantize_state_dict(
    state_dict: dict[str, torch.Tensor], scheme: str, weight_bits: int = 8
) -> dict[str, torch.Tensor]:
    """The named tensors the rollout engine loads: codes + scales for projections, the rest as is
    (weight_bits < 8: int8 scheme only, the quant.weight_bits mismatch study knob)."""
    s = lookup(scheme)
    if weight_bits != 8 and s is not INT8:
        raise ValueError(f"weight_bits={weight_bits} needs scheme {INT8.name!r}, got {scheme!r}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if s.quantize is None or not _quantizable(name, tensor):
            out[name] = tensor
            continue
        out[name], out[name + s.scale_suffix] = s.quantize(tensor.detach(), weight_bits)
    return out


def dequantize_state_dict(qsd: dict[str, torch.Tensor], scheme: str) -> dict[str, torch.Tensor]:
    """Inverse of quantize_state_dict up to quantization error: fp32 projections, scales dropped."""
    s = lookup(scheme)
    suffix = s.scale_suffix
    out: dict[str, torch.Tensor] = {}
    for name, tensor in qsd.items():
        if suffix is None:
            out[name] = tensor
        elif name.endswith(suffix) and is_quantized_linear(name[: -len(suffix)]):
            continue
        elif _quantizable(name, tensor):
            if name + suffix not in qsd:
                raise ValueError(f"{name}: missing {name + suffix} for scheme {scheme!r}")
            out[name] = s.dequantize(tensor, qsd[name + suffix])
        else:
            out[name] = tensor
    return out
