"""Engine with INT8 / FP8 linears: parity with a transformers forward on the same fake-quantized weights and
activations, the linear kernels against plain math, and in-place updates of quantized buffers."""

import itertools

import pytest
import torch
from safetensors.torch import load_file
from test_engine import DEVICE, PROMPTS, build_model, teacher_forced

from qurl.quant import (
    dequantize_fp8,
    dequantize_int8,
    dequantize_state_dict,
    quantize_fp8,
    quantize_int8,
    quantize_state_dict,
    quantize_uint8_shifted,
)
from rollout_server.engines import GenRequest, load_engine
from rollout_server.engines.linear import LINEARS, Int8Head, Int8Linear, int8_matmul, onednn_int8_is_exact

SCHEMES = ("int8", "fp8-channel", "fp8-block")
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_quant_activation(scheme: str, x: torch.Tensor) -> torch.Tensor:
    """Dequantized in x's dtype when that is wider than fp32 (scales promoted), so an fp64 reference stays exact."""
    codes, scale = quantize_int8(x, dim=-1) if scheme == "int8" else quantize_fp8(x, "channel")
    deq = dequantize_int8 if scheme == "int8" else dequantize_fp8
    return deq(codes, scale.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)


def fake_quant_reference(hf, path: str, scheme: str, int8_lm_head: bool = False):
    """The HF model on dequantized weights, with each projection's input fake-quantized per token (and the
    lm_head's, on its own dequantized int8 copy, untied from the embedding, with `int8_lm_head`)."""
    sd = quantize_state_dict(load_file(f"{path}/model.safetensors"), scheme)
    wide = hf.dtype == torch.float64
    sd = {k: v.double() if wide and k.endswith(("_scale", "_scale_inv")) else v for k, v in sd.items()}
    hf.load_state_dict(dequantize_state_dict(sd, scheme), strict=False)
    heads = ("lm_head",) if int8_lm_head else ()
    if int8_lm_head:
        codes, scale = quantize_int8(hf.lm_head.weight.detach())
        hf.lm_head.weight = torch.nn.Parameter(dequantize_int8(codes, scale.to(hf.dtype)).to(hf.dtype))
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in PROJ + heads:
            module.register_forward_pre_hook(lambda m, args: (fake_quant_activation(scheme, args[0]),))
    return hf


def fp64_norms(hf):
    """HF's RMSNorm always computes in fp32; the fp64 reference computes it in fp64 like the fp64 engine."""
    for m in hf.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = lambda h, m=m: (
                m.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.variance_epsilon))
            )
    return hf


