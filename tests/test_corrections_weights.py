"""qurl/corrections/weights.py: each importance weight against its formula written out by hand."""

import math

import pytest
import torch

from qurl.corrections.registry import WEIGHTS
from qurl.corrections.spec import LossSpec
from tests.corrections_util import tokens

SPEC = LossSpec(tis_cap=2.0)
# rho row 0: 3, 0.5, 1 (product 1.5); row 1: 4, 2 (product 8); C = 2
HAND = {
    "none": ([[1, 1, 1], [1, 1, 0]], [[0, 0, 0], [0, 0, 0]]),
    "token": ([[3, 0.5, 1], [4, 2, 0]], [[0, 0, 0], [0, 0, 0]]),
    "token-truncate": ([[2, 0.5, 1], [2, 2, 0]], [[1, 0, 0], [1, 0, 0]]),
    "sequence-truncate": ([[1.5, 1.5, 1.5], [2, 2, 0]], [[0, 0, 0], [1, 1, 0]]),
    "geometric": ([[1.5 ** (1 / 3)] * 3, [2, 2, 0]], [[0, 0, 0], [1, 1, 0]]),  # row 1: sqrt(8) > 2
}


def test_every_registered_weight_has_a_hand_case():
    assert set(HAND) == set(WEIGHTS)


@pytest.mark.parametrize("name", list(HAND))
def test_weight_equals_its_formula(name):
    t = tokens()
    weight, truncated = WEIGHTS[name].fn(t, SPEC)
    want, want_truncated = HAND[name]
    got = torch.where(t.m, weight, torch.zeros_like(weight))
    assert got.tolist() == [pytest.approx(row, rel=1e-6) for row in want]
    assert truncated.int().tolist() == want_truncated
    assert not weight.requires_grad  # a weight never passes a gradient into the rollout or proximal log-probs


def test_sequence_weight_of_a_long_row_stays_finite():
    t = tokens(rho=[[math.e**3] * 10, [1.0] * 10], mask=torch.ones(2, 10, dtype=torch.bool))
    weight, truncated = WEIGHTS["sequence-truncate"].fn(t, SPEC)  # exp(30) clamps at exp(20), then C
    assert torch.isfinite(weight).all() and weight[0, 0].item() == 2.0 and truncated[0].all()
    assert weight[1].tolist() == [1.0] * 10 and not truncated[1].any()
    assert WEIGHTS["geometric"].fn(t, SPEC)[0][0, 0].item() == 2.0  # e^3 per token, truncated at C
