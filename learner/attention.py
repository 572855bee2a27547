"""The learner's attention on CPU, forward and backward compiled (qurl/csrc). Torch's CPU flash backward ran at ~75
GFLOP/s on SmolLM2's GSM-shaped rows, a quarter of the learner's step; the compiled one runs the same blocks on oneDNN's
brgemm (AMX tiles where present) with the softmax gradient in registers, 3-7x faster per call. The forward, flash
attention's online softmax over the same blocks, reads grouped k and v without repeating them and writes its output
in the layout the output projection reads (RESULTS §13).

`install` registers it with transformers as the attention implementation `qurl_sdpa` and switches a CPU model from
`sdpa` to it. A call it does not cover (no gradient, fp32, dropout, an additive mask, a call under
`sdpa_kernel(MATH)`, keys longer than queries) goes to transformers' own SDPA attention, unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from qurl import cpu_kernels

NAME = "qurl_sdpa"


class _Attention(torch.autograd.Function):
    """softmax(q k^T scale, masked) v for bf16 [B, H, L, D] q and [B, H / g, L, D] k, v: causal where mask is None,
    else where the boolean mask is true."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
        out, lse = cpu_kernels.kernels().attention_forward(q, k, v, mask is None, mask, scale)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, mask = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = cpu_kernels.kernels().attention_backward(dout, q, k, v, out, lse, mask is None, mask, ctx.scale)
        return dq, dk, dv, None, None


@functools.cache
def ready() -> bool:
    """Whether this CPU runs the compiled attention: the kernels built with it and oneDNN's bf16 brgemm usable."""
    k = cpu_kernels.kernels()
    return k is not None and hasattr(k, "attention_backward") and k.attention_backward_ready()


def covers(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, causal: bool, dropout: float, **kwargs
) -> bool:
    """Whether the compiled attention computes this call, forward and backward (else transformers' SDPA does)."""
    d = query.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and torch.is_grad_enabled()
        and (query.requires_grad or key.requires_grad)
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and query.shape[2] == key.shape[2] > 1
        and d % 32 == 0
        and d <= 256
        and (mask.dtype == torch.bool if mask is not None else causal)
        and torch.backends.cuda.flash_sdp_enabled()  # on CPU too: a caller's sdpa_kernel(MATH) holds
        and ready()
    )


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: [B, L, H, D] out; the compiled attention where it covers the call."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if not covers(query, key, attention_mask, causal, dropout, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = _Attention.apply(query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA takes: boolean, None where causal alone will do


def install(model: nn.Module) -> bool:
    """Switch a CPU model on `sdpa` to the compiled attention where this CPU runs it; whether it did."""
    if next(model.parameters()).device.type != "cpu" or model.config._attn_implementation != "sdpa" or not ready():
        return False
    model.set_attn_implementation(NAME)
    return True
