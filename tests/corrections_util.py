"""Hand-sized micro-batches for the correction pieces' tests: tokens with a chosen rho, R and advantage."""

import math

import torch

from qurl.corrections.tokens import Tokens

# two rows, three token slots; row 1's last slot is padding (NaN in every input, masked)
RHO = [[3.0, 0.5, 1.0], [4.0, 2.0, math.nan]]
MASK = torch.tensor([[True, True, True], [True, True, False]])


def tokens(rho=RHO, ratio=None, adv=(1.0, -1.0), mask=MASK, behav=-1.0) -> Tokens:
    """Tokens with logp_behav = behav, logp_prox = behav + log rho, logp = logp_prox + log R (R = 1 by default)."""
    rho = torch.tensor(rho, dtype=torch.float64)
    ratio = torch.ones_like(rho) if ratio is None else torch.tensor(ratio, dtype=torch.float64)
    b = torch.full_like(rho, behav)
    prox = b + rho.log()
    logp = (prox + ratio.log()).float().requires_grad_(True)
    return Tokens.clean(logp, prox.float(), b.float(), torch.tensor(adv), mask)