def quantized_gaps(tmp_path, family: str, scheme: str, dtype: str, int8_lm_head: bool = False) -> torch.Tensor:
    """|engine logprob - fake-quant reference logprob| over greedy and sampled tokens under continuous batching."""
    hf = build_model(family, tmp_path)
    if dtype == "float64":
        hf = fp64_norms(hf.double())
    ref = fake_quant_reference(hf, str(tmp_path), scheme, int8_lm_head)
    quant = "fp8" if scheme == "fp8-block" else scheme  # "fp8" means block scaling
    engine = load_engine(
        str(tmp_path), quant=quant, dtype=dtype, device=DEVICE, max_batch=3, max_seq_len=64, int8_lm_head=int8_lm_head
    )
    w = engine.weights["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == (torch.int8 if scheme == "int8" else torch.float8_e4m3fn)
    reqs = [GenRequest(p, n=2, max_new_tokens=10, temperature=0) for p in PROMPTS]
    reqs += [GenRequest(PROMPTS[1], n=2, max_new_tokens=10, temperature=1.0, seed=2)]
    gaps = []
    for req, res in zip(reqs, engine.generate(reqs)):
        for s in res.samples:
            tf = teacher_forced(ref, req.prompt_ids, s.token_ids, req.temperature or 1.0)
            gaps.append((torch.tensor(s.logprobs) - tf).abs())
    return torch.cat(gaps)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_parity_with_fake_quant_reference(tmp_path, family, scheme):
    """Every token within 1e-3 (measured: <= 1e-6). The engine and the reference run in fp64 so that no
    activation lands on the other side of a quantizer rounding boundary by float noise; the quantized
    kernels themselves (exact int32 `_int_mm`, the fp8 fallback) are the ones an fp32 engine runs."""
    gaps = quantized_gaps(tmp_path, family, scheme, "float64")
    assert gaps.max() <= 1e-3, gaps


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # tied and untied lm_head
def test_int8_lm_head_parity_with_fake_quant_reference(tmp_path, family):
    """quant.lm_head: the logits come from per-row int8 codes of the lm_head times per-token int8 activations."""
    gaps = quantized_gaps(tmp_path, family, "int8", "float64", int8_lm_head=True)
    assert gaps.max() <= 1e-3, gaps
    engines = [
        load_engine(str(tmp_path), quant="int8", dtype="float64", device=DEVICE, max_seq_len=64, int8_lm_head=h)
        for h in (True, False)
    ]
    head, plain = (e.generate([GenRequest(PROMPTS[0], max_new_tokens=6, temperature=0)]) for e in engines)
    gap = torch.tensor(head[0].samples[0].logprobs) - torch.tensor(plain[0].samples[0].logprobs)
    assert gap.abs().max() > 1e-4  # the head really is int8, not the full-precision lm_head


def test_int8_lm_head_needs_the_int8_torch_engine(tmp_path):
    build_model("qwen2", tmp_path)
    with pytest.raises(ValueError, match="int8_lm_head needs engine 'torch' and quant 'int8', got 'torch' and 'none'"):
        load_engine(str(tmp_path), quant="none", int8_lm_head=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shifted_activation_codes_equal_quantize_int8(dtype):
    """The decode path's one-pass activation quantizer gives quantize_int8's codes (+128) and scales bit for bit."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(33, 200, generator=g) * torch.logspace(-3, 3, 33)[:, None]).to(dtype)
    x[5] = 0  # an all-zero token
    codes, scale = quantize_int8(x, dim=-1)
    shifted, scale2 = quantize_uint8_shifted(x)
    assert shifted.dtype == torch.uint8 and torch.equal(scale2, scale)
    assert torch.equal(shifted.int() - 128, codes.int())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_head_codes_equal_quantize_int8_after_each_push(dtype):
    """The int8 lm_head (requantized by the CPU kernel where it builds) holds quantize_int8's codes and scales bit
    for bit, at load and after a push rewrote its source in place: ties round to even, a zero row gets scale 1."""
    g = torch.Generator().manual_seed(5)
    source = (torch.randn(40, 96, generator=g) * torch.logspace(-3, 2, 40)[:, None]).to(dtype)
    head = Int8Head(source)
    for push in range(3):
        if push:
            source.copy_(torch.randn(40, 96, generator=g).to(dtype))
            source[3] = 0
            source[7, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # scale 1: codes 127, 2, -4, 0 (half to even)
            head.refresh()
        codes, scale = quantize_int8(source, dim=-1)
        assert torch.equal(head.weight, codes) and torch.equal(head.scale, scale), push
    assert head.weight[7, :4].tolist() == [127, 2, -4, 0] and head.scale[3].item() == 1.0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_fp32_engine_tracks_reference(tmp_path, scheme):
    """In fp32, float rounding before an activation quantizer now and then picks the neighbouring code; on
    these 64-wide models that single code moves a logprob by up to ~1e-2 and the KV cache carries it on."""
    gaps = quantized_gaps(tmp_path, "qwen2", scheme, "float32")
    assert gaps.median() < 1e-5
    assert (gaps <= 1e-3).float().mean() >= 0.9, gaps
    assert gaps.max() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ("none",) + SCHEMES)
def test_fused_linear_matches_plain_math(scheme, dtype):
    g = torch.Generator().manual_seed(0)
    sizes, k = [208, 80, 48], 144  # partial 128-blocks, uneven fused parts; multiples of 16 for CUDA fp8 GEMMs
    prefixes = [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
    tensors = {}
    for p, n in zip(prefixes, sizes):
        tensors[p + ".weight"] = torch.randn(n, k, generator=g) * 0.05
        tensors[p + ".bias"] = torch.randn(n, generator=g)
    q = quantize_state_dict(tensors, scheme)
    lin = LINEARS[scheme](prefixes, q, dtype, torch.device(DEVICE))
    assert set(lin.named) == set(q)
    x = torch.randn(5, k, generator=g).to(device=DEVICE, dtype=dtype)
    w = torch.cat([dequantize_state_dict(q, scheme)[p + ".weight"] for p in prefixes]).to(DEVICE)
    xr = x.float() if scheme == "none" else fake_quant_activation(scheme, x.float())
    want = xr @ w.t() + torch.cat([tensors[p + ".bias"] for p in prefixes]).to(DEVICE)
    got = lin(x)
    assert got.dtype == dtype and got.shape == (5, sum(sizes))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(got.float(), want, **tol)
    if DEVICE == "cuda" and scheme == "fp8-channel" and dtype == torch.bfloat16:
        assert lin._scaled_mm_ok  # the torch._scaled_mm path ran, not the dequantizing fallback


def test_every_scheme_has_its_linear_class():
    from qurl.quant import SCHEMES as registry

    assert set(LINEARS) == set(registry) and all(cls.scheme is registry[name] for name, cls in LINEARS.items())


@pytest.mark.skipif(DEVICE != "cpu", reason="the oneDNN prepacked int8 path is CPU-only")
def test_cpu_prepacked_int8_equals_int_mm():
    """The prepacked oneDNN paths compute int8_matmul's exact int32 sums: zero point 128 where the probe found its
    sums exact, and the sign split, also forced here so that it runs on every CPU (on an AVX2-only CPU the
    zero-point path was off by up to 0.47)."""
    g = torch.Generator().manual_seed(1)
    prefixes = ["model.layers.0.self_attn.o_proj"]
    q = quantize_state_dict({prefixes[0] + ".weight": torch.randn(96, 160, generator=g) * 0.05}, "int8")
    lin = Int8Linear(prefixes, q, torch.float32, torch.device("cpu"))
    lin.use_onednn()  # the engine's own where its kernel does not take every row count (all but AMX)
    lin._gemm = None
    assert lin.packed is not None and lin.split == (not onednn_int8_is_exact())
    for split, m in itertools.product(sorted({True, lin.split}), (1, 7, 64)):
        lin.split = split
        x = torch.randn(m, 160, generator=g) * 3
        torch.testing.assert_close(lin(x), int8_matmul(x, lin.weight, lin.scale_t), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scheme,head", [("int8", False), ("fp8-block", False), ("int8", True)])
def test_quantized_update_in_place(tmp_path, scheme, head):
    """With quant.lm_head the push carries the full-precision lm_head and the engine requantizes its int8 copy."""
    build_model("qwen3", tmp_path / "a", seed=0)
    build_model("qwen3", tmp_path / "b", seed=1)
    quant = "fp8" if scheme == "fp8-block" else scheme
    kw = dict(quant=quant, device=DEVICE, max_batch=4, max_seq_len=64, int8_lm_head=head)
    a = load_engine(str(tmp_path / "a"), **kw)
    b = load_engine(str(tmp_path / "b"), **kw)
    # what a learner sends: its full-precision state dict quantized by qurl.quant
    pushed = quantize_state_dict(load_file(tmp_path / "b" / "model.safetensors"), scheme)
    assert set(pushed) == set(a.weights)
    snapshot = {k: v.clone() for k, v in a.weights.items()}
    ptrs = {k: v.data_ptr() for k, v in a.weights.items()}
    scale = next(k for k in pushed if k.endswith("_scale") or k.endswith("_scale_inv"))
    code = scale.rsplit("_scale", 1)[0]
    for bad, msg in [
        ({**pushed, code: pushed[code].float()}, "torch.float32"),
        ({**pushed, scale: torch.cat([pushed[scale], pushed[scale]])}, "the engine holds torch.float32"),
        ({**pushed, "model.layers.9.mlp.up_proj.weight": pushed[code]}, "unknown tensor"),
        ({k: v for k, v in pushed.items() if k != scale}, "missing tensor"),
    ]:
        with pytest.raises(ValueError, match=msg):
            a.update_weights(bad, version=1)
        assert all(torch.equal(v.cpu(), snapshot[k].cpu()) for k, v in a.weights.items())
    a.update_weights(pushed, version=1)
    assert {k: v.data_ptr() for k, v in a.weights.items()} == ptrs
    reqs = [GenRequest(p, n=2, max_new_tokens=8, temperature=1.0, seed=4) for p in PROMPTS]
    for ra, rb in zip(a.generate(reqs), b.generate(reqs)):
        for sa, sb in zip(ra.samples, rb.samples):
            assert sa.token_ids == sb.token_ids and sa.logprobs == sb.logprobs and set(sa.versions) == {1}


def test_bf16_engine_tracks_hf_bf16(tmp_path):
    hf = build_model("qwen2", tmp_path).to(torch.bfloat16)
    engine = load_engine(str(tmp_path), quant="none", dtype="bfloat16", device=DEVICE, max_batch=2, max_seq_len=64)
    assert engine.weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for req, res in zip(PROMPTS, engine.generate([GenRequest(p, max_new_tokens=8, temperature=0) for p in PROMPTS])):
        s = res.samples[0]
        tf = teacher_forced(hf, req, s.token_ids)
        assert (torch.tensor(s.logprobs) - tf).abs().max() < 0.1
