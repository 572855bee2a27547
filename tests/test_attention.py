"""learner/attention.py: the compiled attention, forward and backward, against fp64, against torch's own flash
attention, and inside a model (transformers' SDPA attention elsewhere)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from learner import attention
from learner.packing import ATTENTION

pytestmark = pytest.mark.skipif(not attention.ready(), reason="no oneDNN bf16 brgemm on this CPU (AVX2): torch's own")


def qkv(b: int, h: int, hk: int, length: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 q, k, v and an upstream gradient as transformers hands them: [B, H, L, D] views of [B, L, H, D]."""
    g = torch.Generator().manual_seed(seed)

    def one(heads: int) -> torch.Tensor:
        return torch.randn(b, length, heads, d, generator=g).to(torch.bfloat16).transpose(1, 2)

    return one(h), one(hk), one(hk), one(h)


def packed_mask(b: int, length: int, prompt: int, seed: int = 0) -> torch.Tensor:
    """A packed row's mask (learner/packing.py's shape): a prompt, then answers that see it and themselves only."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, 1, length, length, dtype=torch.bool)
    for row in range(b):
        mask[row, 0, :prompt, :prompt] = torch.ones(prompt, prompt, dtype=torch.bool).tril()
        cuts = [prompt, *sorted(torch.randint(prompt + 1, length, (3,), generator=g).tolist()), length]
        for start, end in zip(cuts[:-1], cuts[1:]):
            mask[row, 0, start:end, :prompt] = True
            mask[row, 0, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    return mask


def exact_grads(q, k, v, dout, mask):
    """dq, dk, dv in fp64 by the math path."""
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q64, k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1), attn_mask=mask, is_causal=mask is None
    )
    out.backward(dout.double())
    return q64.grad, k64.grad, v64.grad


def exact_forward(q, k, v, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """out and logsumexp of the scaled scores in fp64."""
    group = q.shape[1] // k.shape[1]
    k64, v64 = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q.double() @ k64.transpose(-1, -2) * q.shape[-1] ** -0.5
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool).tril() if mask is None else mask
    scores = scores.masked_fill(~allowed, -torch.inf)
    return scores.softmax(-1) @ v64, scores.logsumexp(-1)


def flash(q, k, v, mask) -> tuple[torch.Tensor, ...]:
    """torch's CPU flash forward in bf16: out, logsumexp, and the repeated k, v and additive mask it took."""
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    # its mask: additive, in the query's dtype (0 where attended, -inf elsewhere)
    additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, -torch.inf)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, kr, vr, 0.0, mask is None, attn_mask=additive
    )[:2]
    return out, lse, kr, vr, additive


def flash_grads(q, k, v, dout, mask):
    """dq, dk, dv by torch's CPU flash backward in bf16 (dk, dv summed over each kv head's group)."""
    group = q.shape[1] // k.shape[1]
    out, lse, kr, vr, additive = flash(q, k, v, mask)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, kr, vr, out, lse, 0.0, mask is None, attn_mask=additive
    )
    return dq, dk.unflatten(1, (k.shape[1], group)).sum(2), dv.unflatten(1, (k.shape[1], group)).sum(2)


def relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).norm() / exact.norm()).item()


SHAPES = [
    (2, 4, 2, 130, 64, False),  # a partial last block, grouped kv heads
    (1, 9, 3, 463, 64, False),  # SmolLM2's heads at the GSM-shaped row length
    (2, 4, 4, 70, 128, False),  # Qwen2.5's head_dim: dq's B packed in two 64-column halves
    (2, 6, 2, 190, 32, True),  # a packed mask: blocks with no pair attended are skipped
    (1, 4, 1, 257, 128, True),
]


@pytest.mark.parametrize("b, h, hk, length, d, masked", SHAPES)
def test_forward_matches_fp64_as_closely_as_torchs_flash(b, h, hk, length, d, masked):
    q, k, v, _ = qkv(b, h, hk, length, d, seed=1)
    mask = packed_mask(b, length, prompt=40) if masked else None
    out, lse = attention.cpu_kernels.kernels().attention_forward(q, k, v, mask is None, mask, d**-0.5)
    exact_out, exact_lse = exact_forward(q, k, v, mask)
    theirs, their_lse = flash(q, k, v, mask)[:2]
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.transpose(1, 2).is_contiguous()  # [B, L, H, D] memory: what the output projection reads
    # the output's bf16 rounding dominates (~2e-3), P's rounding to bf16 before P v next
    assert relative(out, exact_out) <= 1.05 * relative(theirs, exact_out) + 1e-4, relative(out, exact_out)
    assert (lse.double() - exact_lse).abs().max() < 1e-3
    assert (their_lse.double() - exact_lse).abs().max() < 1e-3  # the same quantity as torch's, as the backward takes


def test_forward_rejects_what_it_does_not_compute():
    q, k, v, _ = qkv(1, 4, 2, 64, 64)
    kernels = attention.cpu_kernels.kernels()
    with pytest.raises(RuntimeError, match="attention_forward: bf16"):
        kernels.attention_forward(q.float(), k, v, True, None, 0.125)
    with pytest.raises(RuntimeError, match="as many keys as queries"):
        kernels.attention_forward(q, k[:, :, :32], v[:, :, :32], True, None, 0.125)
    with pytest.raises(RuntimeError, match="a boolean mask"):
        kernels.attention_forward(q, k, v, False, torch.zeros(1, 1, 64, 64), 0.125)


