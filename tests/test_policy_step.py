"""The policy step alone: the demo model on a one-rank gloo group, no sockets, no run folder, a hand-built batch.

Its update must equal the same step written out by hand on a plain (unsharded) copy of the model: one mini-batch,
the forward's own logprobs as the proximal policy, policy_loss, gradient clipping, one AdamW step.
"""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch

from learner.buffer import Batch

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


def hand_built_batch() -> Batch:
    """Four groups of two samples with different prompt and response lengths, right padded to 20 tokens."""
    g = torch.Generator().manual_seed(0)
    n, length = 8, 20
    prompt_len = torch.tensor([6, 6, 7, 7, 5, 5, 6, 6])
    total_len = torch.tensor([12, 20, 15, 9, 18, 11, 20, 13])
    behav = torch.zeros(n, length)
    for i in range(n):
        behav[i, prompt_len[i] : total_len[i]] = -torch.rand(int(total_len[i] - prompt_len[i]), generator=g) * 3
    return Batch(
        torch.randint(3, 200, (n, length), generator=g),
        prompt_len,
        total_len,
        behav,
        torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]),
        torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]),
    )


def test_one_policy_step_equals_the_step_written_out_by_hand(gloo_one_rank, demo_dir):
    from learner.model import build_policy, load_hf, token_logprobs
    from learner.policy_step import DistEnv, PolicyStep
    from qurl.algorithms import LossSpec, group_advantages, policy_loss
    from qurl.config import load_config

    cfg = load_config(
        os.path.join(ROOT, "configs/demo-cpu.yaml"),
        [
            f"model.path={os.path.join(demo_dir, 'model')}",
            f"data.train_files=[{os.path.join(demo_dir, 'train.jsonl')}]",
            "data.eval_files=[]",
            "algo.kl_coef=0",
            "train.mini_batches=1",
            "train.lr=1e-3",
            "rollout.sampling.max_new_tokens=14",
        ],
    )
    torch.manual_seed(0)
    policy = PolicyStep(
        build_policy(cfg, torch.device("cpu")),
        None,
        cfg.train,
        cfg.algo,
        cfg.rollout.sampling,
        DistEnv(0, 1, 0, torch.device("cpu")),
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
    logp = token_logprobs(plain, batch.input_ids[:, :end], start, cfg.rollout.sampling.temperature)
    spec = LossSpec(
        mode=cfg.algo.loss,
        eps_low=cfg.algo.eps_low,
        eps_high=cfg.algo.eps_high,
        tis_cap=cfg.algo.tis_cap,
        agg=cfg.algo.loss_agg,
        dual_clip=cfg.algo.dual_clip,
    )
    loss, metrics = policy_loss(logp, logp.detach(), batch.behav_logp[:, start:end], advantages, mask, spec)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.train.grad_clip).item()
    lr = cfg.train.lr / cfg.train.warmup_steps if cfg.train.warmup_steps else cfg.train.lr
    torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=cfg.train.weight_decay).step()

    assert m["lr"] == pytest.approx(lr, rel=1e-12)
    assert m["loss/policy"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert m["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    for key in ("mismatch/kl_k3", "mismatch/rho_max", "actor/clipfrac"):
        assert m[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    for name, value in plain.state_dict().items():
        if name in after:
            torch.testing.assert_close(after[name], value, rtol=1e-5, atol=1e-6, msg=name)
