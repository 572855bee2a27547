"""Linear layers over exactly the buffers `qurl.quant.quantize_state_dict` produces: one class per scheme.

One linear runs one matmul for one or more Hugging Face projections that read the same input
(q/k/v, gate/up): their weights live in one fused storage, and each HF name maps to a row-slice
view of it, so that an in-place copy into a named tensor updates the fused matmul operand.
`LINEARS` maps each scheme of `qurl.quant.SCHEMES` to its class (as gpt-fast's quantize.py swaps in
WeightOnlyInt8Linear), so a call runs its scheme's kernel without asking which scheme it is.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType

import torch
import torch.nn.functional as F

from qurl.cpu_kernels import int8_gemm_kernels, usable
from qurl.quant import (
    FP8_BLOCK,
    FP8_CHANNEL,
    INT8,
    NONE,
    Scheme,
    expand_blocks,
    quantize_fp8,
    quantize_int8,
    quantize_uint8_shifted,
)

_CUDA_INT_MM_MIN_M = 17  # cuBLAS int8 GEMM in torch._int_mm needs more than 16 rows
_ONEDNN = torch.backends.mkldnn.is_available()
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if _ONEDNN else None
_ONEDNN_QLINEAR = _ONEDNN and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.cache
def onednn_int8_is_exact() -> bool:
    """Whether oneDNN's u8 x s8 GEMM gives exact int32 sums here: without VNNI (AVX2-only CPUs) it adds byte pairs
    in saturating int16 (vpmaddubsw) and is wrong by up to half a logit (Int8Linear then splits the codes by sign)."""
    if not _ONEDNN_QLINEAR:
        return False
    n = 8
    packed = torch.ops.onednn.qlinear_prepack(torch.full((n, 64), 127, dtype=torch.int8), None)
    xu = torch.full((1, 64), 255, dtype=torch.uint8)  # 127 * 127 * 2 per pair: over int16's 32767
    acc = _qlinear(xu, 128, packed, torch.ones(n), torch.zeros(n, dtype=torch.int64))
    return bool((acc == 127 * 127 * 64).all())


def _qlinear(
    xu: torch.Tensor, zero_point: int, packed: torch.Tensor, w_scales: torch.Tensor, w_zero_points: torch.Tensor
) -> torch.Tensor:
    """oneDNN's prepacked u8 x s8 GEMM, fp32 out: sum((xu - zero_point) * codes) * w_scales."""
    return torch.ops.onednn.qlinear_pointwise(
        xu, 1.0, zero_point, packed, w_scales, w_zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; fp32 on CPU goes through oneDNN, about 2x faster than MKL sgemm at decode shapes on this CPU kind."""
    if _ONEDNN_LINEAR is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class FusedLinear:
    """The fused weight (and bias) of `prefixes` with a named view per HF tensor; subclasses add scales and matmul."""

    scheme: Scheme

    def __init__(
        self, prefixes: list[str], tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.sizes = [tensors[p + ".weight"].shape[0] for p in prefixes]
        weight_dtype = dtype if self.scheme.code_dtype is None else tensors[prefixes[0] + ".weight"].dtype
        self.weight = _fuse([tensors[p + ".weight"] for p in prefixes], weight_dtype, device)
        self.named: dict[str, torch.Tensor] = _views(self.weight, prefixes, ".weight", self.sizes)
        self.bias = None
        has_bias = [p + ".bias" in tensors for p in prefixes]
        if any(has_bias):
            if not all(has_bias):
                raise ValueError(f"biases must be present for all or none of {prefixes}")
            self.bias = _fuse([tensors[p + ".bias"] for p in prefixes], dtype, device)
            self.named.update(_views(self.bias, prefixes, ".bias", self.sizes))

    def repack(self) -> None:
        """Rebuild copies derived from the named buffers after they were written in place (none here)."""

    def _add_bias(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The tail every quantized matmul shares: back to the model dtype, then the bias."""
        out = out.to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)


class DenseLinear(FusedLinear):
    """y = x W^T (+ b) in the model dtype."""

    scheme = NONE

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


