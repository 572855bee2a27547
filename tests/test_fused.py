"""learner/fused.py: the fused RMSNorm, SwiGLU and rotary embedding against transformers' own modules, values and
gradients."""

from copy import deepcopy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from learner import fused
from learner.model import load_hf
from qurl import cpu_kernels

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.kernels() is not None, "the CPU kernels did not build: see the warning above"


def grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The module's output, d x and each parameter's gradient for upstream gradient dy."""
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(dy)
    return (y.detach(), x.grad, *(p.grad for p in module.parameters()))


def swapped(module: nn.Module) -> nn.Module:
    """A copy of module with the fused forward; the original keeps transformers' own."""
    copy = deepcopy(module)
    assert fused.fuse(copy) == 1
    return copy


def assert_no_further(got: torch.Tensor, torch_op: torch.Tensor, exact: torch.Tensor, factor: float = 1.5) -> None:
    """got is as close to the fp64 result as the torch chain in the same dtype is, within factor (or two ulps)."""
    err = (got.double() - exact).abs().max().item()
    ref = (torch_op.double() - exact).abs().max().item()
    assert err <= factor * ref + 2 * torch.finfo(got.dtype).eps * exact.abs().max().item(), (err, ref)


@pytest.mark.parametrize("width", [576, 100])  # 100: the vector loops' scalar tails
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_forward_is_transformers_and_its_gradients_as_close(dtype, width):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width) * 0.5 + 1)
    norm = norm.to(dtype)
    x = (torch.randn(3, 37, width) * 3).to(dtype)
    dy = torch.randn(3, 37, width).to(dtype)
    mine = swapped(norm)
    assert mine.forward.__func__ is fused.rms_norm_forward
    got, want = grads(mine, x, dy), grads(norm, x, dy)
    exact = grads(deepcopy(norm).double(), x.double(), dy.double())
    if dtype == torch.bfloat16:
        assert torch.equal(got[0], want[0])  # the forward bit for bit
    else:
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    for g, w, e in zip(got[1:], want[1:], exact[1:]):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_no_further(g, w, e)
    if dtype == torch.float32:
        for g, w in zip(got[1:], want[1:]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_mlp_equals_transformers_values_and_gradients(dtype):
    torch.manual_seed(1)
    cfg = LlamaConfig(hidden_size=96, intermediate_size=264, hidden_act="silu")
    mlp = LlamaMLP(cfg).to(dtype)
    x = torch.randn(2, 19, 96).to(dtype)
    dy = torch.randn(2, 19, 96).to(dtype)
    mine = swapped(mlp)
    assert mine.forward.__func__ is fused.swiglu_forward
    got, want = grads(mine, x, dy), grads(mlp, x, dy)
    exact = grads(deepcopy(mlp).double(), x.double(), dy.double())
    for g, w, e in zip(got, want, exact):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_no_further(g, w, e)
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_fuse_swaps_only_the_registered_formulas():
    torch.manual_seed(2)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
    )
    model = LlamaForCausalLM(cfg)
    reference = LlamaForCausalLM(cfg)
    reference.load_state_dict(model.state_dict())
    assert fused.fuse(model) == 2 * 4 + 1  # two norms, an attention and an MLP per layer, and the final norm
    biased = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, mlp_bias=True))
    assert fused.fuse(biased) == 0  # a biased MLP is not the formula
    gelu = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, hidden_act="gelu"))
    assert fused.fuse(gelu) == 0

    class OtherRMSNorm(LlamaRMSNorm):  # an unregistered class, e.g. Gemma's (1 + w) norm, keeps its forward
        pass

    assert fused.fuse(OtherRMSNorm(8)) == 0
    ids = torch.randint(0, 97, (3, 11))
    got, want = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().mean().backward()
    want.square().mean().backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_fuse_leaves_a_model_alone_without_the_kernels(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    model = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2))
    assert fused.fuse(model) == 0 and "forward" not in model.__dict__


def test_the_learners_model_keeps_the_fused_forwards_through_train_and_eval(tmp_path):
    """transformers kernelizes at every train() / eval() where the `kernels` package is installed, which put each
    module's own forward back; load_hf turns that off."""
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=97)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = load_hf(str(tmp_path), torch.device("cpu"))
    assert fused.fuse(model) == 2 + 1 + 1 + 1
    model.eval()
    model.train()
    swapped_now = [m for m in model.modules() if "forward" in m.__dict__]
    assert len(swapped_now) == 5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_cos, head_dim", [(True, 64), (False, 128), (True, 40)])  # 40: a scalar tail
