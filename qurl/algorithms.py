"""The policy loss composed from its registered pieces (qurl.corrections), group advantages, KL penalties and the
DAPO pieces; formulas, defaults and open choices in docs/algorithms.md."""

from __future__ import annotations

import torch

from qurl.corrections.compose import pieces
from qurl.corrections.metrics import mismatch_metrics
from qurl.corrections.presets import MODES  # noqa: F401  (qurl's four modes, now presets)
from qurl.corrections.spec import LossSpec
from qurl.corrections.tokens import LOG_RATIO_CLAMP, Tokens

ESTIMATORS = ("grpo", "drgrpo", "rloo")
KL_KINDS = ("k1", "k2", "k3")


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


def kept_tokens(logp_prox: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """[B, T] bool: the response tokens the spec's rejection mask keeps (the loss's denominator counts these)."""
    t = Tokens.clean(logp_prox, logp_prox, logp_behav, torch.zeros(mask.shape[:1], device=mask.device), mask)
    return pieces(spec).mask.fn(t, spec)


def policy_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
) -> tuple[torch.Tensor, dict[str, float]]:
    """weight x mask x surrogate, each a registered piece (qurl.corrections); returns (loss, metrics).

    The loss is normalised by the tokens (or rows) the rejection mask keeps, so rejected tokens leave the numerator
    and the denominator alike."""
    _check_shapes(logp, logp_prox, logp_behav, advantages, mask)
    t = Tokens.clean(logp, logp_prox, logp_behav, advantages, mask)
    use = pieces(spec)
    weight, truncated = use.weight.fn(t, spec)
    keep = use.mask.fn(t, spec)
    sur = use.objective.fn(t, spec, use.clip.fn(t, spec), use.bypass)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    per_token = torch.where(keep, weight * sur.per_token, zero)

    kf = keep.to(torch.float32)
    n_tok = kf.sum(-1)
    rows = (n_tok > 0).to(torch.float32)
    if spec.agg == "token-mean":
        loss = per_token.sum() / n_tok.sum().clamp(min=1)
    else:
        row_loss = per_token.sum(-1)
        if spec.agg == "seq-mean-token-mean":
            row_loss = row_loss / n_tok.clamp(min=1)
        loss = row_loss.sum() / rows.sum().clamp(min=1)
    with torch.no_grad():
        metrics = mismatch_metrics(t, weight, truncated, keep, sur, spec)
    return loss, metrics
