"""Objectives: the per-token surrogate loss before the importance weight and the rejection mask multiply it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qurl.corrections.registry import OBJECTIVES
from qurl.corrections.tokens import LOG_RATIO_CLAMP, Tokens


@dataclass(frozen=True)
class Surrogate:
    per_token: torch.Tensor  # [B, T], with gradient
    clipped: torch.Tensor  # [B, T] bool: the clip is the active term (no gradient through R), or CISPO's cap bites
    dual: torch.Tensor  # [B, T] bool: capped by dual clip
    ratio: torch.Tensor  # [B, T] the ratio the objective clips, no gradient (for the ACR metrics)


@OBJECTIVES.register("clip", reads=("eps_low", "dual_clip"))
def clip(t: Tokens, spec, upper: torch.Tensor, bypass: bool) -> Surrogate:
    """max(-A R, -A clip(R, 1 - eps_low, upper)), upper from the clipping rule; dual clip caps A < 0 at -A c."""
    ratio = t.ratio(bypass)
    unclipped = -t.adv * ratio
    clipped = -t.adv * torch.clamp(ratio, min=torch.full_like(ratio, 1 - spec.eps_low), max=upper)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(t.m)
    if spec.dual_clip is not None:
        cap = -t.adv * spec.dual_clip
        dual = (t.adv < 0) & (cap < per_token)
        per_token = torch.where(t.adv < 0, torch.minimum(per_token, cap), per_token)
    return Surrogate(per_token, (clipped > unclipped) & t.m, dual & t.m, ratio.detach())


@OBJECTIVES.register("gspo", reads=("gspo_eps_low", "gspo_eps_high"))
def gspo(t: Tokens, spec, upper: torch.Tensor, bypass: bool) -> Surrogate:
    """GSPO(-token): s = exp(mean_t log R_t) per row, clipped to [1 - eps, 1 + eps] with GSPO's own small eps;
    each token carries sg(s) pi / sg(pi), so its gradient is s grad log pi (verl's form)."""
    base = t.logp_behav if bypass else t.logp_prox
    log_s = t.row_mean((t.logp - base).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
    s = torch.exp(log_s + t.logp - t.logp.detach())
    unclipped = -t.adv * s
    clipped = -t.adv * torch.clamp(s, 1 - spec.gspo_eps_low, 1 + spec.gspo_eps_high)
    return Surrogate(torch.maximum(unclipped, clipped), (clipped > unclipped) & t.m, torch.zeros_like(t.m), s.detach())


@OBJECTIVES.register("cispo", reads=("cispo_max_ratio",))
def cispo(t: Tokens, spec, upper: torch.Tensor, bypass: bool) -> Surrogate:
    """-sg(min(R, max_ratio)) A log pi (MiniMax-M1): the capped ratio is a weight, so capped tokens keep a gradient."""
    ratio = t.ratio(bypass).detach()
    per_token = -torch.clamp(ratio, max=spec.cispo_max_ratio) * t.adv * t.logp
    return Surrogate(per_token, (ratio > spec.cispo_max_ratio) & t.m, torch.zeros_like(t.m), ratio)
