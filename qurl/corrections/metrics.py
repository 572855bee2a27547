"""Mismatch and correction metrics, logged in every mode (names as verl's `rollout_corr/` where one exists), and
their combination over micro-batches and ranks (docs/algorithms.md, "Metrics")."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from qurl.corrections.clips import acr
from qurl.corrections.metric_keys import ACR_UPPER_LOG_THRESHOLD, ESS, IS_MEAN, IS_STD, REDUCE
from qurl.corrections.objectives import Surrogate
from qurl.corrections.tokens import LOG_RATIO_CLAMP, Tokens


def _extreme(x: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    """max (or min) of x where valid; 0 when nothing is."""
    fill = -math.inf if largest else math.inf
    flat = torch.where(valid, x, torch.full_like(x, fill)).flatten()
    value = flat.max() if largest else flat.min()
    return torch.where(torch.isfinite(value), value, torch.zeros_like(value))


def mismatch_metrics(
    t: Tokens, weight: torch.Tensor, truncated: torch.Tensor, keep: torch.Tensor, sur: Surrogate, spec
) -> dict[str, float]:
    """Every REDUCE key for one micro-batch: means over its response tokens or rows, 0 when it has none."""
    m, mf = t.m, t.mf
    n = mf.sum()
    total = n.clamp(min=1)
    rows = m.any(-1)
    n_rows = rows.float().sum().clamp(min=1)
    log_rho, rho = t.log_rho, t.rho

    def tok(x: torch.Tensor) -> torch.Tensor:
        return (torch.where(m, x.float(), torch.zeros_like(mf))).sum() / total

    def seq(x: torch.Tensor) -> torch.Tensor:  # x [B, 1]
        return torch.where(rows, x.squeeze(-1), torch.zeros_like(x.squeeze(-1))).sum() / n_rows

    upper = acr(t, spec)
    w = weight.detach()
    w_mean = tok(w)
    mean_train, mean_rollout = t.row_mean(t.logp_prox), t.row_mean(t.logp_behav)
    log_ppl_diff = mean_rollout - mean_train  # log(training ppl / rollout ppl) per row
    seq_rho = torch.exp(t.row_sum(log_rho).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    k1, k3 = tok(-log_rho), tok(rho - 1 - log_rho)
    kept_rows = (keep & m).any(-1)
    values = {
        "actor/clipfrac": tok(sur.clipped),
        "actor/dual_clipfrac": tok(sur.dual),
        "tis/truncated_frac": tok(rho > spec.tis_cap),
        "acr/widened_frac": tok((t.adv > 0) & (sur.ratio > 1 + spec.eps_high) & (sur.ratio <= upper)),
        "acr/upper_max": _extreme(upper, m, True),
        "acr/upper_over_100_frac": tok(upper > ACR_UPPER_LOG_THRESHOLD),
        "mismatch/kl_k1": k1,
        "mismatch/kl_k3": k3,
        "mismatch/rho_max": _extreme(rho, m, True),
        "rollout_corr/kl": k1,  # verl's names for the same two estimates
        "rollout_corr/k3_kl": k3,
        "rollout_corr/training_ppl": seq(torch.exp(-mean_train)),
        "rollout_corr/rollout_ppl": seq(torch.exp(-mean_rollout)),
        "rollout_corr/ppl_ratio": seq(torch.exp(log_ppl_diff)),
        "rollout_corr/log_ppl_diff": seq(log_ppl_diff),
        "rollout_corr/log_ppl_abs_diff": seq(log_ppl_diff.abs()),
        "rollout_corr/log_ppl_diff_max": _extreme(log_ppl_diff, rows[:, None], True),
        "rollout_corr/log_ppl_diff_min": _extreme(log_ppl_diff, rows[:, None], False),
        "rollout_corr/chi2_token": tok(rho * rho - 1),
        "rollout_corr/chi2_seq": seq(seq_rho * seq_rho - 1),
        IS_MEAN: w_mean,
        IS_STD: (tok(w * w) - w_mean * w_mean).clamp(min=0).sqrt(),
        "rollout_corr/rollout_is_min": _extreme(w, m, False),
        "rollout_corr/rollout_is_max": _extreme(w, m, True),
        ESS: torch.where(n > 0, w_mean * w_mean / tok(w * w).clamp(min=1e-30), torch.zeros_like(n)),
        "rollout_corr/rollout_is_ratio_fraction_high": tok(truncated),
        "rollout_corr/rollout_rs_masked_fraction": tok(~keep),
        "rollout_corr/rollout_rs_seq_masked_fraction": seq((rows & ~kept_rows)[:, None]),
    }
    return dict(zip(values, torch.stack([v.float() for v in values.values()]).tolist()))  # one device sync


class Reducer:
    """Combines micro-batches' metrics by REDUCE, then across ranks with the given sum / max all-reduces."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys((k for k, kind in REDUCE.items() if kind in ("token", "seq", "std")), 0.0)
        self.extremes = dict.fromkeys((k for k, kind in REDUCE.items() if kind in ("max", "min")), -math.inf)
        self.tokens = self.rows = 0.0
        self.parts = 0  # the same on every rank: a skipped update is skipped on all of them

    def add(self, metrics: dict[str, float], tokens: int, rows: int) -> None:
        """One micro-batch's metrics; one without response tokens (a rank's padding) adds nothing."""
        self.parts += 1
        if not tokens:
            return
        self.tokens, self.rows = self.tokens + tokens, self.rows + rows
        for key in self.sums:
            kind, value = REDUCE[key], metrics[key]
            if kind == "std":  # its second moment, which does combine
                value = value * value + metrics[IS_MEAN] ** 2
            self.sums[key] += value * (rows if kind == "seq" else tokens)
        for key in self.extremes:  # min as the max of its negation
            self.extremes[key] = max(self.extremes[key], metrics[key] if REDUCE[key] == "max" else -metrics[key])

    def reduce(
        self, all_sum: Callable[[list[float]], list[float]], all_max: Callable[[list[float]], list[float]]
    ) -> dict:
        """Collective: every REDUCE key (NaN for all when every update of the step was skipped; 0 with no tokens)."""
        if not self.parts:
            return dict.fromkeys(REDUCE, float("nan"))
        *sums, tokens, rows = all_sum([*self.sums.values(), self.tokens, self.rows])
        out = {k: v / max(rows if REDUCE[k] == "seq" else tokens, 1.0) for k, v in zip(self.sums, sums)}
        for key, value in zip(self.extremes, all_max(list(self.extremes.values()))):
            value = value if math.isfinite(value) else 0.0
            out[key] = value if REDUCE[key] == "max" else -value
        second = out[IS_STD]
        out[IS_STD] = math.sqrt(max(second - out[IS_MEAN] ** 2, 0.0))
        out[ESS] = out[IS_MEAN] ** 2 / second if second > 0 else 0.0
        return {k: out[k] for k in REDUCE}