@pytest.mark.parametrize("b, h, hk, length, d, masked", SHAPES)
def test_gradients_match_fp64_as_closely_as_torchs_flash(b, h, hk, length, d, masked):
    q, k, v, dout = qkv(b, h, hk, length, d)
    mask = packed_mask(b, length, prompt=40) if masked else None
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention._Attention.apply(q, k, v, mask, d**-0.5)
    got = torch.autograd.grad(out, (q, k, v), dout)
    exact = exact_grads(q.detach(), k.detach(), v.detach(), dout, mask)
    flash = flash_grads(q.detach(), k.detach(), v.detach(), dout, mask)
    for name, mine, theirs, e in zip("qkv", got, flash, exact):
        assert mine.shape == e.shape and mine.dtype == torch.bfloat16
        assert mine.stride() == (q if name == "q" else k).stride()  # the inputs' own layout, no copy downstream
        # bf16 rounding of each product's inputs: ~2.5e-3; torch's sums dk, dv in bf16 over the group, we in fp32
        assert relative(mine, e) <= 1.05 * relative(theirs, e) + 1e-4, (name, relative(mine, e), relative(theirs, e))
        assert relative(mine, e) < 4e-3, name


def test_a_row_that_attends_to_nothing_gets_zeros_no_gradient_and_no_nan():
    q, k, v, dout = qkv(1, 2, 2, 70, 64, seed=3)
    mask = torch.ones(70, 70, dtype=torch.bool).tril().expand(1, 1, 70, 70).clone()
    mask[..., 5:9, :] = False  # as a packed row's padding
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention._Attention.apply(q, k, v, mask, 0.125)
    assert (out[:, :, 5:9] == 0).all() and torch.isfinite(out).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert (dq[:, :, 5:9] == 0).all()


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def counted(monkeypatch) -> list:
    """A list that gets one entry per call of the compiled path (each layer's attention)."""
    calls, apply = [], attention._Attention.apply
    monkeypatch.setattr(attention._Attention, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


def model_grads(model, ids, **inputs):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, **inputs).logits
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_a_models_logits_and_gradients_match_sdpa(monkeypatch):
    """Logits and every parameter's gradient within bf16's rounding of SDPA's."""
    ids = torch.randint(0, 101, (3, 200), generator=torch.Generator().manual_seed(1))
    reference, mine = tiny_llama(), tiny_llama()
    assert attention.install(mine) and mine.config._attn_implementation == attention.NAME
    assert not attention.install(mine)  # once only: it switches a model on sdpa
    want_logits, want = model_grads(reference, ids)
    calls = counted(monkeypatch)
    got_logits, got = model_grads(mine, ids)
    assert len(calls) == 2  # each layer's attention went through the compiled path
    torch.testing.assert_close(got_logits, want_logits, rtol=0.02, atol=0.02)
    for name, g in got.items():
        torch.testing.assert_close(g.float(), want[name].float(), rtol=0.05, atol=2e-3, msg=name)


def test_calls_it_does_not_cover_go_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(attention._Attention, "apply", lambda *a: calls.append(a) or None)
    model = tiny_llama()
    attention.install(model)
    ids = torch.randint(0, 101, (2, 64))
    with torch.no_grad():
        model(input_ids=ids)  # no gradient
    with sdpa_kernel(SDPBackend.MATH):
        model(input_ids=ids)  # learner/logprobs.py's short rows
    model.float()(input_ids=ids)  # fp32
    assert calls == []
    additive = torch.zeros(2, 1, 64, 64)
    assert not attention.covers(
        torch.zeros(2, 4, 64, 32, dtype=torch.bfloat16, requires_grad=True),
        torch.zeros(2, 2, 64, 32, dtype=torch.bfloat16),
        additive,
        False,
        0.0,
    )


def test_packed_rows_train_through_it(monkeypatch):
    """learner/packing.py's boolean 4D mask reaches the compiled attention, same gradients as SDPA's."""
    assert attention.NAME in ATTENTION
    ids = torch.randint(0, 101, (2, 150), generator=torch.Generator().manual_seed(2))
    mask = packed_mask(2, 150, prompt=30, seed=2)
    positions = torch.arange(150).expand(2, 150)
    reference, mine = tiny_llama(), tiny_llama()
    attention.install(mine)
    want_logits, want = model_grads(reference, ids, attention_mask=mask, position_ids=positions)
    calls = counted(monkeypatch)
    got_logits, got = model_grads(mine, ids, attention_mask=mask, position_ids=positions)
    assert len(calls) == 2
    torch.testing.assert_close(got_logits, want_logits, rtol=0.02, atol=0.02)
    for name, g in got.items():
        torch.testing.assert_close(g.float(), want[name].float(), rtol=0.05, atol=2e-3, msg=name)


def test_install_leaves_other_models_alone():
    model = tiny_llama()
    model.set_attn_implementation("eager")
    assert not attention.install(model)
    assert model.config._attn_implementation == "eager"


def test_short_rows_keep_the_compiled_attention(monkeypatch):
    """learner/logprobs.py sends rows under MATH_ATTENTION_BELOW positions to SDPA's math path, except on a model
    using the compiled attention: flash's forward and its backward were 2.3-3.6x faster than math from 64 positions
    up."""
    from learner.logprobs import MATH_ATTENTION_BELOW, token_logprobs

    model = tiny_llama()
    attention.install(model)
    calls = counted(monkeypatch)
    ids = torch.randint(0, 101, (2, MATH_ATTENTION_BELOW // 2))
    token_logprobs(model, ids, 1, 1.0).logp.float().sum().backward()
    assert len(calls) == 2
