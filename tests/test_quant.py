"""qurl.quant: int8 / fp8 round trips and error bounds, scale layouts, equivariance, state dicts."""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qurl.quant import (
    CODE_DTYPES,
    SCALE_SUFFIXES,
    SCHEMES,
    changed_fraction,
    changed_indices,
    dequantize_fp8,
    dequantize_int8,
    dequantize_state_dict,
    is_quantized_linear,
    lookup,
    quantize_fp8,
    quantize_int8,
    quantize_state_dict,
    scheme_for,
)

FP8 = torch.float8_e4m3fn


def _weight(n, k, seed=0, std=0.02):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * std


def _fp32_slack(x):
    # x / scale and codes * scale are each rounded in fp32
    return x.abs() * 2**-21


def _int8_error_bound(x, scale):
    return scale / 2 + _fp32_slack(x)


def _fp8_error_bound(x, scale_per_element):
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative for normals; subnormal step 2^-9 -> 2^-10 absolute
    return torch.maximum(x.abs() * 2**-4, scale_per_element * 2**-10) + _fp32_slack(x)


def test_int8_weight_round_trip_and_layout():
    w = _weight(64, 96)
    codes, scale = quantize_int8(w)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert codes.shape == (64, 96) and scale.shape == (64, 1)
    torch.testing.assert_close(scale, w.abs().amax(-1, keepdim=True) / 127, rtol=0, atol=0)
    assert (codes.abs().amax(-1) == 127).all()  # every row's abs-max lands on the end of the grid
    assert (dequantize_int8(codes, scale) - w).abs().le(_int8_error_bound(w, scale)).all()


def test_int8_per_token_activations_and_other_dims():
    x = _weight(5, 32, std=3.0)
    _, per_token = quantize_int8(x, dim=-1)
    _, per_column = quantize_int8(x, dim=0)
    assert per_token.shape == (5, 1) and per_column.shape == (1, 32)


def test_int8_zero_rows_and_bf16_input():
    w = _weight(4, 8)
    w[2] = 0
    codes, scale = quantize_int8(w)
    assert (codes[2] == 0).all() and scale[2].item() == 1.0 and torch.isfinite(scale).all()
    b = w.bfloat16()
    for got, want in zip(quantize_int8(b), quantize_int8(b.float())):
        assert torch.equal(got, want)  # computed in fp32 whatever the input dtype


@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (128, 128), (200, 300), (256, 130), (3, 1000)])
def test_fp8_block_scale_shapes_and_values(shape):
    n, k = shape
    w = _weight(n, k, seed=n + k)
    codes, scale = quantize_fp8(w, "block")
    assert codes.dtype == FP8 and codes.shape == shape
    assert scale.dtype == torch.float32 and scale.shape == (math.ceil(n / 128), math.ceil(k / 128))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert scale[i, j].item() == (tile.abs().amax() / 448).item()
            assert codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs().max().item() == 448.0
    deq = dequantize_fp8(codes, scale)
    per_element = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    assert (deq - w).abs().le(_fp8_error_bound(w, per_element)).all()


def test_fp8_tensor_and_channel_round_trip():
    w = _weight(48, 80, seed=3)
    w[5] = 0
    for granularity, scale_shape in (("tensor", ()), ("channel", (48, 1))):
        codes, scale = quantize_fp8(w, granularity)
        assert codes.dtype == FP8 and scale.shape == scale_shape
        deq = dequantize_fp8(codes, scale)
        assert torch.isfinite(deq).all() and (deq[5] == 0).all()
        assert (deq - w).abs().le(_fp8_error_bound(w, scale.expand_as(w))).all()
    assert quantize_fp8(w, "channel")[1][5].item() == 1.0  # an all-zero channel gets scale 1


def test_fp8_bad_arguments():
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(_weight(4, 4), "row")
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.ones(2, 3, 4), "block")
    codes, _ = quantize_fp8(_weight(300, 300), "block")
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8(codes, torch.ones(2, 2))


