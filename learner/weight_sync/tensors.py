"""What the rollout engine loads, made from the learner's weights: projections quantized (codes and scales), the rest
in the engine's dtype, a tied lm_head left out.

`gather_engine_tensors` makes them from the sharded model one parameter at a time: each is gathered whole onto the
ranks' device, quantized there, and only its codes and scales (or its cast copy) reach rank 0's host. A full fp32
copy of the model on the host (30 GB at 7B), and FP8 block quantization's passes over it on rank 0's CPU, are gone.
`engine_tensors` does the same from a full state dict already on the host.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from qurl.quant import quantize_state_dict


def _engine_entries(
    name: str, tensor: torch.Tensor, scheme: str, weight_bits: int, engine_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One parameter as the engine holds it, on the host: its codes and scale, or a copy in the engine's dtype."""
    out = quantize_state_dict({name: tensor}, scheme, weight_bits)
    # a tensor passed through may share storage with the live parameter (one rank): copy it, so that a later resend
    # of this version sends this version
    return {k: v.to("cpu", engine_dtype, copy=True) if v is tensor else v.to("cpu") for k, v in out.items()}


def engine_tensors(
    state: dict[str, torch.Tensor], scheme: str, weight_bits: int, engine_dtype: torch.dtype, tied: bool
) -> dict[str, torch.Tensor]:
    """What the engine loads, from a full state dict (what a delta push diffs and checksums: qurl/wire/delta.py)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not (tied and name == "lm_head.weight"):
            out.update(_engine_entries(name, tensor, scheme, weight_bits, engine_dtype))
    return out


def gather_engine_tensors(
    model: nn.Module, scheme: str, weight_bits: int, engine_dtype: torch.dtype, tied: bool, is_main: bool
) -> dict[str, torch.Tensor]:
    """Collective: what the engine loads, on rank 0's host (empty elsewhere); each parameter is gathered and
    quantized on the device, one at a time, so the peak is one whole parameter per rank."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if tied and name == "lm_head.weight":  # the embedding, already sent
                continue
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            if is_main:
                out.update(_engine_entries(name, whole.detach(), scheme, weight_bits, engine_dtype))
            del whole
    return out
