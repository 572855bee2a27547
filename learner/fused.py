"""The learner's decoder layers on CPU with fused operators, as a module swap: RMSNorm's, SwiGLU's and the rotary
embedding's forward and backward in one pass each (qurl/csrc), gate and up projected by one GEMM, q, k and v by one.
At the learner's shapes each torch chain (RMSNorm: eight operators forward and ten backward over fp32 copies; SiLU x
up: five; rotary: six over q and k, with a concatenation) wrote and read fresh activation-sized tensors, which cost
more than the arithmetic (RESULTS §13).

The same parameters and the same values: RMSNorm's forward and the rotary embedding's forward and backward bit for
bit, SwiGLU's and the other gradients within the model dtype's rounding (tests/test_fused.py). Only the classes
registered in FUSED are swapped, the ones whose forward is the formula the kernels compute; any other model keeps its
own.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

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


class _Rotary(torch.autograd.Function):
    """x cos + rotate_half(x) sin over [B, L, heads, head_dim] rows (HF's rotary embedding), cos and sin [B or 1, L,
    head_dim] without a gradient (transformers computes them under no_grad)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return cpu_kernels.kernels().rotary(x, cos, sin, False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return cpu_kernels.kernels().rotary(dy.contiguous(), cos, sin, True), None, None


def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm forward by the kernels, where they apply (a contiguous input in the weight's dtype)."""
    if not hidden_states.is_contiguous() or hidden_states.dtype != self.weight.dtype:
        return type(self).forward(self, hidden_states)
    return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x), with gate and up in one GEMM over their concatenated weights."""
    gate_up = linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))
    return self.down_proj(_SiluMul.apply(gate_up))


def rotary_fits(x: torch.Tensor, position_embeddings: tuple | None, head_dim: int) -> bool:
    """Whether the kernel takes these cos and sin for hidden states x: contiguous [B or 1, L, head_dim] in x's dtype,
    fp32 or bf16."""
    if position_embeddings is None or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    return all(
        t.dtype == x.dtype
        and t.is_contiguous()
        and t.dim() == 3
        and t.shape[0] in (1, x.shape[0])
        and t.shape[1:] == (x.shape[1], head_dim)
        for t in position_embeddings
    )


def attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF's Llama / Qwen2 attention forward with q, k and v projected by one GEMM (one input gradient, not three
    summed) and q and k rotated by the kernels in its [B, L, heads, head_dim] rows; a call with a cache, or cos and sin
    the kernel does not take, runs the class's own forward."""
    cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
    if cached or not rotary_fits(hidden_states, position_embeddings, self.head_dim):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    cos, sin = position_embeddings
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    projections = (self.q_proj, self.k_proj, self.v_proj)
    weight = torch.cat([p.weight for p in projections])
    bias = torch.cat([p.bias for p in projections]) if self.q_proj.bias is not None else None
    q, k, v = linear(hidden_states, weight, bias).split([p.out_features for p in projections], dim=-1)
    query = _Rotary.apply(q.view(shape), cos, sin).transpose(1, 2)
    key = _Rotary.apply(k.view(shape), cos, sin).transpose(1, 2)
    value = v.view(shape).transpose(1, 2)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    if hasattr(self, "sliding_window"):  # Qwen2's one difference from Llama
        kwargs["sliding_window"] = self.sliding_window
    dropout = 0.0 if not self.training else self.attention_dropout
    out, weights = interface(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def swiglu_applies(mlp: nn.Module) -> bool:
    """A bias-free SiLU MLP: the formula swiglu_forward computes."""
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"  # transformers' own for "silu"
    return silu and all(getattr(mlp, name).bias is None for name in ("gate_proj", "up_proj"))


def rotary_applies(attention: nn.Module) -> bool:
    """An attention without norms of its own on q and k, and biases on all of q, k and v or none: the formula
    attention_forward computes."""
    biased = {getattr(attention, name).bias is not None for name in ("q_proj", "k_proj", "v_proj")}
    return not hasattr(attention, "q_norm") and not hasattr(attention, "k_norm") and len(biased) == 1


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
    **{name: (rotary_applies, attention_forward) for name in ("LlamaAttention", "Qwen2Attention")},
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
