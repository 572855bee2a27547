"""One micro-batch's response tokens as every piece sees them: cleaned, fp32, with the mismatch ratio computed once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_RATIO_CLAMP = 20.0  # every log-ratio is clamped to +-20 before exp (e^20 ~ 4.9e8)


@dataclass(frozen=True)
class Tokens:
    logp: torch.Tensor  # [B, T] current policy, with gradient; 0 where masked
    logp_prox: torch.Tensor  # proximal (pi_old), no gradient
    logp_behav: torch.Tensor  # behaviour (the rollout engine's), no gradient
    adv: torch.Tensor  # [B, T] advantages, 0 where masked
    m: torch.Tensor  # [B, T] bool: response tokens

    @classmethod
    def clean(cls, logp, logp_prox, logp_behav, advantages, mask) -> Tokens:
        """fp32 throughout; masked positions may hold padding garbage (NaN, inf): zero it before any arithmetic."""
        m = mask.bool()
        zero = torch.zeros((), dtype=torch.float32, device=logp.device)
        adv = advantages.detach().float()
        adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
        return cls(
            torch.where(m, logp.float(), zero),
            torch.where(m, logp_prox.detach().float(), zero),
            torch.where(m, logp_behav.detach().float(), zero),
            torch.where(m, adv, zero),
            m,
        )

    @property
    def mf(self) -> torch.Tensor:
        return self.m.to(torch.float32)

    @property
    def log_rho(self) -> torch.Tensor:
        """log(pi_prox / pi_behav) per token, clamped; 0 where masked."""
        return (self.logp_prox - self.logp_behav).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    @property
    def rho(self) -> torch.Tensor:
        return torch.exp(self.log_rho)

    def row_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 1]: the sum over each row's response tokens."""
        return (x * self.mf).sum(-1, keepdim=True)

    def row_mean(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 1]: the mean over each row's response tokens (0 for a row without any)."""
        return self.row_sum(x) / self.mf.sum(-1, keepdim=True).clamp(min=1)

    def ratio(self, bypass: bool) -> torch.Tensor:
        """R = pi_theta / pi_prox, or / pi_behav when the objective bypasses the proximal policy."""
        base = self.logp_behav if bypass else self.logp_prox
        return torch.exp((self.logp - base).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
