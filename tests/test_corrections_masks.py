"""qurl/corrections/masks.py: each rejection mask against its rule written out by hand, and rejected tokens leaving
the loss's denominator."""

import pytest
import torch

from qurl.algorithms import policy_loss
from qurl.corrections.registry import MASKS
from qurl.corrections.spec import LossSpec
from tests.corrections_util import tokens

# rho row 0: 3, 0.5, 1 (product 1.5, geometric 1.145); row 1: 4, 2, padding (product 8, geometric 2.83)
SPEC = LossSpec(
    token_mask_low=0.5,
    token_mask_high=2.5,
    seq_mask_low=0.5,
    seq_mask_high=2.0,
    geo_mask_low=0.9,
    geo_mask_high=1.2,
    veto_floor=0.6,
)
HAND = {
    "none": [[1, 1, 1], [1, 1, 0]],
    "token": [[0, 1, 1], [0, 1, 0]],  # 3 and 4 are above 2.5; 0.5 sits on the lower bound: kept
    "sequence": [[1, 1, 1], [0, 0, 0]],
    "geometric": [[1, 1, 1], [0, 0, 0]],
    "veto": [[0, 0, 0], [1, 1, 0]],  # 0.5 < 0.6 vetoes row 0
}


def test_every_registered_mask_has_a_hand_case():
    assert set(HAND) == set(MASKS)


@pytest.mark.parametrize("name", list(HAND))
def test_mask_equals_its_rule(name):
    assert MASKS[name].fn(tokens(), SPEC).int().tolist() == HAND[name]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_rejected_tokens_leave_numerator_and_denominator(agg):
    # decoupled weights (rho) with R = 1 inside the clip: per token -A rho. Token mask keeps rho in [0.5, 2.5]:
    # row 0 keeps 0.5, 1 (A = +1): -0.5, -1; row 1 keeps 2 (A = -1): +2
    spec = LossSpec(mode="icepop", token_mask_low=0.5, token_mask_high=2.5, agg=agg)
    t = tokens()
    loss, metrics = policy_loss(t.logp, t.logp_prox, t.logp_behav, torch.tensor([1.0, -1.0]), t.m, spec)
    want = {
        "token-mean": (-0.5 - 1 + 2) / 3,  # 3 kept tokens, not the 5 response tokens
        "seq-mean-token-mean": ((-0.5 - 1) / 2 + 2 / 1) / 2,
        "seq-mean-token-sum": ((-0.5 - 1) + 2) / 2,
    }[agg]
    assert loss.item() == pytest.approx(want, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, t.logp)
    scale = {"token-mean": [1 / 3] * 2, "seq-mean-token-mean": [1 / 4, 1 / 2], "seq-mean-token-sum": [1 / 2] * 2}[agg]
    assert grad.tolist() == [
        pytest.approx([0, -0.5 * scale[0], -1 * scale[0]], abs=1e-7),
        pytest.approx([0, 2 * scale[1], 0], abs=1e-7),
    ]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.0  # each row keeps a token


def test_a_row_the_mask_rejects_whole_leaves_the_row_count():
    spec = LossSpec(mode="geo-rs", geo_mask_low=0.9, geo_mask_high=1.2, agg="seq-mean-token-sum")
    t = tokens()
    loss, metrics = policy_loss(t.logp, t.logp_prox, t.logp_behav, torch.tensor([1.0, -1.0]), t.m, spec)
    assert loss.item() == pytest.approx(-3.0 / 1, rel=1e-6)  # row 0 only: weight 1, R = 1, A = +1, three tokens
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.5