@pytest.mark.parametrize("s", [2.0, 0.5, 4.0])
def test_equivariance_exact_for_powers_of_two(s):
    w = _weight(256, 320, seed=1)
    for quantize in (quantize_int8, lambda x: quantize_fp8(x, "block"), lambda x: quantize_fp8(x, "channel")):
        codes, scale = quantize(w)
        codes_s, scale_s = quantize(w / s)
        assert changed_fraction(codes, codes_s) == 0.0
        assert torch.equal(scale_s, scale / s)


@pytest.mark.parametrize("s", [1.5, 1.25, 3.0])
def test_equivariance_up_to_rounding_for_other_scales(s):
    # Q(W/s) = Q(W)/s holds in exact arithmetic; in fp32 the scale differs by <= 2 ulp and a code
    # flips to its neighbour only where x/scale sits within rounding of a grid midpoint (~1e-6 of codes)
    w = _weight(512, 512, seed=2)
    for name, quantize in (("int8", quantize_int8), ("fp8-block", lambda x: quantize_fp8(x, "block"))):
        codes, scale = quantize(w)
        codes_s, scale_s = quantize(w / s)
        assert ((scale_s - scale / s).abs() / (scale / s)).max().item() <= 2.5e-7, name
        assert changed_fraction(codes, codes_s) <= 1e-4, name
        step = (codes.view(torch.uint8) if name != "int8" else codes).int()
        step_s = (codes_s.view(torch.uint8) if name != "int8" else codes_s).int()
        assert (step - step_s).abs().max().item() <= 1, name  # e4m3 bit patterns are monotone per sign


LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"] + [
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def _state_dict():
    sd = {"model.embed_tokens.weight": _weight(50, 32), "lm_head.weight": _weight(50, 32)}
    sd["model.norm.weight"] = torch.ones(32)
    for i in range(2):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(32)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(32)
        for j, name in enumerate(LINEARS):
            n, k = (160 if "gate" in name or "up" in name else 32), (160 if "down" in name else 32)
            sd[p + name + ".weight"] = _weight(n, k, seed=10 * i + j)
        for name in LINEARS[:3]:
            sd[p + name + ".bias"] = _weight(32, 1, seed=99)[:, 0]
    return sd


@pytest.mark.parametrize(
    "scheme, codes_dtype, scale_suffix",
    [("int8", torch.int8, "_scale"), ("fp8-channel", FP8, "_scale"), ("fp8-block", FP8, "_scale_inv")],
)
def test_quantize_state_dict_layout_and_round_trip(scheme, codes_dtype, scale_suffix):
    sd = _state_dict()
    q = quantize_state_dict(sd, scheme)
    quantized = [n for n in sd if is_quantized_linear(n)]
    assert len(quantized) == 14
    assert set(q) == set(sd) | {n + scale_suffix for n in quantized}
    for name, tensor in sd.items():
        if name in quantized:
            n, k = tensor.shape
            assert q[name].dtype == codes_dtype and q[name].shape == (n, k)
            expected = (math.ceil(n / 128), math.ceil(k / 128)) if scheme == "fp8-block" else (n, 1)
            assert q[name + scale_suffix].dtype == torch.float32 and q[name + scale_suffix].shape == expected
        else:
            assert q[name] is tensor  # passed through, not copied
    deq = dequantize_state_dict(q, scheme)
    assert set(deq) == set(sd)
    for name in quantized:
        bound = sd[name].abs().amax() / (127 if scheme == "int8" else 16)
        assert (deq[name] - sd[name]).abs().max() <= bound