class _RowScaled(FusedLinear):
    """A quantized linear with one fp32 scale per output row: `X.weight_scale` [n, 1], fused to [N, 1]."""

    def __init__(
        self, prefixes: list[str], tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(prefixes, tensors, dtype, device)
        suffix = ".weight" + self.scheme.scale_suffix
        self.scale = _fuse([tensors[p + suffix] for p in prefixes], torch.float32, device)
        self.scale_t = self.scale.t()  # [1, N] view, stays valid across in-place updates
        self.named.update(_views(self.scale, prefixes, suffix, self.sizes))


class Int8Linear(_RowScaled):
    """W8A8: per-token int8 activations times per-channel int8 codes, exact int32 sums dequantized in fp32."""

    scheme = INT8

    def __init__(
        self, prefixes: list[str], tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(prefixes, tensors, dtype, device)
        # CPU: a oneDNN-prepacked copy of the codes, about 2x faster than torch._int_mm at decode shapes (13-20x
        # with the sign split on an AVX2-only CPU, where _int_mm has no fast kernel)
        # and, with AMX, AVX-512 VNNI or AVX2, the CPU kernels' copy of the codes for decode batches
        # (csrc/decode_cpu.cpp; up to int8_gemm_max_rows rows, above which oneDNN is as fast). With AMX or AVX2 the
        # kernel takes every row count and no oneDNN copy is kept: a push re-derives one copy, not two.
        self.packed = self.panels = None
        cpu = _ONEDNN_QLINEAR and self.weight.device.type == "cpu"
        self._gemm = int8_gemm_kernels() if cpu else None
        self._onednn = False
        if cpu and (self._gemm is None or self._gemm.int8_gemm_max_rows < sys.maxsize):
            self.use_onednn()
        elif self._gemm is not None:
            self.repack()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_kernel(x):
            return self._int8_kernel(x, x.dtype, self.bias)
        if (k := self._fused(x)) is not None:
            return k.int8_linear(x, self.packed, self.scale.view(-1), self.zero_points, self.bias, False)
        if self.packed is not None and x.dtype != torch.float64:
            return self._add_bias(self._int8_onednn(x, x.dtype), x)
        return self._add_bias(int8_matmul(x, self.weight, self.scale_t), x)

    def use_onednn(self) -> None:
        """Keep oneDNN's prepacked copy of the codes too: the path above the kernel's rows (tests and
        benchmarks/decode.py --gemm compare the kernel against it where the engine keeps none)."""
        self._onednn = True
        self.zero_points = torch.zeros(self.weight.shape[0], dtype=torch.int64)
        self.split = not onednn_int8_is_exact()
        self.ones = torch.ones(self.weight.shape[0])
        self.repack()

    def repack(self) -> None:
        """Rebuild the prepacked codes from the int8 buffers; needed after they were written in place."""
        if self._onednn:
            self.packed = torch.ops.onednn.qlinear_prepack(self.weight, None)
        if self._gemm is not None:
            self.panels, self.compensation = self._gemm.int8_pack(self.weight)

    def _fused(self, x: torch.Tensor) -> ModuleType | None:
        """The CPU kernels where their int8_linear (the oneDNN path in one call) applies to `x`, else None."""
        if self.packed is None or self.split or x.dim() != 2 or not x.is_contiguous():
            return None
        return usable(x)

    def _takes_kernel(self, x: torch.Tensor) -> bool:
        g = self._gemm
        return g is not None and x.dim() == 2 and x.shape[0] <= g.int8_gemm_max_rows and x.dtype != torch.float64

    def _int8_kernel(self, x: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
        """Same math as int8_matmul, exact: the kernel's int32 sums, dequantized (+ bias) in one pass."""
        xu, xs = _quantize_rows(x.contiguous())
        n = self.weight.shape[0]
        return torch.ops.qurl.int8_gemm(xu, xs, self.panels, self.compensation, self.scale.view(-1), bias, n, out_dtype)

    def _int8_onednn(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Same math as int8_matmul, exact: int8 codes shifted to uint8 with zero point 128 (oneDNN's fast s8 path)."""
        if self.split:
            return self._int8_onednn_split(x, out_dtype)
        xu, xs = _quantize_rows(x)
        acc = _qlinear(xu, 128, self.packed, self.scale.view(-1), self.zero_points)
        if out_dtype == acc.dtype:
            return acc.mul_(xs)
        return torch.mul(acc, xs, out=torch.empty(acc.shape, dtype=out_dtype))  # scaled in fp32, one store

    def _int8_onednn_split(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Where oneDNN's pairs saturate: the codes' positive and negative parts, each in [0, 127] so that a pair
        stays under 32767, as two GEMMs whose int32 sums are subtracted, then int8_matmul's dequantization."""
        xq, xs = quantize_int8(x, dim=-1)
        pos = _qlinear(xq.clamp(min=0).to(torch.uint8), 0, self.packed, self.ones, self.zero_points)
        neg = _qlinear(xq.neg().clamp_(min=0).to(torch.uint8), 0, self.packed, self.ones, self.zero_points)
        acc = pos.sub_(neg).mul_(xs.to(_compute_dtype(x))).mul_(self.scale_t)
        return acc if out_dtype == acc.dtype else acc.to(out_dtype)


class Int8Head(Int8Linear):
    """An int8 copy of a full-precision lm_head (quant.lm_head): the push keeps carrying `source`, requantized here."""

    def __init__(self, source: torch.Tensor) -> None:
        self.source = source
        codes, scale = quantize_int8(source)
        super().__init__(
            ["lm_head"], {"lm_head.weight": codes, "lm_head.weight_scale": scale}, source.dtype, source.device
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits stay in the int32 sums' fp32: no round trip through a bf16 model dtype."""
        if self._takes_kernel(x):
            return self._int8_kernel(x, torch.float32, None)
        if (k := self._fused(x)) is not None:
            return k.int8_linear(x, self.packed, self.scale.view(-1), self.zero_points, None, True)
        if self.packed is not None and x.dtype != torch.float64:
            return self._int8_onednn(x, torch.float32)
        return int8_matmul(x, self.weight, self.scale_t)

    def refresh(self) -> None:
        """Requantize after a push wrote `source` in place."""
        codes, scale = quantize_int8(self.source)
        self.weight.copy_(codes)
        self.scale.copy_(scale)
        self.repack()


class Fp8ChannelLinear(_RowScaled):
    """e4m3 codes with per-channel scales, per-token e4m3 activations: torch._scaled_mm on CUDA bf16, else exact."""

    scheme = FP8_CHANNEL
    _scaled_mm_ok = True  # set False on the instance when torch._scaled_mm refuses its shapes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_fp8(x, "channel")
        if x.is_cuda and x.dtype == torch.bfloat16 and self._scaled_mm_ok:
            try:
                out = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.scale_t, out_dtype=x.dtype)
                return self._add_bias(out, x)
            except RuntimeError:  # shapes or build without row-wise fp8 GEMM: use the exact fallback
                self._scaled_mm_ok = False
        ct = _compute_dtype(x)
        w = self.weight.to(ct).mul_(self.scale)
        return self._add_bias(dense_linear(xq.to(ct).mul_(xs), w), x)


class Fp8BlockLinear(FusedLinear):
    """e4m3 codes with one scale per 128 x 128 tile of each part (`X.weight_scale_inv`), per-token e4m3 activations."""

    scheme = FP8_BLOCK

    def __init__(
        self, prefixes: list[str], tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(prefixes, tensors, dtype, device)
        suffix = ".weight" + self.scheme.scale_suffix
        self.block_scales: list[torch.Tensor] = []  # one [ceil(n/128), ceil(k/128)] per part
        for p in prefixes:
            s = tensors[p + suffix].to(device=device, dtype=torch.float32, copy=True).contiguous()
            self.block_scales.append(s)
            self.named[p + suffix] = s

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_fp8(x, "channel")
        ct = _compute_dtype(x)
        w = self.weight.to(ct)
        for part, s in zip(w.split(self.sizes), self.block_scales):
            part.mul_(expand_blocks(s, *part.shape, self.scheme.block))
        return self._add_bias(dense_linear(xq.to(ct).mul_(xs), w), x)


LINEARS: dict[str, type[FusedLinear]] = {
    c.scheme.name: c for c in (DenseLinear, Int8Linear, Fp8ChannelLinear, Fp8BlockLinear)
}


def int8_matmul(x: torch.Tensor, wq: torch.Tensor, w_scale_t: torch.Tensor) -> torch.Tensor:
    """Per-token int8 activations times per-channel int8 weights, dequantized in fp32."""
    xq, xs = quantize_int8(x, dim=-1)
    m, k, n = xq.shape[0], xq.shape[1], wq.shape[0]
    if xq.is_cuda and (k % 8 or n % 8):  # cuBLAS int8 GEMM needs K, N multiples of 8: exact-enough fp32 path
        acc = xq.float() @ wq.float().t()
    elif xq.is_cuda and m < _CUDA_INT_MM_MIN_M:
        acc = torch._int_mm(F.pad(xq, (0, 0, 0, _CUDA_INT_MM_MIN_M - m)), wq.t())[:m]
    else:
        acc = torch._int_mm(xq, wq.t())  # transposed view: much faster than a contiguous copy on CPU
    return (acc * xs.to(_compute_dtype(x))).mul_(w_scale_t)  # int32 * fp32 promotes to fp32 in the same pass


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_uint8_shifted, in one pass by the CPU kernel where it applies."""
    k = usable(x)
    if k is not None and x.dim() == 2 and x.is_contiguous():
        return k.quantize_uint8_shifted(x)
    return quantize_uint8_shifted(x)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and bf16 models; fp64 when a parity check runs the engine in fp64."""
    return torch.promote_types(x.dtype, torch.float32)


def _fuse(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.cat([p.to(device=device, dtype=dtype) for p in parts]).contiguous()


def _views(fused: torch.Tensor, prefixes: list[str], suffix: str, sizes: list[int]) -> dict[str, torch.Tensor]:
    return {p + suffix: v for p, v in zip(prefixes, fused.split(sizes))}