def test_rotary_equals_transformers_values_and_gradients_bit_for_bit(dtype, batch_cos, head_dim):
    """The kernel rounds each product and the sum as torch's chain does, so both directions are exact."""
    g = torch.Generator().manual_seed(head_dim)
    b, length, heads = 3, 37, 5
    x = torch.randn(b, length, heads, head_dim, generator=g).to(dtype)
    angles = torch.randn(b if batch_cos else 1, length, head_dim // 2, generator=g).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    mine = x.clone().requires_grad_()
    got = fused._Rotary.apply(mine, cos, sin)
    got.backward(dy)
    theirs = x.clone().transpose(1, 2).requires_grad_()  # HF's [B, heads, L, D] view of the projection's rows
    want = apply_rotary_pos_emb(theirs, theirs, cos, sin)[0]
    want.backward(dy.transpose(1, 2))
    assert torch.equal(got, want.transpose(1, 2))
    assert torch.equal(mine.grad, theirs.grad.transpose(1, 2))


@pytest.mark.parametrize("grad", [False, True])
def test_rotary_reads_q_and_k_inside_one_fused_projection(grad):
    """q and k as views of one [B, L, q | k | v] projection (a token's rows 2x and 4x their own width apart): the same
    rows as their contiguous copies give, in a contiguous output."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 9, (4 + 2 + 2) * 16, generator=g).to(torch.bfloat16)
    cos, sin = (t.to(torch.bfloat16) for t in torch.randn(2, 1, 9, 16, generator=g))
    for part in qkv.split([64, 32, 32], dim=-1)[:2]:
        view = part.view(2, 9, -1, 16)
        got = cpu_kernels.kernels().rotary(view, cos, sin, grad)
        assert got.is_contiguous()
        assert torch.equal(got, cpu_kernels.kernels().rotary(view.contiguous(), cos, sin, grad))


def test_rotary_rejects_what_it_does_not_compute():
    x, cos = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 8)
    with pytest.raises(RuntimeError, match="rotary: x an fp32 or bf16"):
        cpu_kernels.kernels().rotary(x.half(), cos.half(), cos.half(), False)
    with pytest.raises(RuntimeError, match="each token's heads contiguous"):
        cpu_kernels.kernels().rotary(x.transpose(1, 2), cos[:, :3], cos[:, :3], False)
    with pytest.raises(RuntimeError, match="rotary: cos and sin contiguous"):
        cpu_kernels.kernels().rotary(x, cos[:, :4], cos[:, :4], False)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_swapped_attention_equals_transformers_logits_and_gradients(family):
    """Llama's and Qwen2's (biased q, k, v) attention forward with q, k and v in one GEMM and the kernel's rotary: the
    same logits exactly, and gradients no further from fp64's than transformers' own."""
    torch.manual_seed(3)
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config, cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    model = cls(config(vocab_size=97, attn_implementation="sdpa", **kw)).to(torch.bfloat16)
    reference = deepcopy(model)
    exact = deepcopy(model).double()
    attentions = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    assert len(attentions) == 2 and all(fused.fuse(m) == 1 for m in attentions)
    rotated = []
    apply = fused._Rotary.apply
    fused._Rotary.apply = lambda *a: rotated.append(1) or apply(*a)
    try:
        ids = torch.randint(0, 97, (3, 70))
        got, want = model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits  # as the learner runs
    finally:
        fused._Rotary.apply = apply
    assert len(rotated) == 4  # q and k of each layer
    assert torch.equal(got, want)
    got.float().square().mean().backward()
    want.float().square().mean().backward()
    exact(ids, use_cache=False).logits.square().mean().backward()
    # one GEMM's input gradient for q, k and v rounds once where transformers' three round and are summed
    for (name, a), b, e in zip(model.named_parameters(), reference.parameters(), exact.parameters()):
        assert_no_further(a.grad, b.grad, e.grad)
    with torch.no_grad():  # generation with a cache keeps transformers' own forward
        out = model.generate(ids[:1, :8], max_new_tokens=3, do_sample=False)
        assert torch.equal(out, reference.generate(ids[:1, :8], max_new_tokens=3, do_sample=False))
