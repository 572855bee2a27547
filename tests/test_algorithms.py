"""qurl.algorithms: hand-computed losses per mode, the ACR identities, gradients, edge cases."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qurl.algorithms import (
    MODES,
    LossSpec,
    filter_groups,
    group_advantages,
    kl_penalty,
    overlong_penalty,
    policy_loss,
)

C, EPS_LOW, EPS_HIGH = 2.0, 0.2, 0.28
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def _batch(rho, ratio, adv):
    """Tokens [B, T] with the given rho = pi_prox / pi_behav, R = pi_theta / pi_prox and advantages."""
    rho, ratio = torch.tensor(rho, dtype=torch.float64), torch.tensor(ratio, dtype=torch.float64)
    behav = torch.linspace(-0.5, -3.0, rho.shape[1], dtype=torch.float64).expand(rho.shape)
    prox = behav + rho.log()
    logp = (prox + ratio.log()).float().requires_grad_(True)
    return logp, prox.float(), behav.float(), torch.tensor(adv), torch.ones(rho.shape, dtype=torch.bool)


# Five tokens, C = 2, eps = 0.2 / 0.28 (acr upper = 1.28 * max(1, rho / 2)):
#   a: rho 3,   R 1.5, A +1   b: rho 1, R 0.5, A -2   c: rho 0.5, R 1.4, A +0.5
#   d: rho 4,   R 2.5, A +1   e: rho 4, R 0.5, A -1
# ppo uses R * rho against the behaviour policy with w = 1:
#   a 4.5 -> clip 1.28 -> -1.28; b 0.5 -> 0.8 * 2 = 1.6; c 0.7 < 0.8, A > 0 keeps 0.7 -> -0.35;
#   d 10 -> -1.28; e 2.0 with A < 0 keeps 2.0 -> +2.0
# decoupled (w = rho, upper 1.28): a -3 * 1.28 = -3.84; b 1.6; c -0.5 * 0.5 * 1.28 = -0.32;
#   d -4 * 1.28 = -5.12; e 4 * 0.8 = 3.2
# tis (w = min(rho, 2)): a -2.56; b 1.6; c -0.32; d -2.56; e 1.6
# acr (w as tis, upper 1.92 for a, 2.56 for d): a -2 * 1.5 = -3.0; b 1.6; c -0.32; d -2 * 2.5 = -5.0; e 1.6
HAND = dict(rho=[3.0, 1.0, 0.5, 4.0, 4.0], ratio=[1.5, 0.5, 1.4, 2.5, 0.5], adv=[1.0, -2.0, 0.5, 1.0, -1.0])
HAND_TOKENS = {
    "ppo": [-1.28, 1.6, -0.35, -1.28, 2.0],
    "decoupled": [-3.84, 1.6, -0.32, -5.12, 3.2],
    "tis": [-2.56, 1.6, -0.32, -2.56, 1.6],
    "acr": [-3.0, 1.6, -0.32, -5.0, 1.6],
}
HAND_CLIPFRAC = {"ppo": 3 / 5, "decoupled": 5 / 5, "tis": 5 / 5, "acr": 3 / 5}


def _hand_batch():
    return _batch([HAND["rho"]], [HAND["ratio"]], [HAND["adv"]])


@pytest.mark.parametrize("mode", MODES)
def test_hand_computed_loss_and_metrics(mode):
    logp, prox, behav, adv, mask = _hand_batch()
    loss, m = policy_loss(logp, prox, behav, adv, mask, LossSpec(mode=mode))
    assert loss.item() == pytest.approx(sum(HAND_TOKENS[mode]) / 5, abs=1e-5)
    assert m["actor/clipfrac"] == pytest.approx(HAND_CLIPFRAC[mode])
    assert m["tis/truncated_frac"] == pytest.approx(3 / 5)  # a, d, e have rho > 2
    assert m["mismatch/rho_max"] == pytest.approx(4.0, rel=1e-5)
    assert m["acr/upper_max"] == pytest.approx(2.56, rel=1e-5)
    assert m["acr/upper_over_100_frac"] == 0.0
    logs = [math.log(r) for r in HAND["rho"]]
    assert m["mismatch/kl_k1"] == pytest.approx(-sum(logs) / 5, abs=1e-5)
    assert m["mismatch/kl_k3"] == pytest.approx(sum(r - 1 - lr for r, lr in zip(HAND["rho"], logs)) / 5, abs=1e-5)
    # a and d sit between 1.28 and the widened bound with A > 0 (with ppo's ratio R * rho: none)
    assert m["acr/widened_frac"] == pytest.approx(0.0 if mode == "ppo" else 2 / 5)
    assert m["actor/dual_clipfrac"] == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_hand_computed_per_token_gradients(mode):
    logp, prox, behav, adv, mask = _hand_batch()
    policy_loss(logp, prox, behav, adv, mask, LossSpec(mode=mode))[0].backward()
    # unclipped tokens: d(-w * A * R)/d logp = -w * A * R_mode; clipped ones: 0
    expected = {
        "ppo": [0, 0, -0.35, 0, 2.0],
        "decoupled": [0, 0, 0, 0, 0],
        "tis": [0, 0, 0, 0, 0],
        "acr": [-3.0, 0, 0, -5.0, 0],
    }[mode]
    assert logp.grad[0].tolist() == pytest.approx([g / 5 for g in expected], abs=1e-6)


def test_aggregations_hand_computed():
    # row 0: tokens a, b; row 1: token d only; row 2 fully masked. acr per token: -3.0, 1.6 | -5.0
    logp, prox, behav, adv, _ = _batch(
        [[3.0, 1.0], [4.0, 1.0], [1.0, 1.0]],
        [[1.5, 0.5], [2.5, 1.0], [1.0, 1.0]],
        [[1.0, -2.0], [1.0, 1.0], [1.0, 1.0]],
    )
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.float32)
    expected = {
        "token-mean": (-3.0 + 1.6 - 5.0) / 3,
        "seq-mean-token-mean": ((-3.0 + 1.6) / 2 + -5.0) / 2,
        "seq-mean-token-sum": ((-3.0 + 1.6) + -5.0) / 2,
    }
    for agg, value in expected.items():
        loss, _ = policy_loss(logp, prox, behav, adv, mask, LossSpec(mode="acr", agg=agg))
        assert loss.item() == pytest.approx(value, abs=1e-5), agg


def test_dual_clip_hand_computed():
    # A = -1, rho = 1, R = 5: ppo term -A * R = 5, dual clip caps it at -A * c = 3 and zeroes the gradient
    logp, prox, behav, adv, mask = _batch([[1.0, 1.0]], [[5.0, 2.0]], [[-1.0, -1.0]])
    loss, m = policy_loss(logp, prox, behav, adv, mask, LossSpec(mode="acr", dual_clip=3.0))
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2, abs=1e-5)
    assert logp.grad[0].tolist() == pytest.approx([0.0, 2.0 / 2], abs=1e-6)
    assert m["actor/dual_clipfrac"] == pytest.approx(0.5)
    no_dual, _ = policy_loss(logp, prox, behav, adv, mask, LossSpec(mode="acr"))
    assert no_dual.item() == pytest.approx((5.0 + 2.0) / 2, abs=1e-5)


def _random_batch(seed, b=4, t=7, rho_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(b, t, generator=g) * 3
    prox = behav + torch.randn(b, t, generator=g) * rho_scale
    logp = (prox + torch.randn(b, t, generator=g) * 0.3).requires_grad_(True)
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    return logp, prox, behav, adv, mask


@given(seed=st.integers(0, 10_000), agg=st.sampled_from(AGGS))
@settings(max_examples=30, deadline=None)
def test_identity_all_modes_equal_when_behaviour_is_proximal(seed, agg):
    logp, prox, _, adv, mask = _random_batch(seed)
    losses, grads = [], []
    for mode in MODES:
        loss, _ = policy_loss(logp, prox, prox, adv, mask, LossSpec(mode=mode, agg=agg))
        (grad,) = torch.autograd.grad(loss, logp)
        losses.append(loss.item())
        grads.append(grad)
    assert losses == pytest.approx([losses[0]] * 4, abs=1e-6)
    for grad in grads[1:]:
        torch.testing.assert_close(grad, grads[0], rtol=0, atol=1e-7)


@given(seed=st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_identity_acr_equals_tis_where_rho_at_most_c(seed):
    logp, prox, behav, adv, mask = _random_batch(seed, rho_scale=2.0)
    small = torch.exp(prox - behav) <= C
    # token-mean gradients are per token, so compare them token by token over the full batch
    (g_tis,) = torch.autograd.grad(policy_loss(logp, prox, behav, adv, mask, LossSpec(mode="tis"))[0], logp)
    (g_acr,) = torch.autograd.grad(policy_loss(logp, prox, behav, adv, mask, LossSpec(mode="acr"))[0], logp)
    assert torch.equal(g_tis[small], g_acr[small])
    sub = mask & small
    tis, _ = policy_loss(logp, prox, behav, adv, sub, LossSpec(mode="tis"))
    acr, _ = policy_loss(logp, prox, behav, adv, sub, LossSpec(mode="acr"))
    assert tis.item() == acr.item()
    # where rho > C, ACR only differs on positive advantages above the fixed bound 1 + eps_high
    ratio = torch.exp(logp - prox).detach()
    differs = (g_tis != g_acr) & mask
    assert ((adv[:, None] > 0) & (ratio > 1 + EPS_HIGH) & ~small)[differs].all()


@pytest.mark.parametrize("rho", [2.5, 10.0, 1e3])
def test_identity_acr_stops_clipping_exactly_at_widened_bound(rho):
    bound = (1 + EPS_HIGH) * rho / C
    below = bound * (1 - 1e-4)
    above = bound * (1 + 1e-4)
    logp, prox, behav, adv, mask = _batch([[rho, rho]], [[below, above]], [[1.0, 1.0]])
    loss, m = policy_loss(logp, prox, behav, adv, mask, LossSpec(mode="acr"))
    loss.backward()
    w = C  # min(rho, C) with rho > C
    assert logp.grad[0, 0].item() == pytest.approx(-w * below / 2, rel=1e-4)  # still unclipped
    assert logp.grad[0, 1].item() == 0.0  # clipped just past the bound
    assert loss.item() == pytest.approx(-w * (below + bound) / 2, rel=1e-4)
    assert m["acr/upper_max"] == pytest.approx(bound, rel=1e-5)
    assert m["actor/clipfrac"] == 0.5


@pytest.mark.parametrize("mode", MODES)
def test_gradient_zero_on_clipped_side_of_each_bound(mode):
    # rho = 1 so every mode shares the bounds [0.8, 1.28]; w = 1
    ratios = [[1.5, 0.5, 0.5, 1.5, 1.0]]
    adv = [[1.0, 1.0, -1.0, -1.0, 1.0]]
    logp, prox, behav, a, mask = _batch([[1.0] * 5], ratios, adv)
    policy_loss(logp, prox, behav, a, mask, LossSpec(mode=mode))[0].backward()
    g = logp.grad[0].tolist()
    assert g[0] == 0.0  # A > 0 above the upper bound: clipped
    assert g[1] == pytest.approx(-0.5 / 5, rel=1e-5)  # A > 0 below the lower bound: unclipped
    assert g[2] == 0.0  # A < 0 below the lower bound: clipped
    assert g[3] == pytest.approx(1.5 / 5, rel=1e-5)  # A < 0 above the upper bound: unclipped
    assert g[4] == pytest.approx(-1.0 / 5, rel=1e-5)  # inside the trust region


def test_fully_masked_rows_and_batch_are_nan_free():
    logp, prox, behav, adv, _ = _random_batch(0, b=3, t=5)
    garbage = torch.tensor(float("nan"))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    mask[2, 3:] = False
    for x in (prox, behav):
        x[~mask] = garbage
    with torch.no_grad():
        logp[~mask] = float("-inf")
    for agg in AGGS:
        for mode in MODES:
            loss, metrics = policy_loss(logp, prox, behav, adv, mask, LossSpec(mode=mode, agg=agg, dual_clip=3.0))
            (grad,) = torch.autograd.grad(loss, logp)
            assert torch.isfinite(loss) and torch.isfinite(grad).all()
            assert (grad[~mask] == 0).all()
            assert all(math.isfinite(v) for v in metrics.values())
            empty, empty_metrics = policy_loss(
                logp, prox, behav, adv, torch.zeros_like(mask), LossSpec(mode=mode, agg=agg)
            )
            assert empty.item() == 0.0 and torch.autograd.grad(empty, logp)[0].abs().sum() == 0
            assert all(v == 0.0 for v in empty_metrics.values())


def test_extreme_log_ratios_are_clamped():
    logp, prox, behav, adv, mask = _batch([[1.0, 1.0]], [[1.0, 1.0]], [[1.0, 1.0]])
    behav = torch.tensor([[-100.0, 0.0]])
    prox = torch.tensor([[0.0, -100.0]])
    loss, m = policy_loss(prox.clone().requires_grad_(True), prox, behav, adv, mask, LossSpec(mode="acr"))
    assert torch.isfinite(loss)
    assert m["mismatch/rho_max"] == pytest.approx(math.exp(20), rel=1e-5)
    assert m["acr/upper_over_100_frac"] == 0.5


@given(
    b=st.integers(1, 4),
    t=st.integers(1, 6),
    seed=st.integers(0, 1000),
    mode=st.sampled_from(MODES),
    agg=st.sampled_from(AGGS),
    mask_bits=st.integers(0, 2**24 - 1),
)
@settings(max_examples=60, deadline=None)
def test_property_masked_positions_never_matter(b, t, seed, mode, agg, mask_bits):
    logp, prox, behav, adv, _ = _random_batch(seed, b=b, t=t, rho_scale=3.0)
    mask = torch.tensor([[(mask_bits >> (i * t + j)) & 1 for j in range(t)] for i in range(b)], dtype=torch.bool)
    loss, metrics = policy_loss(logp, prox, behav, adv, mask, LossSpec(mode=mode, agg=agg))
    noisy = [x.detach().clone() for x in (logp, prox, behav)]
    for x in noisy:
        x[~mask] = float("nan")
    noisy[0].requires_grad_(True)
    loss2, metrics2 = policy_loss(*noisy, adv, mask, LossSpec(mode=mode, agg=agg))
    assert loss.item() == loss2.item() and metrics == metrics2
    g1, g2 = torch.autograd.grad(loss, logp)[0], torch.autograd.grad(loss2, noisy[0])[0]
    assert torch.equal(g1, g2) and (g1[~mask] == 0).all()
    for key in ("actor/clipfrac", "tis/truncated_frac", "acr/widened_frac", "acr/upper_over_100_frac"):
        assert 0.0 <= metrics[key] <= 1.0
    assert metrics["mismatch/kl_k3"] >= -1e-6  # k3 >= 0 up to fp32 rounding


def test_advantages_per_token_match_per_sequence():
    logp, prox, behav, adv, mask = _random_batch(3)
    a, _ = policy_loss(logp, prox, behav, adv, mask, LossSpec(mode="acr"))
    b, _ = policy_loss(logp, prox, behav, adv[:, None].expand(mask.shape), mask, LossSpec(mode="acr"))
    assert a.item() == b.item()


def test_bf16_inputs_give_fp32_loss():
    logp, prox, behav, adv, mask = _random_batch(4)
    loss, _ = policy_loss(logp.bfloat16(), prox.bfloat16(), behav.bfloat16(), adv, mask, LossSpec(mode="acr"))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="grpo"), "loss mode"),
        (dict(mode="acr", agg="mean"), "aggregation"),
        (dict(mode="acr", eps_low=1.0), "eps_low"),
        (dict(mode="acr", eps_high=-0.1), "eps_high"),
        (dict(mode="acr", tis_cap=0.0), "tis_cap"),
        (dict(mode="acr", dual_clip=1.0), "dual_clip"),
    ],
)
def test_policy_loss_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossSpec(**kwargs)  # checked once, where the settings are built: policy_loss trusts them


def test_policy_loss_bad_shapes():
    logp, prox, behav, adv, mask = _random_batch(0)
    with pytest.raises(ValueError, match="logp_prox"):
        policy_loss(logp, prox[:, :3], behav, adv, mask, LossSpec(mode="acr"))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, prox, behav, adv[:2], mask, LossSpec(mode="acr"))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(logp[0], prox[0], behav[0], adv, mask[0], LossSpec(mode="acr"))


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 5.0, 2.0, 4.0])
    groups = torch.tensor([7, 7, 7, 7, 2, 2, 2, 9, 4, 4])  # not contiguous ids, a group of one (9)
    grpo = group_advantages(rewards, groups, "grpo")
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 5.0, -1 / math.sqrt(2), 1 / math.sqrt(2)]
    assert grpo.tolist() == pytest.approx(expected, rel=1e-5)
    assert grpo[4:7].tolist() == [0.0, 0.0, 0.0]  # all-equal group: exactly zero
    assert group_advantages(rewards, groups, "drgrpo").tolist() == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 5.0, -1.0, 1.0], abs=1e-6
    )
    # rloo: r_i minus the mean of the other members
    assert group_advantages(rewards, groups, "rloo").tolist() == pytest.approx(
        [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 0, 0, 0, 5.0, -2.0, 2.0], abs=1e-6
    )


def test_group_advantages_edge_cases():
    ones = group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), eps=0.0)
    assert ones.tolist() == [0.0] * 4
    assert group_advantages(torch.tensor([1, 0]), torch.tensor([0, 0])).dtype == torch.float32
    assert group_advantages(torch.empty(0), torch.empty(0, dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), "ppo")
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.ones(2), torch.zeros(2))
    with pytest.raises(ValueError, match="equal length"):
        group_advantages(torch.ones(2), torch.zeros(3, dtype=torch.long))


@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
    estimator=st.sampled_from(["grpo", "drgrpo", "rloo"]),
)
@settings(max_examples=50, deadline=None)
def test_property_group_advantages(sizes, seed, estimator):
    g = torch.Generator().manual_seed(seed)
    groups = torch.cat([torch.full((n,), i * 3) for i, n in enumerate(sizes)])
    rewards = torch.randint(0, 3, (len(groups),), generator=g).float()
    perm = torch.randperm(len(groups), generator=g)
    groups, rewards = groups[perm], rewards[perm]
    adv = group_advantages(rewards, groups, estimator)
    assert torch.isfinite(adv).all()
    for gid in groups.unique():
        sel = groups == gid
        if sel.sum() > 1:
            assert adv[sel].sum().item() == pytest.approx(0.0, abs=1e-5)  # baselines centre every group
            if estimator == "grpo" and rewards[sel].std() > 0:
                assert adv[sel].std().item() == pytest.approx(1.0, rel=1e-4)


def test_filter_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 2.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3])
    keep, dropped = filter_groups(rewards, groups)
    assert keep.tolist() == [False, False, True, True, False, True, True, True]
    assert dropped == 2  # group 0 (all 1.0) and the group of one (2)


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([0, 12, 16, 17, 18, 20, 25])
    # max_len 20, buffer 4: 0 up to 16, then -factor * (L - 16) / 4, -factor beyond 20
    assert overlong_penalty(lengths, 20, 4, 1.0).tolist() == pytest.approx([0, 0, 0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty(lengths, 20, 4, 0.5)[3].item() == pytest.approx(-0.125)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 20, 0, 1.0)
    with pytest.raises(ValueError, match="factor"):
        overlong_penalty(lengths, 20, 4, -1.0)


def test_kl_penalty_hand_computed():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -2.0, 0.0])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, 0.0, -0.5])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.0, 0.125])
    k3 = kl_penalty(logp, ref, "k3")
    assert k3.tolist() == pytest.approx([math.exp(-0.5) + 0.5 - 1, 0.0, math.exp(0.5) - 0.5 - 1])
    assert torch.isfinite(kl_penalty(torch.tensor([-200.0]), torch.tensor([0.0]), "k3")).all()
    with pytest.raises(ValueError, match="kl kind"):
        kl_penalty(logp, ref, "k4")


@given(seed=st.integers(0, 1000))
@settings(max_examples=20, deadline=None)
def test_property_k3_nonnegative_with_zero_gradient_at_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(16, generator=g) * 3).requires_grad_(True)
    assert (kl_penalty(logp, torch.randn(16, generator=g) * 3, "k3") >= 0).all()
    (grad,) = torch.autograd.grad(kl_penalty(logp, logp.detach(), "k3").sum(), logp)
    assert (grad == 0).all()


def test_no_gradient_through_weights_bounds_or_advantages():
    logp, prox, behav, adv, mask = _random_batch(5, rho_scale=2.0)
    prox, behav, adv = (x.detach().clone().requires_grad_(True) for x in (prox, behav, adv))
    loss, _ = policy_loss(logp, prox, behav, adv, mask, LossSpec(mode="acr"))
    grads = torch.autograd.grad(loss, [logp, prox, behav, adv], allow_unused=True)
    assert grads[0] is not None and all(g is None for g in grads[1:])
