"""Quantization of the rollout actor's linear weights: tensor quantizers (absmax) and the scheme registry (schemes)."""

from qurl.quant.absmax import (
    changed_fraction,
    dequantize_fp8,
    dequantize_int8,
    expand_blocks,
    quantize_fp8,
    quantize_int8,
    quantize_uint8_shifted,
)
from qurl.quant.schemes import (
    CODE_DTYPES,
    FP8_BLOCK,
    FP8_CHANNEL,
    INT8,
    NONE,
    SCALE_SUFFIXES,
    SCHEMES,
    Scheme,
    dequantize_state_dict,
    is_quantized_linear,
    lookup,
    quantize_state_dict,
    scheme_for,
)

__all__ = [
    "CODE_DTYPES",
    "FP8_BLOCK",
    "FP8_CHANNEL",
    "INT8",
    "NONE",
    "SCALE_SUFFIXES",
    "SCHEMES",
    "Scheme",
    "changed_fraction",
    "dequantize_fp8",
    "dequantize_int8",
    "dequantize_state_dict",
    "expand_blocks",
    "is_quantized_linear",
    "lookup",
    "quantize_fp8",
    "quantize_int8",
    "quantize_uint8_shifted",
    "quantize_state_dict",
    "scheme_for",
]
