"""learner/linear.py: the laid-out weight gradient against torch's linear backward, values and gradients."""

from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from learner import linear
from qurl import cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.kernels() is not None, "the CPU kernels did not build: see the warning above"


def backward(fn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dy: torch.Tensor) -> tuple:
    """fn(x, w, b), then d x, d w and d b for upstream gradient dy."""
    x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    b = None if b is None else b.detach().clone().requires_grad_(True)
    y = fn(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("bias", [False, True])
def test_a_wide_bf16_linear_has_torchs_values_and_its_weight_gradient_as_close(bias):
    torch.manual_seed(0)
    x = torch.randn(2, 300, 1024).to(torch.bfloat16)
    w = (torch.randn(96, 1024) / 32).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16) if bias else None
    dy = torch.randn(2, 300, 96).to(torch.bfloat16)
    got, want = backward(linear.linear, x, w, b, dy), backward(F.linear, x, w, b, dy)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # forward and d x: the same products
    exact = dy.double().reshape(-1, 96).t() @ x.double().reshape(-1, 1024)
    err, ref = ((g.double() - exact).abs().max().item() for g in (got[2], want[2]))
    assert got[2].is_contiguous() and err <= 1.5 * ref, (err, ref)  # dW: another order of the same sums
    if bias:
        torch.testing.assert_close(got[3], want[3])


def test_weight_grad_transposes_dy_only_where_it_pays(monkeypatch):
    calls = []
    kernels = cpu_kernels.kernels()
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: calls.append(1) or kernels)
    narrow, wide = linear.WIDE - 1, linear.WIDE
    for out, x, laid in (
        (32, torch.randn(64, wide).to(torch.bfloat16), True),  # a wide input
        (wide, torch.randn(64, 32).to(torch.bfloat16), True),  # a wide output (gate/up, the log-prob head)
        (narrow, torch.randn(64, narrow).to(torch.bfloat16), False),  # both narrow: the transpose would not pay
        (32, torch.randn(64, wide), False),  # fp32
    ):
        calls.clear()
        g = torch.randn(64, out).to(x.dtype)
        torch.testing.assert_close(linear.weight_grad(g, x).float(), (g.t() @ x).float(), rtol=1e-2, atol=1e-2)
        assert bool(calls) == laid
    cols = torch.randn(32, 64).to(torch.bfloat16).t()  # dy whose rows are not contiguous: torch's product
    calls.clear()
    x = torch.randn(64, linear.WIDE).to(torch.bfloat16)
    assert torch.equal(linear.weight_grad(cols, x), cols.t() @ x)


def test_linear_leaves_what_gets_no_gradient_to_f_linear(monkeypatch):
    applied = []
    monkeypatch.setattr(linear._Linear, "apply", lambda *a: applied.append(1) or F.linear(*a))
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    linear.linear(x.to(torch.bfloat16), w.to(torch.bfloat16))  # no gradient wanted
    linear.linear(x, w.requires_grad_())  # fp32
    with torch.no_grad():
        linear.linear(x.to(torch.bfloat16), w.to(torch.bfloat16).requires_grad_())
    assert not applied
    linear.linear(x.to(torch.bfloat16), w.to(torch.bfloat16).requires_grad_())
    assert applied == [1]


def test_install_swaps_every_linear_and_the_model_trains_alike(monkeypatch):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=1024,
        intermediate_size=1536,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    mine = deepcopy(model)
    assert linear.install(mine) == sum(type(m) is nn.Linear for m in model.modules())
    ids = torch.randint(0, 64, (2, 24))
    model(ids, labels=ids).loss.backward()
    laid = []
    weight_grad = linear.weight_grad
    monkeypatch.setattr(linear, "weight_grad", lambda dy, x: laid.append(x.shape[-1]) or weight_grad(dy, x))
    mine(ids, labels=ids).loss.backward()
    assert sorted(laid) == [1024] * 7 + [1536]  # q, k, v, o, gate, up and the head; down
    for (name, p), q in zip(model.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q.grad.float(), p.grad.float(), rtol=0.05, atol=2e-3, msg=name)
