"""Invariant scaling: W X = (W / s)(s X), folded into the RMSNorm gain before training so that
optimizer updates are larger relative to the quantization grid while the model function stays the same."""

from __future__ import annotations

import math

import torch
from torch import nn

TARGETS = ("qkv", "mlp")
MODEL_TYPES = ("llama", "qwen2", "qwen3")  # RMSNorm computes gain * x_hat (not (1 + gain) * x_hat)

# target -> (norm that feeds the projections, module holding them, projection names)
_GROUPS = {
    "qkv": ("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj")),
    "mlp": ("post_attention_layernorm", "mlp", ("gate_proj", "up_proj")),
}


def _check(model: nn.Module, s: float, targets: tuple[str, ...]) -> tuple[list[nn.Module], tuple[str, ...]]:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
        raise ValueError(f"invariant scaling s must be a finite number > 0, got {s!r}")
    if isinstance(targets, str):
        raise ValueError(f"invariant scaling targets must be a tuple such as ('qkv',), got the string {targets!r}")
    targets = tuple(targets)
    if not targets or len(set(targets)) != len(targets) or any(t not in TARGETS for t in targets):
        raise ValueError(f"invariant scaling targets must be distinct names from {TARGETS}, got {targets}")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"invariant scaling supports model types {MODEL_TYPES}, got {model_type!r}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"invariant scaling needs decoder layers at model.model.layers ({type(model).__name__})")
    return list(layers), targets


def _fold(model: nn.Module, s: float, targets: tuple[str, ...], inverse: bool) -> nn.Module:
    layers, targets = _check(model, s, targets)
    with torch.no_grad():
        for layer in layers:
            for target in targets:
                norm, holder, projs = _GROUPS[target]
                gain = getattr(layer, norm).weight
                weights = [getattr(getattr(layer, holder), p).weight for p in projs]
                if inverse:
                    gain.div_(s)
                    for w in weights:
                        w.mul_(s)
                else:
                    gain.mul_(s)
                    for w in weights:
                        w.div_(s)
    return model


def apply_invariant_scaling(model: nn.Module, s: float, targets: tuple[str, ...] = ("qkv",)) -> nn.Module:
    """In place: norm gain *= s and the projection weights it feeds /= s (biases untouched)."""
    return _fold(model, s, targets, inverse=False)


def remove_invariant_scaling(model: nn.Module, s: float, targets: tuple[str, ...] = ("qkv",)) -> nn.Module:
    """In place inverse of apply_invariant_scaling (exact for powers of two, else within one rounding)."""
    return _fold(model, s, targets, inverse=True)
