"""Importance weights on the mismatch ratio rho = pi_prox / pi_behav: (weight [B, T], truncated [B, T] bool)."""

from __future__ import annotations

import torch

from qurl.corrections.registry import WEIGHTS
from qurl.corrections.tokens import LOG_RATIO_CLAMP, Tokens


@WEIGHTS.register("none")
def none(t: Tokens, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """1 for every token: no correction (naive PPO, or a mask alone)."""
    return torch.ones_like(t.logp_prox), torch.zeros_like(t.m)


@WEIGHTS.register("token")
def token(t: Tokens, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """rho per token, untruncated: decoupled PPO's weight (unbiased, unbounded variance)."""
    return t.rho, torch.zeros_like(t.m)


@WEIGHTS.register("token-truncate", reads=("tis_cap",))
def token_truncate(t: Tokens, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """min(rho, C) per token: truncated IS (FlashRL, verl token IS, slime --use-tis, QuRL)."""
    rho = t.rho
    return torch.clamp(rho, max=spec.tis_cap), (rho > spec.tis_cap) & t.m


def _per_row(t: Tokens, log_row: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    row = torch.exp(log_row.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return torch.clamp(row, max=cap).expand_as(t.logp_prox), (row > cap) & t.m


@WEIGHTS.register("sequence-truncate", reads=("tis_cap",))
def sequence_truncate(t: Tokens, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """min(prod_t rho_t, C) on every token of the row: sequence IS (verl, SkyRL, TRL); the product of a long row
    strays far from 1, so most rows are truncated or tiny."""
    return _per_row(t, t.row_sum(t.log_rho), spec.tis_cap)


@WEIGHTS.register("geometric", reads=("tis_cap",))
def geometric(t: Tokens, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """min(exp(mean_t log rho_t), C) on every token of the row: length-invariant, biased, low variance."""
    return _per_row(t, t.row_mean(t.log_rho), spec.tis_cap)
