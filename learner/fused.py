"""The learner's decoder layers on CPU with fused operators, as a module swap: RMSNorm's and SwiGLU's forward and
backward in one pass each (qurl/csrc), gate and up projected by one GEMM. At the learner's shapes each torch chain
(RMSNorm: eight operators forward and ten backward over fp32 copies; SiLU x up: five) wrote and read fresh
activation-sized tensors, which cost more than the arithmetic (RESULTS §13).

The same parameters and the same values: RMSNorm's forward bit for bit, SwiGLU's and both gradients within the model
dtype's rounding (tests/test_fused.py). Only the classes registered in FUSED are swapped, the ones whose forward is
the formula the kernels compute; any other model keeps its own.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

from learner.linear import linear
from qurl import cpu_kernels


class _RMSNorm(torch.autograd.Function):
    """y = w * dtype(x32 rsqrt(mean(x32^2) + eps)) over the last dimension (HF's RMSNorm)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, weight)
        ctx.eps, ctx.shape = eps, x.shape
        return cpu_kernels.kernels().rms_norm(rows, weight, eps).view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, weight = ctx.saved_tensors
        dy = dy.reshape(rows.shape).contiguous()
        dx, dw = cpu_kernels.kernels().rms_norm_backward(dy, rows, weight, ctx.eps)
        return dx.view(ctx.shape), dw, None


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up from [gate | up] rows, the SwiGLU MLP's activation."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        ctx.save_for_backward(rows)
        ctx.shape = gate_up.shape
        return cpu_kernels.kernels().silu_mul(rows).view(*gate_up.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        (rows,) = ctx.saved_tensors
        dh = dh.reshape(rows.shape[0], -1).contiguous()
        return cpu_kernels.kernels().silu_mul_backward(dh, rows).view(ctx.shape)


def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm forward by the kernels, where they apply (a contiguous input in the weight's dtype)."""
    if not hidden_states.is_contiguous() or hidden_states.dtype != self.weight.dtype:
        return type(self).forward(self, hidden_states)
    return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x), with gate and up in one GEMM over their concatenated weights."""
    gate_up = linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))
    return self.down_proj(_SiluMul.apply(gate_up))


def swiglu_applies(mlp: nn.Module) -> bool:
    """A bias-free SiLU MLP: the formula swiglu_forward computes."""
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"  # transformers' own for "silu"
    return silu and all(getattr(mlp, name).bias is None for name in ("gate_proj", "up_proj"))


def rms_norm_applies(norm: nn.Module) -> bool:
    """A weighted RMSNorm over the last dimension (its eps in variance_epsilon)."""
    return isinstance(getattr(norm, "variance_epsilon", None), float) and isinstance(norm.weight, nn.Parameter)


# class name -> (whether an instance fits, the forward swapped in): classes whose forward is the kernels' formula
FUSED: dict[str, tuple[Callable[[nn.Module], bool], Callable]] = {
    **{
        name: (rms_norm_applies, rms_norm_forward)
        for name in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
    },
    **{name: (swiglu_applies, swiglu_forward) for name in ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")},
}


def fuse(model: nn.Module) -> int:
    """Swap in the fused forwards on a CPU model where the kernels are built; the number of modules swapped."""
    if next(model.parameters()).device.type != "cpu" or cpu_kernels.kernels() is None:
        return 0
    swapped = 0
    for module in model.modules():
        entry = FUSED.get(type(module).__name__)
        if entry is not None and entry[0](module):
            module.forward = types.MethodType(entry[1], module)
            swapped += 1
    return swapped
