"""Rejection masks: which response tokens the loss keeps ([B, T] bool). Rejected tokens leave the loss's numerator
and its denominator (docs/algorithms.md, "Rejected tokens and the denominator")."""

from __future__ import annotations

import math

import torch

from qurl.corrections.registry import MASKS
from qurl.corrections.tokens import Tokens


def _inside(log_x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return (log_x >= math.log(low)) & (log_x <= math.log(high))


@MASKS.register("none")
def none(t: Tokens, spec) -> torch.Tensor:
    """Keep every response token."""
    return t.m


@MASKS.register("token", reads=("token_mask_low", "token_mask_high"))
def token(t: Tokens, spec) -> torch.Tensor:
    """Keep a token when low <= rho <= high (IcePop; verl token RS, SkyRL token mask)."""
    return t.m & _inside(t.log_rho, spec.token_mask_low, spec.token_mask_high)


@MASKS.register("sequence", reads=("seq_mask_low", "seq_mask_high"))
def sequence(t: Tokens, spec) -> torch.Tensor:
    """Keep a row when low <= prod_t rho_t <= high (verl Seq-MIS, SkyRL product, TRL sequence_mask)."""
    return t.m & _inside(t.row_sum(t.log_rho), spec.seq_mask_low, spec.seq_mask_high)


@MASKS.register("geometric", reads=("geo_mask_low", "geo_mask_high"))
def geometric(t: Tokens, spec) -> torch.Tensor:
    """Keep a row when low <= exp(mean_t log rho_t) <= high (verl Geo-RS, NeMo seq-mask-tis, SkyRL geometric)."""
    return t.m & _inside(t.row_mean(t.log_rho), spec.geo_mask_low, spec.geo_mask_high)


@MASKS.register("veto", reads=("veto_floor",))
def veto(t: Tokens, spec) -> torch.Tensor:
    """Drop a row holding any token with rho < floor: one catastrophic token vetoes its sequence (verl, slime)."""
    bad = (t.log_rho < math.log(spec.veto_floor)) & t.m
    return t.m & ~bad.any(-1, keepdim=True)
