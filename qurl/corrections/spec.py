"""The objective's settings (LossSpec), torch-free so that the config's defaults and checks come from here."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from qurl.corrections.presets import PRESETS

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
CONFIG_KEYS = {"mode": "loss", "agg": "loss_agg"}  # LossSpec field -> its key under algo. when the names differ


@dataclass(frozen=True)
class LossSpec:
    """Checked once where it is built (the config, the learner); policy_loss trusts it. Defaults are the config's."""

    mode: str = "acr"  # the preset (algo.loss)
    weight: str | None = None  # null: the preset's importance weight
    mask: str | None = None  # null: the preset's rejection mask
    clip: str | None = None  # null: the preset's clipping rule
    eps_low: float = 0.2
    eps_high: float = 0.28
    tis_cap: float = 2.0  # C: the truncation of token, sequence and geometric weights
    agg: str = "token-mean"
    dual_clip: float | None = None  # c > 1: for A < 0 the term is capped at -A c, on any clipping rule
    token_mask_low: float = 0.5  # token mask (IcePop): keep 0.5 <= rho <= 5 (NeMo RL's reference bounds)
    token_mask_high: float = 5.0
    seq_mask_low: float = 0.5  # sequence mask on the product of rho (verl Seq-MIS, SkyRL, slime)
    seq_mask_high: float = 2.0
    geo_mask_low: float = 0.9  # geometric mask on exp(mean log rho): set for INT8 rollout (docs/RESULTS.md §12)
    geo_mask_high: float = 1.1
    veto_floor: float = 1e-4  # veto: drop a sequence holding any token with rho below this (verl, slime)
    gspo_eps_low: float = 3e-4  # GSPO's own clip on the sequence ratio (verl's example recipe)
    gspo_eps_high: float = 4e-4
    cispo_max_ratio: float = 5.0  # CISPO: the stop-gradient weight is min(R, this) (ScaleRL, slime eps-clip-high 4)

    def __post_init__(self) -> None:
        from qurl.corrections.compose import pieces  # torch: only where a spec is built, never at config import

        if self.mode not in PRESETS:
            raise ValueError(f"algo.loss (loss mode) {self.mode!r} is not allowed; choose one of: {', '.join(PRESETS)}")
        if self.agg not in AGGS:
            raise ValueError(f"algo.loss_agg (loss aggregation) {self.agg!r} is not allowed; choose one of: {AGGS}")
        pieces(self)  # each name is registered
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"algo.eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ValueError(f"algo.eps_high must be >= 0, got {self.eps_high}")
        if not self.tis_cap > 0:
            raise ValueError(f"algo.tis_cap must be > 0, got {self.tis_cap}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"algo.dual_clip must be > 1 or null (off), got {self.dual_clip}")
        for kind in ("token", "seq", "geo"):
            low, high = getattr(self, f"{kind}_mask_low"), getattr(self, f"{kind}_mask_high")
            if not 0 < low < high < math.inf:
                raise ValueError(f"algo.{kind}_mask_low/high = {low}/{high}: need 0 < low < high < inf")
        if not 0 < self.veto_floor < 1:
            raise ValueError(f"algo.veto_floor must be in (0, 1), got {self.veto_floor}")
        if not (0 <= self.gspo_eps_low < 1 and self.gspo_eps_high >= 0):
            raise ValueError(f"algo.gspo_eps_low/high = {self.gspo_eps_low}/{self.gspo_eps_high}: need [0, 1) / >= 0")
        if not self.cispo_max_ratio > 0:
            raise ValueError(f"algo.cispo_max_ratio must be > 0, got {self.cispo_max_ratio}")

    @classmethod
    def from_config(cls, algo) -> LossSpec:
        """Every field from its algo.* key: a field the config lacks fails here, never silently takes a default."""
        return cls(**{f.name: getattr(algo, CONFIG_KEYS.get(f.name, f.name)) for f in fields(cls)})

    def as_config(self) -> dict:
        """The algo.* keys and values that give this spec back (for callers without a config file: the GPU check)."""
        return {CONFIG_KEYS.get(f.name, f.name): getattr(self, f.name) for f in fields(self)}
