"""qurl.quant.invariant_scaling: the model function is unchanged on Llama, Qwen2 and Qwen3."""

import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from qurl.quant import quantize_state_dict
from qurl.quant.invariant_scaling import apply_invariant_scaling, remove_invariant_scaling

ARCHS = {
    "qwen2": (Qwen2ForCausalLM, Qwen2Config),  # q/k/v biases by default
    "llama": (LlamaForCausalLM, LlamaConfig),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config),  # per-head q_norm / k_norm after q/k proj
}
TARGET_SETS = [("qkv",), ("qkv", "mlp")]


def _tiny(arch: str) -> torch.nn.Module:
    cls, cfg = ARCHS[arch]
    torch.manual_seed(0)
    config = cfg(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    model = cls(config).eval()
    with torch.no_grad():  # HF inits gains to 1 and biases to 0: make them matter
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("targets", TARGET_SETS)
def test_function_invariance(arch, targets):
    model = _tiny(arch)
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    if arch == "qwen3":
        assert hasattr(model.model.layers[0].self_attn, "q_norm")
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    s = 1.5
    assert apply_invariant_scaling(model, s, targets) is model
    after = _logits(model, ids)
    assert ((after - before).abs().max() / before.abs().max()).item() <= 1e-5

    scaled_norms = {"input_layernorm"} | ({"post_attention_layernorm"} if "mlp" in targets else set())
    scaled_projs = {"q_proj", "k_proj", "v_proj"} | ({"gate_proj", "up_proj"} if "mlp" in targets else set())
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[-1] == "weight" and parts[-2] in scaled_norms:
            torch.testing.assert_close(p, params[name] * s, rtol=0, atol=0)
        elif parts[-1] == "weight" and parts[-2] in scaled_projs:
            torch.testing.assert_close(p, params[name] / s, rtol=0, atol=0)
        else:  # biases, o/down proj, q/k norms, embeddings, final norm
            assert torch.equal(p, params[name]), name

    remove_invariant_scaling(model, s, targets)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, params[name], rtol=2**-23, atol=0)


@pytest.mark.parametrize("s", [0.1, 8.0, 1000.0])
def test_invariance_holds_for_large_and_small_scales(s):
    model = _tiny("qwen3")
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(2))
    before = _logits(model, ids)
    after = _logits(apply_invariant_scaling(model, s, ("qkv", "mlp")), ids)
    assert ((after - before).abs().max() / before.abs().max()).item() <= 1e-5


def test_remove_is_exact_for_powers_of_two():
    model = _tiny("qwen2")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    remove_invariant_scaling(apply_invariant_scaling(model, 4.0, ("qkv", "mlp")), 4.0, ("qkv", "mlp"))
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())


def test_scaled_weights_quantize_to_the_same_codes():
    # the paper's observation: abs-max quantization is equivariant, so the rollout function is unchanged too
    model = _tiny("qwen2")
    plain = quantize_state_dict(dict(model.state_dict()), "int8")
    scaled = quantize_state_dict(dict(apply_invariant_scaling(model, 2.0).state_dict()), "int8")
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.1.self_attn.{proj}.weight"
        assert torch.equal(plain[name], scaled[name])
        assert torch.equal(scaled[name + "_scale"], plain[name + "_scale"] / 2)


@pytest.mark.parametrize(
    "s, targets, message",
    [
        (0.0, ("qkv",), "s must be"),
        (-1.5, ("qkv",), "s must be"),
        (float("nan"), ("qkv",), "s must be"),
        (float("inf"), ("qkv",), "s must be"),
        (True, ("qkv",), "s must be"),
        (1.5, "qkv", "string"),
        (1.5, ("attn",), "targets"),
        (1.5, (), "targets"),
        (1.5, ("qkv", "qkv"), "targets"),
    ],
)
def test_bad_arguments(s, targets, message):
    model = _tiny("llama")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        apply_invariant_scaling(model, s, targets)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())  # nothing half-applied


def test_unsupported_models():
    gemma_like = torch.nn.Module()
    gemma_like.config = types.SimpleNamespace(model_type="gemma")  # its RMSNorm scales by (1 + gain)
    with pytest.raises(ValueError, match="model types"):
        apply_invariant_scaling(gemma_like, 1.5)
    with pytest.raises(ValueError, match="model types"):
        apply_invariant_scaling(torch.nn.Linear(2, 2), 1.5)


def test_targets_accept_lists():
    model = _tiny("llama")
    gain = model.model.layers[0].post_attention_layernorm.weight.detach().clone()
    apply_invariant_scaling(model, 2.0, ["mlp", "qkv"])
    assert torch.equal(model.model.layers[0].post_attention_layernorm.weight, gain * 2)
