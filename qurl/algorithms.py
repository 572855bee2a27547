"""The QuRL objective (decoupled PPO + truncated IS + adaptive clipping range), group advantages,
KL penalties and the DAPO pieces; formulas and open choices in docs/algorithms.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("ppo", "decoupled", "tis", "acr")
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
ESTIMATORS = ("grpo", "drgrpo", "rloo")
KL_KINDS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0
ACR_UPPER_LOG_THRESHOLD = 100.0  # acr/upper_over_100_frac counts bounds above this (no cap is applied)


def _groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: dense group index, group size, and whether its group's rewards are all equal."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            "rewards and group_ids must be 1-D of equal length, "
            f"got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    _, index = torch.unique(group_ids, return_inverse=True)
    n_groups = int(index.max().item()) + 1 if index.numel() else 0
    r = rewards.float()
    gmax = torch.full((n_groups,), -torch.inf, device=r.device).scatter_reduce_(0, index, r, "amax")
    gmin = torch.full((n_groups,), torch.inf, device=r.device).scatter_reduce_(0, index, r, "amin")
    return index, torch.bincount(index, minlength=n_groups)[index], (gmax == gmin)[index]


def _group_mean(values: torch.Tensor, index: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """Mean of each sample's group, per sample (index < len(values), so len(values) slots suffice)."""
    sums = torch.zeros_like(values).index_add_(0, index, values)
    return sums[index] / size.to(values.dtype)


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Outcome advantage per sample from the rewards of its group (a group of one has baseline 0, std 1)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    index, size, equal = _groups(rewards, group_ids)
    r = rewards.float()
    single = size == 1
    # all-equal groups get exactly 0 (a computed mean may differ from the rewards in the last bit)
    centred = torch.where(single, r, torch.where(equal, torch.zeros_like(r), r - _group_mean(r, index, size)))
    n = size.to(r.dtype)
    if estimator == "drgrpo":
        return centred
    if estimator == "rloo":
        return n / (n - 1).clamp(min=1) * centred  # r_i - mean of the others
    var = _group_mean(centred * centred, index, size) * n / (n - 1).clamp(min=1)
    std = torch.where(single, torch.ones_like(var), var.sqrt())
    return torch.where(centred == 0, torch.zeros_like(r), centred / (std + eps))


def filter_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """DAPO dynamic sampling: keep-mask over samples that drops groups whose rewards are all equal."""
    index, _, equal = _groups(rewards, group_ids)
    return ~equal, torch.unique(index[equal]).numel()


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to max_len - buffer, linear to -factor at max_len, then -factor."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}")
    if factor < 0:
        raise ValueError(f"overlong factor must be >= 0, got {factor}")
    excess = (lengths.float() - (max_len - buffer)) / buffer
    return -factor * excess.clamp(0.0, 1.0)


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimator on samples of pi_theta (Schulman's k1, k2, k3)."""
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")
    if kind == "k1":
        return logp - logp_ref
    if kind == "k2":
        return 0.5 * (logp - logp_ref) ** 2
    log_ratio = (logp_ref - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio) - log_ratio - 1


@dataclass(frozen=True)
class LossSpec:
    """The objective's settings, checked once where they are built (config.algo); policy_loss trusts them."""

    mode: str
    eps_low: float = 0.2
    eps_high: float = 0.28
    tis_cap: float = 2.0
    agg: str = "token-mean"
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"loss mode must be one of {MODES}, got {self.mode!r}")
        if self.agg not in AGGS:
            raise ValueError(f"loss aggregation must be one of {AGGS}, got {self.agg!r}")
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}")


def _check_shapes(
    logp: torch.Tensor, logp_prox: torch.Tensor, logp_behav: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> None:
    """The tensors of one call line up (a mismatch would broadcast silently into a wrong loss)."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("logp_prox", logp_prox), ("logp_behav", logp_behav), ("mask", mask)):
        if t.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape {tuple(logp.shape)}, got {tuple(t.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(logp.shape)}, got {tuple(advantages.shape)}")


def policy_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate that corrects for a quantized, stale sampler; returns (loss, metrics)."""
    _check_shapes(logp, logp_prox, logp_behav, advantages, mask)
    mode, eps_low, eps_high, tis_cap, agg, dual_clip = (
        spec.mode,
        spec.eps_low,
        spec.eps_high,
        spec.tis_cap,
        spec.agg,
        spec.dual_clip,
    )
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    # fp32 throughout; masked positions may hold padding garbage (NaN, inf): zero it before any arithmetic
    logp = torch.where(m, logp.float(), zero)
    logp_prox = torch.where(m, logp_prox.detach().float(), zero)
    logp_behav = torch.where(m, logp_behav.detach().float(), zero)
    adv = advantages.detach().float()
    adv = torch.where(m, adv.unsqueeze(-1) if adv.dim() == 1 else adv, zero)

    log_rho = (logp_prox - logp_behav).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(log_rho)
    truncated = torch.clamp(rho, max=tis_cap)
    acr_upper = (1 + eps_high) * torch.clamp(rho / tis_cap, min=1.0)  # (1 + eps_high) / min(1, C / rho)
    base = logp_behav if mode == "ppo" else logp_prox
    ratio = torch.exp((logp - base).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = {"ppo": torch.ones_like(rho), "decoupled": rho, "tis": truncated, "acr": truncated}[mode]
    upper = acr_upper if mode == "acr" else torch.full_like(rho, 1 + eps_high)

    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, min=torch.full_like(ratio, 1 - eps_low), max=upper)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)
    per_token = torch.where(m, weight * per_token, zero)

    mf = m.to(torch.float32)
    n_tok = mf.sum(-1)
    rows = (n_tok > 0).to(torch.float32)
    if agg == "token-mean":
        loss = per_token.sum() / n_tok.sum().clamp(min=1)
    else:
        row_loss = per_token.sum(-1)
        if agg == "seq-mean-token-mean":
            row_loss = row_loss / n_tok.clamp(min=1)
        loss = row_loss.sum() / rows.sum().clamp(min=1)

    with torch.no_grad():
        total = mf.sum().clamp(min=1)

        def frac(cond: torch.Tensor) -> torch.Tensor:
            return (cond & m).to(torch.float32).sum() / total

        def masked_max(x: torch.Tensor) -> torch.Tensor:  # 0 when nothing is unmasked (x > 0 here)
            return torch.cat([torch.where(m, x, zero).flatten(), zero.view(1)]).max()

        dual = torch.zeros_like(m)
        if dual_clip is not None:
            dual = (adv < 0) & (-adv * dual_clip < torch.maximum(unclipped, clipped))
        values = {
            "actor/clipfrac": frac(clipped > unclipped),
            "actor/dual_clipfrac": frac(dual),
            "tis/truncated_frac": frac(rho > tis_cap),
            "acr/widened_frac": frac((adv > 0) & (ratio > 1 + eps_high) & (ratio <= acr_upper)),
            "acr/upper_max": masked_max(acr_upper),
            "acr/upper_over_100_frac": frac(acr_upper > ACR_UPPER_LOG_THRESHOLD),
            "mismatch/kl_k1": (-log_rho * mf).sum() / total,
            "mismatch/kl_k3": ((rho - 1 - log_rho) * mf).sum() / total,
            "mismatch/rho_max": masked_max(rho),
        }
        metrics = dict(zip(values, torch.stack(list(values.values())).tolist()))  # one device sync
    return loss, metrics
