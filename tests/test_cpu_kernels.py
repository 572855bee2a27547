"""qurl/cpu_kernels.py: the CPU kernels against the torch operators they replace."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from qurl import cpu_kernels
from qurl.quant import quantize_int8, quantize_uint8_shifted
from rollout_server.engines.linear import Int8Head, Int8Linear, int8_matmul
from rollout_server.engines.model import rms_norm

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def k():
    module = cpu_kernels.kernels()
    assert module is not None, "the CPU kernels did not build: see the warning above"
    return module


def torch_rms_norm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_the_torch_formula(k, dtype):
    torch.manual_seed(0)
    x, w = torch.randn(7, 576, dtype=dtype) * 3, torch.randn(576, dtype=dtype)
    got, want = k.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # the fp32 sum of squares in another order
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(rms_norm(x, w, 1e-5), got)  # the engine's rms_norm takes the kernel


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_equals_quantize_uint8_shifted(k, dtype):
    torch.manual_seed(1)
    x = torch.randn(9, 1536, dtype=dtype) * torch.logspace(-3, 2, 9)[:, None].to(dtype)
    x[3] = 0  # an all-zero row: scale 1, codes 128
    (got, got_s), (want, want_s) = k.quantize_uint8_shifted(x), quantize_uint8_shifted(x)
    assert got.dtype == torch.uint8 and torch.equal(got, want) and torch.equal(got_s, want_s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_int8_takes_the_kernel_bit_for_bit(k, dtype, monkeypatch):
    """A push's weights and the int8 lm_head: quantize_int8's kernel path equals its torch chain, codes and scales."""
    torch.manual_seed(5)
    x = torch.randn(7, 640, dtype=dtype) * torch.logspace(-4, 3, 7)[:, None].to(dtype)
    x[2] = 0
    x[4, 9] = -x[4].abs().max() * 2  # the row's largest magnitude negative: code -127
    calls = []
    spy = SimpleNamespace(quantize_uint8_shifted=lambda t: calls.append(t.dtype) or k.quantize_uint8_shifted(t))
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: spy)
    got, got_s = quantize_int8(x)
    assert calls == [dtype]  # the kernel's pass, not the chain
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    want, want_s = quantize_int8(x)
    assert got.dtype == want.dtype == torch.int8 and torch.equal(got, want) and torch.equal(got_s, want_s)
    assert int(got[4, 9]) == -127 and int(got[2].abs().max()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_torch(k, dtype):
    torch.manual_seed(2)
    gate_up = torch.randn(5, 2 * 1536, dtype=dtype) * 4
    gate, up = gate_up.chunk(2, -1)
    got, want = k.silu_mul(gate_up), F.silu(gate) * up
    if dtype == torch.bfloat16:  # exp's last fp32 bit may move a product across a bf16 rounding boundary
        assert (got != want).float().mean() < 1e-3
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (16, 16), (37, 70), (130, 3584), (4167, 48)])
def test_transposed_is_an_exact_contiguous_transpose(k, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    got = k.transposed(x)
    assert got.is_contiguous() and torch.equal(got, x.t())
    rows = torch.randn(shape[0], shape[1] + 5).to(dtype)[:, 3 : 3 + shape[1]]  # a row stride wider than the rows
    assert torch.equal(k.transposed(rows), rows.t())


def test_transposed_says_what_it_takes(k):
    with pytest.raises(RuntimeError, match="16-bit elements"):
        k.transposed(torch.zeros(4, 4))
    with pytest.raises(RuntimeError, match="2-D CPU tensor of rows"):
        k.transposed(torch.zeros(4, 4, dtype=torch.bfloat16).t())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_cache_rotates_q_and_k_and_writes_the_cache(k, dtype):
    torch.manual_seed(3)
    b, heads, kvh, d, slots, t = 4, 6, 2, 64, 5, 32
    qkv = torch.randn(b, (heads + 2 * kvh) * d, dtype=dtype)
    angles = torch.rand(b, d // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    positions = torch.tensor([0, 7, 31, 3])
    kc, vc = torch.zeros(slots, kvh, t, d, dtype=dtype), torch.zeros(slots, kvh, t, d, dtype=dtype)
    q = k.rope_cache(qkv, cos, sin, kc, vc, positions, heads, kvh)
    x = qkv.view(b, heads + 2 * kvh, d)
    rotated = x * cos[:, None] + x.roll(d // 2, -1) * sin[:, None]  # model.py's torch ops
    assert torch.equal(q, rotated[:, :heads])
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    for i, p in enumerate(positions.tolist()):
        want_k[i, :, p] = rotated[i, heads : heads + kvh]
        want_v[i, :, p] = x[i, heads + kvh :]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(RuntimeError, match="position out of range"):
        k.rope_cache(qkv, cos, sin, kc, vc, torch.tensor([0, 1, 2, t]), heads, kvh)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g, d", [(3, 64), (7, 128), (2, 48)])  # SmolLM2's heads, Qwen2-7B's, an odd 16-lane count
def test_decode_attention_matches_sdpa(k, dtype, g, d):
    if not k.vector_attention:
        pytest.skip("decode attention is built only with AVX-512 or AVX2 + FMA; the engine keeps SDPA here")
    torch.manual_seed(4)
    b, kvh, t = 5, 3, 300
    q = torch.randn(b, kvh, g, d, dtype=dtype) * 2
    kc, vc = torch.randn(b + 2, kvh, t, d, dtype=dtype), torch.randn(b + 2, kvh, t, d, dtype=dtype)
    lengths = torch.tensor([1, 17, 230, 16, 229])
    length = int(lengths.max())
    kv = kc[:b, :, :length], vc[:b, :, :length]
    mask = torch.where(torch.arange(length)[None] < lengths[:, None], 0.0, -torch.inf)[:, None, None]
    scale = d**-0.5
    exact = F.scaled_dot_product_attention(q.double(), *(x.double() for x in kv), attn_mask=mask.double(), scale=scale)
    sdpa = F.scaled_dot_product_attention(q, *kv, attn_mask=mask.to(dtype), scale=scale)
    got = k.decode_attention(q, *kv, lengths, scale)
    assert got.dtype == dtype
    # no further from the fp64 result than torch's own kernel (plus one rounding of the output)
    bound = (sdpa.double() - exact).abs().max().item() + (2**-8 if dtype == torch.bfloat16 else 1e-6)
    assert (got.double() - exact).abs().max().item() <= bound
    with pytest.raises(RuntimeError, match="length out of range"):
        k.decode_attention(q, *kv, torch.tensor([1, 17, 230, 16, length + 1]), scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_the_onednn_path_in_torch_ops(k, dtype, bias):
    """The one-call int8 linear (quantize, oneDNN's GEMM, dequantize + bias) bit for bit against linear.py's torch-op
    composition of the same steps, a short tail included; the int8 lm_head's fp32 logits too."""
    torch.manual_seed(6)
    n, kk = 1536 + 7, 576
    codes, scale = quantize_int8(torch.randn(n, kk), dim=-1)
    tensors = {"w.weight": codes, "w.weight_scale": scale} | ({"w.bias": torch.randn(n)} if bias else {})
    lin = Int8Linear(["w"], tensors, dtype, torch.device("cpu"))
    lin.use_onednn()  # with AMX or AVX2 the engine keeps no oneDNN copy: its kernel takes every row count
    lin._gemm = None  # the oneDNN path, in one call
    if lin._fused(torch.zeros(1, kk, dtype=dtype)) is None:
        pytest.skip("oneDNN's int8 GEMM is not exact on this CPU (no VNNI): the linear splits the codes by sign")
    x = (torch.randn(9, kk) * 3).to(dtype)
    want = lin._add_bias(lin._int8_onednn(x, dtype), x)
    got = lin(x)
    assert got.dtype == dtype and torch.equal(got, want)
    head = Int8Head(torch.randn(n, kk).to(dtype))
    head.use_onednn()
    head._gemm = None
    assert torch.equal(head(x), head._int8_onednn(x, torch.float32))
    with pytest.raises(RuntimeError, match="int8_linear bias"):
        k.int8_linear(x, lin.packed, lin.scale.view(-1), lin.zero_points, torch.zeros(n + 1, dtype=dtype), False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,n,kk",
    [(1, 16, 64), (16, 960, 576), (17, 37, 70), (32, 100, 3), (128, 48, 128), (131, 37, 70), (300, 40, 192)],
)
def test_int8_gemm_kernel_equals_the_onednn_path(k, dtype, m, n, kk):
    """Bit for bit: exact int32 sums and the same fp32 dequantization, bias added in the model dtype."""
    if not k.int8_gemm:
        pytest.skip("the int8 GEMM kernel is built only with AVX-512 VNNI or AVX2; oneDNN runs here")
    torch.manual_seed(5)
    codes, scale = quantize_int8(torch.randn(n, kk))
    tensors = {"p.weight": codes, "p.weight_scale": scale, "p.bias": torch.randn(n)}
    lin = Int8Linear(["p"], tensors, dtype, torch.device("cpu"))
    lin.use_onednn()
    x = torch.randn(m, kk).to(dtype)
    lin._gemm = k  # the kernel's path (AMX tiles where K is a multiple of 64, else VNNI; on AVX2 its own)
    lin.repack()
    got = lin(x)
    lin._gemm = None  # the oneDNN path
    want = lin(x)
    assert torch.equal(got, want)
    exact = int8_matmul(x, codes, scale.t()).to(dtype) + lin.bias
    torch.testing.assert_close(got, exact, rtol=2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("n,kk", [(37, 70), (32, 64), (5, 3)])
def test_int8_pack_lays_out_panels_of_16_rows_by_4_inputs(k, n, kk):
    """[ceil(N/16)][ceil(K/4)][16][4], zero padded, and 128 x each row's sum: what the VNNI and AMX loops read."""
    if k.int8_gemm not in ("amx", "avx512-vnni"):
        pytest.skip("this CPU's int8 GEMM keeps another layout (AVX2) or has none")
    torch.manual_seed(7)
    codes = torch.randint(-128, 128, (n, kk), dtype=torch.int8)
    packed, comp = k.int8_pack(codes)
    nb, k4 = -(-n // 16), -(-kk // 4)
    padded = torch.zeros(nb * 16, k4 * 4, dtype=torch.int8)
    padded[:n, :kk] = codes
    assert torch.equal(packed, padded.view(nb, 16, k4, 4).transpose(1, 2))
    assert torch.equal(comp, 128 * padded.sum(1, dtype=torch.int32))


def test_where_the_kernel_takes_every_row_one_copy_of_the_codes_is_kept(k):
    """Where the kernel takes every row count (AMX, AVX2), prefill's too, a linear keeps no oneDNN copy: a push
    re-derives one copy of the codes, not two; elsewhere (AVX-512 VNNI) oneDNN's serves the rows above its limit."""
    codes, scale = quantize_int8(torch.randn(64, 128))
    lin = Int8Linear(["w"], {"w.weight": codes, "w.weight_scale": scale}, torch.float32, torch.device("cpu"))
    every_row = k.int8_gemm in ("amx", "avx2")
    assert (lin.packed is None) == every_row and (lin.panels is not None) == bool(k.int8_gemm)
    x = torch.randn(2000, 128)
    assert lin._takes_kernel(x) == every_row
    torch.testing.assert_close(lin(x), int8_matmul(x, codes, scale.t()), rtol=1e-5, atol=1e-5)


def test_int8_gemm_copies_follow_in_place_updates(k):
    """A push writes the codes in place; repack (the engine calls it) rebuilds the panels, and the int8 head's too."""
    if not k.int8_gemm:
        pytest.skip("no int8 GEMM kernel on this CPU")
    torch.manual_seed(6)
    head = Int8Head(torch.randn(96, 64))
    head._gemm = k
    head.repack()
    x = torch.randn(4, 64)
    before = head(x)
    head.source.mul_(-1)
    head.refresh()
    torch.testing.assert_close(head(x), -before, rtol=0, atol=0)


def test_sample_rows_draws_what_sampling_py_draws(k, monkeypatch):
    """The one-pass draw is sampling.py's inverse-CDF draw: for each row's uniform u, the token whose fp64 CDF interval
    holds u (up to summation: the two paths sum 49k probabilities in different orders, the kernel's total in fp64, so
    a u within ~1e-5 of a boundary may land either side), its log-softmax, greedy rows' first maximum, never a -inf
    token."""
    from rollout_server.engines import sampling

    torch.manual_seed(3)
    b, vocab = 64, 49152 + 5  # SmolLM2's vocabulary, plus a short last segment
    logits = torch.randn(b, vocab) * torch.linspace(0.5, 8, b)[:, None]  # flat to peaked rows
    logits[5, 1000] = logits[5].max() + 30  # one token holds all the mass
    logits[6, :-3] = -torch.inf  # only the last 3 tokens can be drawn
    logits[7, 10:] = -torch.inf  # ... the first 10 here, with u = 1 below
    logits[8, [17, 40_000]] = logits[8].max() + 1  # a tie for greedy: the first one
    temps = [(0.0, 1.0, 0.7, 1.3)[i % 4] for i in range(b)]
    temps[7], temps[8] = 1.0, 0.0
    u = (1.0 - torch.rand(b)).tolist()
    u[7] = 1.0
    args = (logits, temps, [1.0] * b, [-1] * b, u)
    tok, lp = sampling.sample(*args)  # the kernel
    monkeypatch.setattr(sampling, "usable", lambda x: None)
    want_tok, want_lp = sampling.sample(*args)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    t64 = torch.tensor([t or 1.0 for t in temps], dtype=torch.float64)[:, None]
    logp64 = torch.log_softmax(logits.double() / t64, -1)
    # its total in fp64: 1.1e-6 off (2.3e-5 with an fp32 total on AVX2; torch's fp32 log_softmax 1.4e-5)
    torch.testing.assert_close(lp.double(), logp64.gather(1, tok[:, None])[:, 0], rtol=0, atol=5e-6)
    cdf64 = logp64.exp().cumsum(-1)
    for drawn in (tok, want_tok):  # the kernel, and sampling.py's torch path held to the same standard
        hi = cdf64.gather(1, drawn[:, None])[:, 0]
        lo = hi - logp64.gather(1, drawn[:, None])[:, 0].exp()
        sampled = torch.tensor([t != 0 for t in temps])
        target = torch.tensor(u, dtype=torch.float64)
        assert ((lo - 1e-5 <= target) & (target <= hi + 1e-5))[sampled].all()
    assert (tok != want_tok).sum() <= 4 and torch.equal(tok[::4], logits[::4].argmax(-1))  # rows 0, 4, ...: greedy
    same = tok == want_tok
    torch.testing.assert_close(lp[same], want_lp[same], rtol=1e-5, atol=1e-5)
    assert tok[5] == 1000 and tok[6] >= vocab - 3 and tok[7] < 10 and tok[8] == 17
    assert torch.isfinite(lp).all()
    with pytest.raises(RuntimeError, match="uniform must be in"):
        k.sample_rows(logits, torch.ones(b), torch.zeros(b))


def test_engine_greedy_tokens_equal_without_the_kernels(tmp_path, monkeypatch):
    """The engine's greedy decode with the kernels equals its torch-operator decode (bf16 SmolLM2-like shapes)."""
    from test_engine import build_model

    from rollout_server.engines import GenRequest, load_engine

    build_model("llama", tmp_path)
    reqs = [GenRequest(p, max_new_tokens=12, temperature=0) for p in ([1, 2, 3], [5, 6, 7, 8, 9], [14])]
    runs = {}
    for on in (True, False):
        if not on:
            monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
        engine = load_engine(str(tmp_path), quant="int8", dtype="bfloat16", max_batch=3, max_seq_len=64)
        runs[on] = engine.generate(reqs)
    for a, b in zip(runs[True], runs[False]):
        assert a.samples[0].token_ids == b.samples[0].token_ids
        torch.testing.assert_close(
            torch.tensor(a.samples[0].logprobs), torch.tensor(b.samples[0].logprobs), atol=0.05, rtol=0
        )


def test_decode_benchmark_quick(tmp_path):
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "decode.py")
    spec = importlib.util.spec_from_file_location("decode_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "decode.json"
    result = bench.main(["--quick", "--threads", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result and result["benchmark"] == "decode"
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == set(bench.CONFIGS)
    assert rows["bf16"]["vs_bf16"] == 1.0 and all(r["decode_tokens_per_s"] > 0 for r in rows.values())
    assert not rows["bf16-torch-ops"]["cpu_kernels"] and rows["int8"]["cpu_kernels"]
    # int8 codes and an int8 lm_head stream about half of bf16's weight bytes
    assert rows["int8+bf16+head"]["weight_bytes_per_step"] < 0.6 * rows["bf16"]["weight_bytes_per_step"]
    assert all(0 < r["share_of_byte_limit"] for r in rows.values())
    if cpu_kernels.int8_gemm_kernels() is not None:  # the GEMM against oneDNN, both timed at each row count
        assert [r["rows"] for r in result["gemm"]] == [1, 4] and all(r["kernel_vs_onednn"] > 0 for r in result["gemm"])
    # --apply: one push's re-derivations by part, the head's requantization both ways
    apply = bench.main(["--apply", "--models", "tiny", "--rounds", "1", "--threads", "1"])
    (row,) = apply["rows"]
    assert apply["benchmark"] == "decode-apply" and row["head_shape"] == [512, 128] and row["int8_linears"] == 8
    assert all(row[k] > 0 for k in ("linears_repack_s", "head_quantize_kernel_s", "head_repack_s", "repack_all_s"))
    if cpu_kernels.kernels().vector_attention:  # --attention: the kernel against SDPA, one tiny shape, both dtypes
        rows = bench.main(["--attention", "--quick", "--threads", "1"])["rows"]
        assert [r["dtype"] for r in rows] == ["bfloat16", "float32"]
        assert all(r["kernel_ms_per_layer"] > 0 and r["kernel_vs_sdpa"] > 0 for r in rows)


def test_every_checkout_builds_from_one_copy_of_the_source(tmp_path):
    """ninja's build file names the source's path: two checkouts of one source share the build only if both build from
    the same path, the copy in the build folder; a stale copy is replaced."""
    copy = cpu_kernels.source_copy(tmp_path)
    assert copy == tmp_path / cpu_kernels.SOURCE.name and copy.read_bytes() == cpu_kernels.SOURCE.read_bytes()
    copy.write_text("// another source\n")
    assert cpu_kernels.source_copy(tmp_path).read_bytes() == cpu_kernels.SOURCE.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [cpu_kernels.SOURCE.name]  # no temporary file left
