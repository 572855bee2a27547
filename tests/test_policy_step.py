"""The policy step alone: the demo model on a one-rank gloo group, no sockets, no run folder, a hand-built batch.

Its update must equal the same step written out by hand on a plain (unsharded) copy of the model: one mini-batch,
the forward's own logprobs as the proximal policy, policy_loss, gradient clipping, one AdamW step.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket

import pytest
import torch

from learner.batch import Batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def random_batch(prompt_len: list[int], total_len: list[int], rewards: list[float], vocab: int, seed: int) -> Batch:
    """Groups of two samples (one prompt, two responses) of random tokens, right padded to the longest row, random
    behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    prompt, total = torch.tensor(prompt_len), torch.tensor(total_len)
    n, length = len(prompt_len), int(total.max())
    behav = torch.zeros(n, length)
    for i in range(n):
        behav[i, prompt[i] : total[i]] = -torch.rand(int(total[i] - prompt[i]), generator=g) * 3
    ids = torch.randint(3, vocab, (n, length), generator=g)
    for i in range(1, n, 2):
        ids[i, : prompt[i]] = ids[i - 1, : prompt[i]]
    return Batch(ids, prompt, total, behav, torch.tensor(rewards), torch.arange(n) // 2)


def hand_built_batch() -> Batch:
    """Four groups of two samples with different prompt and response lengths, right padded to 20 tokens."""
    return random_batch(
        [6, 6, 7, 7, 5, 5, 6, 6], [12, 20, 15, 9, 18, 11, 20, 13], [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25], 200, 0
    )


def one_rank_policy(config: str, overrides: list[str]):
    """(cfg, PolicyStep) of configs/CONFIG with the overrides, one mini-batch and no eval files, on this rank."""
    from learner.model import build_policy
    from learner.policy_step import DistEnv, PolicyStep
    from qurl.config import load_config

    cfg = load_config(os.path.join(ROOT, "configs", config), ["data.eval_files=[]", "train.mini_batches=1", *overrides])
    torch.manual_seed(0)
    model = build_policy(cfg, torch.device("cpu"))
    return cfg, PolicyStep(
        model, None, cfg.train, cfg.algo, cfg.rollout.sampling, DistEnv(0, 1, 0, torch.device("cpu"))
    )


# a rejection mask over several micro-batches: the loss's denominator counts the kept tokens of all of them
MASKED = ["algo.loss=icepop", "algo.token_mask_low=3e-6", "algo.token_mask_high=1", "train.micro_batch_tokens=40"]


PACKED = ["train.micro_batches=packed"]


@pytest.mark.parametrize(
    "overrides",
    [[], MASKED, PACKED, [*MASKED, *PACKED]],
    ids=["acr", "icepop-4-micro-batches", "packed", "packed-icepop-micro-batches"],
)
def test_one_policy_step_equals_the_step_written_out_by_hand(gloo_one_rank, demo_dir, overrides):
    from learner.model import load_hf
    from qurl.algorithms import LossSpec, group_advantages, policy_loss

    cfg, policy = one_rank_policy(
        "demo-cpu.yaml",
        [
            f"model.path={os.path.join(demo_dir, 'model')}",
            f"data.train_files=[{os.path.join(demo_dir, 'train.jsonl')}]",
            "algo.kl_coef=0",
            "train.lr=1e-3",
            "rollout.sampling.max_new_tokens=14",
            *overrides,
        ],
    )
    before = {k: v.full_tensor().clone() for k, v in policy.model.state_dict().items()}
    batch = hand_built_batch()

    result = policy.step(batch, step=0)

    after = {k: v.full_tensor() for k, v in policy.model.state_dict().items()}
    m = result.metrics
    assert result.updated and result.skipped == 0 and m["train/updates"] == 1
    assert math.isfinite(m["loss/policy"]) and math.isfinite(m["actor/grad_norm"]) and m["actor/tokens"] == 70
    assert any(not torch.equal(before[k], after[k]) for k in before)

    plain = load_hf(cfg.model.path, torch.device("cpu"))  # the same weights, invariant scaling included, unsharded
    plain.load_state_dict(before)
    plain.train()
    start, end = int(batch.prompt_len.min()), int(batch.total_len.max())
    pos = torch.arange(start, end)
    mask = (pos >= batch.prompt_len[:, None]) & (pos < batch.total_len[:, None])
    advantages = group_advantages(batch.rewards, batch.group, estimator=cfg.algo.advantage)
    # the dense log-softmax over the whole vocabulary, as a reference for the learner's chunked head
    logits = plain(input_ids=batch.input_ids[:, :end]).logits[:, start - 1 : end - 1].float()
    logits = logits / cfg.rollout.sampling.temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    logp = log_softmax.gather(-1, batch.input_ids[:, start:end, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1).detach()
    spec = LossSpec.from_config(cfg.algo)
    loss, metrics = policy_loss(logp, logp.detach(), batch.behav_logp[:, start:end], advantages, mask, spec)
    if MASKED[0] in overrides:
        assert m["actor/micro_batches"] >= (2 if PACKED[0] in overrides else 4)
        assert 0.2 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 0.8
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.train.grad_clip).item()
    lr = cfg.train.lr / cfg.train.warmup_steps if cfg.train.warmup_steps else cfg.train.lr
    torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=cfg.train.weight_decay).step()

    assert m["lr"] == pytest.approx(lr, rel=1e-12)
    assert m["loss/policy"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert m["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    for key in metrics:  # every metric combines over micro-batches to the whole batch's value
        assert m[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    assert m["actor/entropy"] == pytest.approx((entropy * mask).sum().item() / mask.sum().item(), rel=1e-5)
    grads = {n: p.grad.full_tensor() for n, p in policy.model.named_parameters()}
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)
        # AdamW's first step moves each weight by ~lr * sign(grad): a gradient at rounding level (a k_proj bias's is
        # 0 in exact arithmetic) moves its weight by anything up to lr, so the update is compared where it is not
        solid = param.grad.abs() > 1e-6
        torch.testing.assert_close(after[name][solid], param.detach()[solid], rtol=1e-5, atol=1e-6, msg=name)


def demo_policy(demo_dir, overrides: list[str]):
    """The demo recipe's PolicyStep on this rank without its KL penalty, in micro-batches of 40 tokens."""
    return one_rank_policy(
        "demo-cpu.yaml",
        [
            f"model.path={os.path.join(demo_dir, 'model')}",
            f"data.train_files=[{os.path.join(demo_dir, 'train.jsonl')}]",
            "algo.kl_coef=0",
            "train.micro_batch_tokens=40",
            "rollout.sampling.max_new_tokens=14",
            *overrides,
        ],
    )[1]


def test_one_rank_accumulates_micro_batches_unsharded_to_the_same_step(gloo_one_rank, demo_dir):
    """bf16 on one rank: micro-batches before the last keep their unsharded gradients (fp32) and parameters, and the
    step equals the one that syncs after every micro-batch, bit for bit."""
    from unittest import mock

    batch = hand_built_batch()
    grads, params = [], []
    for defer in (True, False):
        policy = demo_policy(demo_dir, ["train.precision=bf16"])
        patch = mock.patch("learner.policy_step.defer_gradient_sync", lambda m, last: False)
        with contextlib.nullcontext() if defer else patch:
            result = policy.step(batch, step=0)
        assert result.updated and result.metrics["actor/micro_batches"] >= 3
        grads.append({n: p.grad.full_tensor() for n, p in policy.model.named_parameters()})
        params.append({n: p.full_tensor() for n, p in policy.model.named_parameters()})
    for name in grads[0]:
        assert grads[0][name].dtype == torch.float32
        assert torch.equal(grads[0][name], grads[1][name]), name
        assert torch.equal(params[0][name], params[1][name]), name


def test_a_skipped_update_leaves_no_unsynced_gradient_behind(gloo_one_rank, demo_dir):
    """A non-finite loss in a later micro-batch skips the update; what the earlier ones accumulated unsharded is
    dropped with it, so the next step's gradients are those of a fresh policy."""
    batch, poisoned = hand_built_batch(), hand_built_batch()
    policy = demo_policy(demo_dir, ["train.precision=bf16"])
    cuts = policy.planner(torch.arange(len(batch.rewards)), batch, policy.train_cfg.micro_batch_tokens)
    assert len(cuts) >= 2  # the poisoned row's micro-batch comes after one that left its gradients unsynced
    poisoned.behav_logp[int(cuts[-1][0])] = float("nan")
    skipped = policy.step(poisoned, step=0)
    assert not skipped.updated and skipped.skipped == 1
    policy.step(batch, step=1)
    fresh = demo_policy(demo_dir, ["train.precision=bf16"])
    fresh.step(batch, step=1)
    for (name, p), q in zip(policy.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), name


@pytest.mark.slow  # two SmolLM2 learner steps, 1-3 minutes: the default suite stays under 10 minutes
def test_bucketed_and_packed_micro_batches_take_the_padded_step(gloo_one_rank, real_dir):
    """Length-bucketed and prompt-packed micro-batches on SmolLM2-135M: the same log-probs, loss, metrics and update
    as one padded micro-batch, with less padding."""
    from learner.policy_step import PLANNERS

    prompt = [30, 30, 40, 40, 200, 200, 210, 210]
    response = [12, 40, 25, 8, 150, 190, 170, 120]
    batch = random_batch(prompt, [p + r for p, r in zip(prompt, response)], [1.0, 0.0, 0.5, 0.0] * 2, 40000, 1)
    steps = {}
    for mode in ("padded", "bucketed", "packed"):
        cfg, policy = one_rank_policy(
            "smollm2-gsm-cpu.yaml",
            [
                f"model.path={real_dir / 'smollm2-135m-instruct'}",
                f"data.train_files=[{real_dir / 'gsm' / 'train.jsonl'}]",
                "train.precision=fp32",
                "train.lr=1e-4",
                f"train.micro_batches={mode}",
            ],
        )
        every = torch.arange(len(batch.rewards))
        cuts = PLANNERS[mode](every, batch, cfg.train.micro_batch_tokens)
        rows = {}
        with torch.no_grad():
            for cut in cuts:
                m = policy._micro(batch, torch.zeros(len(every)), cut)
                logp = policy._logprobs(policy.model, m)
                rows.update((r, logp[k][m.mask[k]]) for k, r in enumerate(cut.tolist()))
        result = policy.step(batch, step=0)
        steps[mode] = (cuts, rows, result.metrics, {k: v.full_tensor() for k, v in policy.model.state_dict().items()})
    padded = steps["padded"]
    assert len(padded[0]) == 1 and len(steps["bucketed"][0]) > 1
    forward_tokens = {mode: result[2]["actor/padded_tokens"] for mode, result in steps.items()}
    assert forward_tokens["packed"] < forward_tokens["bucketed"] < forward_tokens["padded"]
    for mode in ("bucketed", "packed"):
        for r in range(len(batch.rewards)):
            assert len(padded[1][r]) == int(batch.total_len[r] - batch.prompt_len[r])
            torch.testing.assert_close(steps[mode][1][r], padded[1][r], rtol=0, atol=2e-5)
        for key in ("loss/policy", "actor/grad_norm", "actor/tokens", "mismatch/kl_k3", "mismatch/rho_max"):
            assert steps[mode][2][key] == pytest.approx(padded[2][key], rel=1e-5, abs=1e-7), (mode, key)
        for name, value in padded[3].items():
            torch.testing.assert_close(steps[mode][3][name], value, rtol=1e-5, atol=1e-6, msg=(mode, name))