def test_quantize_state_dict_none_and_errors():
    sd = _state_dict()
    q = quantize_state_dict(sd, "none")
    assert q.keys() == sd.keys() and all(q[n] is sd[n] for n in sd)
    assert dequantize_state_dict(q, "none").keys() == sd.keys()
    with pytest.raises(ValueError, match="'none', 'int8', 'fp8-channel', 'fp8-block'"):
        quantize_state_dict(sd, "int4")
    with pytest.raises(ValueError, match="2-D"):
        quantize_state_dict({"model.layers.0.mlp.up_proj.weight": torch.ones(3)}, "int8")
    with pytest.raises(ValueError, match="missing"):
        dequantize_state_dict({"model.layers.0.mlp.up_proj.weight": torch.ones(3, 3, dtype=torch.int8)}, "int8")


def test_quantize_state_dict_bf16_weights():
    sd = {"layers.0.self_attn.q_proj.weight": _weight(8, 16).bfloat16()}
    q = quantize_state_dict(sd, "int8")
    name = "layers.0.self_attn.q_proj.weight"
    assert torch.equal(q[name], quantize_int8(sd[name].float())[0])


@pytest.mark.parametrize(
    "name, expected",
    [
        ("model.layers.3.self_attn.q_proj.weight", True),
        ("self_attn.o_proj.weight", True),
        ("model.layers.0.mlp.down_proj.weight", True),
        ("model.layers.0.self_attn.q_proj.bias", False),
        ("model.layers.0.self_attn.q_norm.weight", False),
        ("model.layers.0.input_layernorm.weight", False),
        ("model.embed_tokens.weight", False),
        ("lm_head.weight", False),
        ("model.layers.0.self_attn.q_proj.weight_scale", False),
        ("model.layers.0.mlp.gate_proj.weight_scale_inv", False),
        ("model.layers.0.xself_attn.q_proj.weight", False),
    ],
)
def test_is_quantized_linear(name, expected):
    assert is_quantized_linear(name) is expected


def test_scheme_for():
    assert scheme_for("none", "block") == "none"
    assert scheme_for("int8", "block") == "int8"
    assert scheme_for("fp8", "block") == "fp8-block"
    assert scheme_for("fp8", "channel") == "fp8-channel"
    with pytest.raises(ValueError, match="rollout.quant"):
        scheme_for("int4", "block")
    with pytest.raises(ValueError, match="fp8_granularity"):
        scheme_for("fp8", "tensor")


def test_scheme_registry_records_what_quantize_state_dict_writes():
    """Each record's code dtype, scale name and scale shape are those of its quantized state dict; 'fp8' is block."""
    assert lookup("fp8") is SCHEMES["fp8-block"] and lookup("int8") is SCHEMES["int8"]
    with pytest.raises(ValueError, match="unknown quant 'int4'"):
        lookup("int4")
    assert CODE_DTYPES == (torch.int8, FP8) and SCALE_SUFFIXES == ("_scale", "_scale_inv")
    name = "model.layers.0.mlp.up_proj.weight"
    for scheme in SCHEMES.values():
        q = quantize_state_dict({name: _weight(200, 130)}, scheme.name)
        if scheme.code_dtype is None:
            assert set(q) == {name} and scheme.scale_suffix is None
            continue
        assert set(q) == {name, name + scheme.scale_suffix} and q[name].dtype == scheme.code_dtype
        assert tuple(q[name + scheme.scale_suffix].shape) == scheme.scale_shape((200, 130))


def test_changed_fraction():
    a = torch.tensor([[1, 2], [3, 4]], dtype=torch.int8)
    b = torch.tensor([[1, 2], [3, -4]], dtype=torch.int8)
    assert changed_fraction(a, b) == 0.25 and changed_fraction(a, a) == 0.0
    f = torch.tensor([0.5, 1.0, 2.0, 448.0]).to(FP8)
    g = torch.tensor([0.5, 1.125, 2.0, -448.0]).to(FP8)
    assert changed_fraction(f, g) == 0.5
    assert changed_fraction(torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.int8)) == 0.0
    with pytest.raises(ValueError, match="equal shape and dtype"):
        changed_fraction(a, b[:1])
    with pytest.raises(ValueError, match="equal shape and dtype"):
        changed_fraction(a, b.to(FP8))


