"""qurl/corrections/metrics.py: the mismatch metrics against their definitions on a hand batch, and their combination
over micro-batches equal to the whole batch's."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qurl.algorithms import policy_loss
from qurl.corrections.metrics import REDUCE, Reducer
from qurl.corrections.spec import LossSpec
from tests.corrections_util import tokens


def test_hand_batch_metrics():
    # rho row 0: 3, 0.5, 1; row 1: 4, 2 (5 tokens); behav log-prob -1 everywhere, so prox = -1 + log rho
    t = tokens()
    loss, m = policy_loss(t.logp, t.logp_prox, t.logp_behav, torch.tensor([1.0, -1.0]), t.m, LossSpec(mode="tis"))
    rho = [3.0, 0.5, 1.0, 4.0, 2.0]
    log = [math.log(r) for r in rho]
    assert m["rollout_corr/kl"] == m["mismatch/kl_k1"] == pytest.approx(-sum(log) / 5, rel=1e-5)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(r - 1 - lr for r, lr in zip(rho, log)) / 5, rel=1e-5)
    train = [-1 + sum(log[:3]) / 3, -1 + sum(log[3:]) / 2]  # mean log-prob per row, training (proximal) side
    assert m["rollout_corr/training_ppl"] == pytest.approx((math.exp(-train[0]) + math.exp(-train[1])) / 2, rel=1e-5)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(math.e, rel=1e-5)
    diff = [-1 - x for x in train]  # log(training ppl / rollout ppl) per row
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(sum(diff) / 2, rel=1e-5)
    assert m["rollout_corr/log_ppl_abs_diff"] == pytest.approx(sum(map(abs, diff)) / 2, rel=1e-5)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(sum(math.exp(d) for d in diff) / 2, rel=1e-5)
    assert (m["rollout_corr/log_ppl_diff_max"], m["rollout_corr/log_ppl_diff_min"]) == pytest.approx(
        (max(diff), min(diff)), rel=1e-5
    )
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(r * r for r in rho) / 5 - 1, rel=1e-5)
    assert m["rollout_corr/chi2_seq"] == pytest.approx((1.5**2 + 8**2) / 2 - 1, rel=1e-5)
    w = [2.0, 0.5, 1.0, 2.0, 2.0]  # min(rho, 2)
    mean, second = sum(w) / 5, sum(x * x for x in w) / 5
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(mean, rel=1e-6)
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(math.sqrt(second - mean**2), rel=1e-5)
    assert (m["rollout_corr/rollout_is_min"], m["rollout_corr/rollout_is_max"]) == (0.5, 2.0)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(mean**2 / second, rel=1e-5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)  # 3 and 4 truncated at 2
    assert m["rollout_corr/rollout_rs_masked_fraction"] == m["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.0
    assert set(m) == set(REDUCE)


def test_uncorrected_ppo_logs_the_same_mismatch():
    t = tokens()
    args = (t.logp, t.logp_prox, t.logp_behav, torch.tensor([1.0, -1.0]), t.m)
    ppo, tis = policy_loss(*args, LossSpec(mode="ppo"))[1], policy_loss(*args, LossSpec(mode="tis"))[1]
    for key in ("rollout_corr/k3_kl", "rollout_corr/training_ppl", "rollout_corr/chi2_seq", "tis/truncated_frac"):
        assert ppo[key] == tis[key]
    assert ppo["rollout_corr/rollout_is_mean"] == 1.0 and ppo["rollout_corr/rollout_is_eff_sample_size"] == 1.0


def _one_rank(values):
    return list(values)


@given(seed=st.integers(0, 10_000), cut=st.integers(1, 5), mode=st.sampled_from(["acr", "icepop", "seq-mis"]))
@settings(max_examples=25, deadline=None)
def test_micro_batches_combine_to_the_whole_batch(seed, cut, mode):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 5
    behav = -torch.rand(b, t, generator=g) * 3
    prox = behav + torch.randn(b, t, generator=g)
    logp = prox + torch.randn(b, t, generator=g) * 0.3
    adv, mask = torch.randn(b, generator=g), torch.rand(b, t, generator=g) > 0.3
    spec = LossSpec(mode=mode)
    _, whole = policy_loss(logp, prox, behav, adv, mask, spec)
    reducer = Reducer()
    for rows in (slice(0, cut), slice(cut, b)):
        _, part = policy_loss(logp[rows], prox[rows], behav[rows], adv[rows], mask[rows], spec)
        reducer.add(part, int(mask[rows].sum()), int(mask[rows].any(-1).sum()))
    combined = reducer.reduce(_one_rank, _one_rank)
    for key in REDUCE:
        assert combined[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-5), key


def test_a_step_whose_updates_were_all_skipped_logs_nan():
    assert all(math.isnan(v) for v in Reducer().reduce(_one_rank, _one_rank).values())
