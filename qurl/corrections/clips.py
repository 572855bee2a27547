"""Clipping rules: the trust region's upper bound on R per token (the lower bound is always 1 - eps_low)."""

from __future__ import annotations

import torch

from qurl.corrections.registry import CLIPS
from qurl.corrections.tokens import Tokens


@CLIPS.register("ppo", reads=("eps_low", "eps_high"))
def ppo(t: Tokens, spec) -> torch.Tensor:
    """1 + eps_high everywhere (PPO, with DAPO's clip-higher when eps_high > eps_low)."""
    return torch.full_like(t.logp_prox, 1 + spec.eps_high)


@CLIPS.register("acr", reads=("eps_low", "eps_high", "tis_cap"))
def acr(t: Tokens, spec) -> torch.Tensor:
    """(1 + eps_high) / min(1, C / rho): QuRL's adaptive range widens where truncation shrank the weight."""
    return (1 + spec.eps_high) * torch.clamp(t.rho / spec.tis_cap, min=1.0)
