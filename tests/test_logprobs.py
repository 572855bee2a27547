"""learner/logprobs.py: the chunked head gives the dense log-softmax's values and gradients, in memory that does not
grow with vocabulary x length."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from learner.logprobs import chunked_logprobs, token_logprobs


def tiny_lm(vocab: int, seed: int = 0, tied: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
        use_cache=False,
    )
    return Qwen2ForCausalLM(config).float()


def dense(model, ids: torch.Tensor, start: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-vocabulary reference: all logits at once, log_softmax, gather; and the entropy."""
    logits = model(input_ids=ids).logits[:, start - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    logs = torch.log_softmax(logits, dim=-1)
    return logs.gather(-1, ids[:, start:, None]).squeeze(-1), -(logs.exp() * logs).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_equals_the_dense_log_softmax_values_and_gradients(temperature, tied):
    vocab, start = 500, 5
    ids = torch.randint(0, vocab, (3, 23), generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(3, 23 - start, generator=torch.Generator().manual_seed(2))
    grads = {}
    for name in ("dense", "chunked"):
        model = tiny_lm(vocab, tied=tied)
        if name == "dense":
            logp, entropy = dense(model, ids, start, temperature)
        else:  # 7 positions of 500 logits per chunk: 9 chunks over 3 x 18 positions, the last one short
            out = token_logprobs(model, ids, start, temperature, entropy=True, chunk_elements=7 * vocab)
            logp, entropy = out.logp, out.entropy
        (logp * grad_out).sum().backward()
        grads[name] = (logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp_d, ent_d, g_d), (lp_c, ent_c, g_c) = grads["dense"], grads["chunked"]
    torch.testing.assert_close(lp_c, lp_d, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent_c, ent_d, rtol=1e-5, atol=1e-5)
    assert g_c.keys() == g_d.keys()
    for name in g_d:
        torch.testing.assert_close(g_c[name], g_d[name], rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_head_matches_the_dense_bf16_path():
    """Under FSDP2's bf16 mixed precision the head's matmul runs in bf16, then fp32: the chunks do the same."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 30, 64, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(1000, 64, generator=g) * 0.1).bfloat16().requires_grad_()
    targets = torch.randint(0, 1000, (4, 30), generator=g)
    upstream = torch.randn(4, 30, generator=g)
    logits = torch.nn.functional.linear(hidden, weight).float() / 0.9
    ref = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    (ref * upstream).sum().backward()
    ref_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    out = chunked_logprobs(hidden, weight, targets, 0.9, chunk_elements=8 * 1000)
    (out.logp * upstream).sum().backward()
    assert out.logp.dtype == torch.float32
    torch.testing.assert_close(out.logp, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_grads[0])
    # the head weight's gradient: 15 chunk products, each rounded to bf16 as the dense product is once, summed in fp32
    scale = ref_grads[1].abs().max().item()
    torch.testing.assert_close(weight.grad, ref_grads[1], rtol=2e-2, atol=2**-6 * scale)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns (forward and backward): the memory a computation cannot avoid."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_head_memory_does_not_grow_with_vocabulary_times_length():
    """The dense head returns [rows, positions, vocabulary] logits; the chunked one never holds more than a chunk's,
    so its largest tensor is the same at 4x the length: the head weight and its gradient."""
    vocab, hidden_size, chunk = 4096, 32, 1 << 14
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden_size, generator=g).requires_grad_()
    largest = {}
    for length in (256, 1024):
        hidden = torch.randn(2, length, hidden_size, generator=g).requires_grad_()
        targets = torch.randint(0, vocab, (2, length), generator=g)
        with LargestTensor() as probe:
            chunked_logprobs(hidden, weight, targets, 1.0, entropy=True, chunk_elements=chunk).logp.sum().backward()
        largest[length] = probe.largest
    assert largest[256] == largest[1024] == vocab * hidden_size
    with LargestTensor() as probe:  # what the old path held: every logit at once
        logits = torch.nn.functional.linear(hidden, weight).float()
        (logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)).sum().backward()
    assert probe.largest == 2 * 1024 * vocab


def test_the_learner_log_probs_never_hold_every_logit():
    """token_logprobs through a whole model: no tensor of [rows, positions, vocabulary] in forward or backward."""
    vocab, chunk = 8192, 1 << 14
    model = tiny_lm(vocab)
    ids = torch.randint(0, vocab, (2, 512), generator=torch.Generator().manual_seed(0))
    with LargestTensor() as probe:
        token_logprobs(model, ids, 1, 1.0, chunk_elements=chunk).logp.sum().backward()
    assert probe.largest <= vocab * 32 < 2 * 511 * vocab


def test_the_head_keeps_a_module_swaps_own_forward():
    """head_logprobs puts its forward on the lm_head for one call, then restores the forward the head had: a swapped
    one (learner/linear.py's) or the class's own."""
    from learner import linear

    model = tiny_lm(64)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    head = model.get_output_embeddings()
    token_logprobs(model, ids, 1, 1.0)
    assert "forward" not in head.__dict__
    linear.install(model)
    token_logprobs(model, ids, 1, 1.0)
    assert head.forward.__func__ is linear.linear_forward


def test_start_must_leave_a_prefix():
    with pytest.raises(ValueError, match="start >= 1"):
        token_logprobs(tiny_lm(50), torch.zeros(1, 4, dtype=torch.long), 0, 1.0)


@pytest.fixture(params=["kernels", "torch"])
def head_path(request, monkeypatch):
    """Both ways the head runs on CPU: the compiled kernels' head ops, and the torch chain they replace."""
    from learner import logprobs

    if request.param == "torch":
        monkeypatch.setattr(logprobs, "_kernels", lambda hidden: None)
    elif logprobs._kernels(torch.zeros(1)) is None:
        pytest.skip("the CPU kernels' head ops are not built here")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_each_head_path_equals_the_dense_one(head_path, dtype, temperature):
    """Values, entropy and gradients against log_softmax over all logits at once, in the matmul's dtype then fp32,
    with a vocabulary over the kernels' 1,024-wide block and not a multiple of their vector width."""
    g = torch.Generator().manual_seed(3)
    vocab = 2500
    hidden = torch.randn(37, 48, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, 48, generator=g) * 0.2).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (37,), generator=g)
    upstream = torch.randn(37, generator=g)
    logits = torch.nn.functional.linear(hidden, weight).float()
    logits = logits / temperature if temperature > 0 else logits
    logs = torch.log_softmax(logits, -1)
    ref, ref_entropy = logs.gather(-1, targets[:, None]).squeeze(-1), -(logs.exp() * logs).sum(-1)
    (ref * upstream).sum().backward()
    ref_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    out = chunked_logprobs(hidden, weight, targets, temperature, entropy=True, chunk_elements=10 * vocab)
    (out.logp * upstream).sum().backward()
    torch.testing.assert_close(out.logp, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref_entropy, rtol=1e-5, atol=1e-4)
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2**-6 * ref_grads[1].abs().max().item()}
    torch.testing.assert_close(hidden.grad, ref_grads[0], **tol)
    torch.testing.assert_close(weight.grad, ref_grads[1], **tol)


def test_only_the_kept_positions_reach_the_head(head_path):
    """keep: the kept positions' log-probs, entropy and gradients are the full head's; the others read 0 and take no
    gradient; a micro-batch with nothing kept (the padding micro-batch) gives zero gradients."""
    vocab, start = 300, 4
    ids = torch.randint(0, vocab, (3, 15), generator=torch.Generator().manual_seed(4))
    keep = torch.rand(3, 15 - start, generator=torch.Generator().manual_seed(5)) < 0.5
    results = {}
    for name, mask in (("full", None), ("kept", keep)):
        model = tiny_lm(vocab)
        out = token_logprobs(model, ids, start, 0.8, entropy=True, chunk_elements=5 * vocab, keep=mask)
        (out.logp * keep).sum().backward()
        results[name] = out, {n: p.grad.clone() for n, p in model.named_parameters()}
    (full, full_grads), (kept, kept_grads) = results["full"], results["kept"]
    torch.testing.assert_close(kept.logp[keep], full.logp[keep])
    torch.testing.assert_close(kept.entropy[keep], full.entropy[keep])
    assert not kept.logp[~keep].any() and not kept.entropy[~keep].any()
    for name in full_grads:
        torch.testing.assert_close(kept_grads[name], full_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    model = tiny_lm(vocab)
    none = torch.zeros(3, 15 - start, dtype=torch.bool)
    token_logprobs(model, ids, start, 1.0, keep=none).logp.sum().backward()
    assert all(not p.grad.any() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("length", [40, 200])
def test_short_rows_train_through_the_math_attention_with_the_same_values(length, monkeypatch):
    """Below MATH_ATTENTION_BELOW positions the forward and backward run SDPA's math path (no flash kernels); values
    and gradients equal torch's own choice of backend."""
    from torch.profiler import ProfilerActivity, profile

    from learner import logprobs

    ids = torch.randint(0, 300, (2, length), generator=torch.Generator().manual_seed(6))
    runs = {}
    rule = logprobs.MATH_ATTENTION_BELOW
    for name, below in (("rule", rule), ("torch", 0)):
        monkeypatch.setattr(logprobs, "MATH_ATTENTION_BELOW", below)
        model = tiny_lm(300)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            token_logprobs(model, ids, 1, 1.0).logp.sum().backward()
        flash = any("flash_attention" in e.key for e in prof.key_averages())
        runs[name] = flash, {n: p.grad.clone() for n, p in model.named_parameters()}
    assert runs["rule"][0] == (length >= rule) and runs["torch"][0]
    for name, grad in runs["torch"][1].items():
        torch.testing.assert_close(runs["rule"][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
