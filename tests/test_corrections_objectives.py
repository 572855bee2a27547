"""qurl/corrections/objectives.py and clips.py: GSPO, CISPO and the clipping rules against their formulas written out
by hand, values and gradients; the clip objective's own cases are in test_algorithms.py (the four modes)."""

import math

import pytest
import torch

from qurl.algorithms import policy_loss
from qurl.corrections.registry import CLIPS, OBJECTIVES
from qurl.corrections.spec import LossSpec
from tests.corrections_util import tokens

ONE = [[1.0, 1.0, 1.0], [1.0, 1.0, math.nan]]  # no mismatch: rho = 1, so weights and masks do nothing


def _loss(spec, ratio, adv, rho=ONE):
    t = tokens(rho=rho, ratio=ratio, adv=adv)
    loss, metrics = policy_loss(t.logp, t.logp_prox, t.logp_behav, torch.tensor(adv), t.m, spec)
    (grad,) = torch.autograd.grad(loss, t.logp)
    return loss.item(), grad, metrics


def test_registries_hold_the_named_objectives_and_rules():
    assert set(OBJECTIVES) == {"clip", "gspo", "cispo"} and set(CLIPS) == {"ppo", "acr"}


def test_gspo_sequence_ratio_clipped_with_its_own_small_eps():
    # row 0: R = 2, 0.5, 1 -> s = (2 * 0.5 * 1)^(1/3) = 1, inside [1 - 3e-4, 1 + 4e-4]: each token -A s, gradient
    # -A s / 5 per token (token-mean over 5 tokens). Row 1: R = 1.5, 1.5 -> s = 1.5 > 1.0004 with A = +1: clipped,
    # value -1.0004 per token, no gradient
    spec = LossSpec(mode="gspo", agg="token-mean")
    loss, grad, metrics = _loss(spec, [[2.0, 0.5, 1.0], [1.5, 1.5, 1.0]], (1.0, 1.0))
    assert loss == pytest.approx((-1.0 * 3 - 1.0004 * 2) / 5, rel=1e-6)
    assert grad.tolist() == [pytest.approx([-1 / 5] * 3, rel=1e-5), pytest.approx([0.0, 0.0, 0.0], abs=1e-9)]
    assert metrics["actor/clipfrac"] == pytest.approx(2 / 5)


def test_gspo_gradient_is_the_sequence_ratio_times_each_token_score():
    # s = (1.0002 * 1.0002 * 1.0002)^(1/3) = 1.0002 inside the clip, A = -1: d/d logp_t = -A s / n
    spec = LossSpec(mode="gspo", agg="seq-mean-token-mean")
    loss, grad, _ = _loss(spec, [[1.0002] * 3, [1.0, 1.0, 1.0]], (-1.0, 0.0))
    assert loss == pytest.approx(1.0002 / 2, rel=1e-6)  # row 0's token mean, over 2 rows
    assert grad[0].tolist() == pytest.approx([1.0002 / 3 / 2] * 3, rel=1e-5)


def test_cispo_capped_ratio_is_a_weight_that_keeps_the_gradient():
    # R = 1, 10, 0.1 with max 5: per token -min(R, 5) A log pi; gradient -min(R, 5) A / n even where capped
    spec = LossSpec(mode="cispo", cispo_max_ratio=5.0)
    t = tokens(rho=ONE, ratio=[[1.0, 10.0, 0.1], [1.0, 1.0, 1.0]], adv=(1.0, 0.0))
    loss, metrics = policy_loss(t.logp, t.logp_prox, t.logp_behav, torch.tensor([1.0, 0.0]), t.m, spec)
    lp = t.logp.detach()[0]
    assert loss.item() == pytest.approx(-(1 * lp[0] + 5 * lp[1] + 0.1 * lp[2]).item() / 5, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, t.logp)
    assert grad[0].tolist() == pytest.approx([-1 / 5, -5 / 5, -0.1 / 5], rel=1e-5)
    assert metrics["actor/clipfrac"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("name, want", [("ppo", [1.28, 1.28, 1.28]), ("acr", [1.28 * 1.5, 1.28, 1.28])])
def test_clip_rule_upper_bounds(name, want):
    # rho 3, 0.5, 1 with C = 2: ACR's bound is (1 + eps_high) max(1, rho / C)
    upper = CLIPS[name].fn(tokens(), LossSpec(eps_high=0.28, tis_cap=2.0))
    assert upper[0].tolist() == pytest.approx(want, rel=1e-6)


def test_a_rule_and_a_weight_chosen_over_a_preset():
    # tis with the acr rule is acr; decoupled with a truncated weight is tis (the presets are their pieces)
    rho, ratio, adv = [[3.0, 0.5, 1.0], [4.0, 2.0, math.nan]], [[1.5, 0.5, 1.4], [2.5, 0.5, 1.0]], (1.0, -1.0)
    for preset, chosen in (
        (LossSpec(mode="acr"), LossSpec(mode="tis", clip="acr")),
        (LossSpec(mode="tis"), LossSpec(mode="decoupled", weight="token-truncate")),
    ):
        a, ga, _ = _loss(preset, ratio, adv, rho)
        b, gb, _ = _loss(chosen, ratio, adv, rho)
        assert a == b and torch.equal(ga, gb)