@given(
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    seed=st.integers(0, 1000),
    log_std=st.floats(-8, 4),
    zero_rows=st.integers(0, 3),
)
@settings(max_examples=40, deadline=None)
def test_property_round_trip_bounds_over_shapes(n, k, seed, log_std, zero_rows):
    w = _weight(n, k, seed=seed, std=10**log_std)
    w[: min(zero_rows, n)] = 0
    codes, scale = quantize_int8(w)
    assert torch.isfinite(scale).all() and codes.abs().max() <= 127
    assert (dequantize_int8(codes, scale) - w).abs().le(_int8_error_bound(w, scale)).all()
    for granularity in ("tensor", "channel", "block"):
        codes, scale = quantize_fp8(w, granularity)
        deq = dequantize_fp8(codes, scale)
        if granularity == "block":
            assert scale.shape == (math.ceil(n / 128), math.ceil(k / 128))
            scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        assert torch.isfinite(deq).all()
        assert (deq - w).abs().le(_fp8_error_bound(w, scale.expand_as(w))).all()


@given(n=st.integers(1, 260), k=st.integers(1, 260), seed=st.integers(0, 1000), exponent=st.integers(-3, 3))
@settings(max_examples=25, deadline=None)
def test_property_power_of_two_equivariance_over_shapes(n, k, seed, exponent):
    w = _weight(n, k, seed=seed)
    s = 2.0**exponent
    for quantize in (quantize_int8, lambda x: quantize_fp8(x, "block")):
        codes, scale = quantize(w)
        codes_s, scale_s = quantize(w / s)
        assert changed_fraction(codes, codes_s) == 0.0 and torch.equal(scale_s, scale / s)


def test_config_choices_are_the_registry_settings():
    """qurl.config lists the rollout.quant / quant.fp8_granularity values itself so that qurl-async starts without
    torch; they must be the registry's, so that a scheme added there is accepted by the config."""
    from qurl.config import CHOICES
    from qurl.quant.schemes import FP8_BY_GRANULARITY, QUANT_SETTINGS

    assert tuple(CHOICES["rollout.quant"]) == QUANT_SETTINGS
    assert set(CHOICES["quant.fp8_granularity"]) == set(FP8_BY_GRANULARITY)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64])
def test_changed_indices_by_the_cpu_kernel_equal_the_torch_chain(dtype, monkeypatch):
    """Bit patterns, not values (-0.0 against 0.0 changed, one NaN against itself not), at the first element, inside
    and across 64-byte blocks, in a tail shorter than a block, none at all, and every element (an fp32 engine's
    unquantized tensors)."""
    from qurl import cpu_kernels

    if cpu_kernels.kernels() is None:
        pytest.skip("no CPU kernels here")
    old = torch.zeros(4099, dtype=torch.float32)
    old[7] = float("nan")
    new = old.clone()
    new[[0, 9, 10, 1000, 4096, 4098]] = torch.tensor([1.0, -0.0, 3.0, -2.0, 0.5, 7.0])
    a, b = old.to(dtype), new.to(dtype)
    if dtype == torch.int8:  # no -0.0 or NaN in int8: another change in their place
        b[11] = 5
    every = torch.arange(1, 4100).to(dtype)
    real, calls = cpu_kernels.kernels(), []
    spy = SimpleNamespace(changed_indices=lambda x, y: calls.append(x.dtype) or real.changed_indices(x, y))
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: spy)
    got = [changed_indices(a, b), changed_indices(a, a.clone()), changed_indices(a, every)]
    assert calls == [dtype] * 3  # the kernel's pass, not the chain
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    want = [changed_indices(a, b), changed_indices(a, a.clone()), changed_indices(a, every)]
    assert got[0].dtype == want[0].dtype == torch.int64 and torch.equal(got[0], want[0]) and got[1].numel() == 0
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert 9 in got[0].tolist() or dtype == torch.int8  # -0.0 differs from 0.0 as bits
