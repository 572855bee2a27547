"""The learner's bf16 linears on CPU with each weight gradient's GEMM laid out for oneDNN, as a module swap.

A weight gradient dW = dy^T x reduces over a micro-batch's tokens, and both operands arrive token-major, so the GEMM's
left operand is a transposed view. oneDNN's bf16 GEMM runs such products at about half its rate (AMX Xeon, Qwen2.5-7B's
shapes over 4,167 tokens: 0.74-1.10 TFLOP/s against 1.8-2.1 forward). Here dy^T is first made contiguous by the CPU
kernels' tiled transpose (qurl/csrc), so the product runs at the plain rate and writes dW in the weight's own layout.
The values are the same products, each sum in oneDNN's own order.

The transpose costs in proportion to dy's size and the product's saving grows with both widths, so products whose
dy and x are both narrow keep torch's own backward. Per weight gradient over 1,100-4,167 tokens (AMX Xeon, RESULTS §13):
1.8-2.1x at the 7B's shapes, 1.4-2.1x at SmolLM2's gate/up, down and head, 0.7-0.8x at its 576 x 576 q and o.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from qurl import cpu_kernels

WIDE = 1024  # the width of dy or x from which dy is transposed first


def weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dy^T x for dy [tokens, out] and x [tokens, in]: [out, in], dy transposed first where it is bf16 on a CPU, dy or
    x is WIDE wide and the kernels are built."""
    laid = dy.is_cpu and dy.dtype == torch.bfloat16 and max(dy.shape[-1], x.shape[-1]) >= WIDE
    kernels = cpu_kernels.kernels() if laid else None
    if kernels is None or dy.stride(-1) != 1:
        return dy.t() @ x
    return kernels.transposed(dy) @ x


class _Linear(torch.autograd.Function):
    """y = x W^T + b, whose weight gradient is weight_grad's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        rows = dy.reshape(-1, dy.shape[-1])
        dx = (rows @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = weight_grad(rows, x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        db = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; through _Linear where a bf16 CPU weight will get a gradient."""
    if weight.requires_grad and torch.is_grad_enabled() and weight.dtype == torch.bfloat16 and weight.is_cpu:
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward through linear()."""
    return linear(x, self.weight, self.bias)


def install(model: nn.Module) -> int:
    """Swap linear_forward into every nn.Linear of a CPU model; the number swapped."""
    if next(model.parameters()).device.type != "cpu":
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = types.MethodType(linear_forward, module)
            swapped += 1
    return swapped
