"""The real sglang.Engine on this CPU, driven through our adapter: generation, refit sessions, INT8 and FP8 loads.

Runs under `make test-sglang` (SGLANG_USE_CPU_ENGINE=1, tests/sglang_cpu on PYTHONPATH). What is SGLang's own code
here: the Engine, its tokenizer manager, scheduler and detokenizer processes, ServerArgs, the model (Qwen2 / Llama
with SGLang's layers, torch-native attention, its sampler and logprobs), its weight-update sessions (pause,
begin, update_weights_from_tensor, end with the post-load re-run, continue), the weight-version spans and its
allow-list unpickler. The stand-ins (test support in tests/sglang_cpu): the `sgl_kernel` package (one index
helper, the rest raise) and, for INT8 / FP8, the post-load step and the matmul of the two quantized linear
methods (the CUDA branch's layout, then a dequantize + plain matmul of the layer's stored codes).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("SGLANG_USE_CPU_ENGINE") != "1",
    reason="needs make test-sglang (SGLANG_USE_CPU_ENGINE=1 and tests/sglang_cpu)",
)

transformers = pytest.importorskip("transformers")

from qurl.quant import dequantize_state_dict, quantize_state_dict  # noqa: E402
from qurl.wire import delta  # noqa: E402
from rollout_server.engines import GenRequest, load_engine  # noqa: E402

STORAGE_LOADER = "cpu_quant.record_storage"  # test support: writes the quantized layers' data pointers to a file
# peaked logits (std ~3) so that wrong weights move logprobs by nats; no EOS, samples end at max_new_tokens
ARCH = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    eos_token_id=None,
    bos_token_id=None,
    initializer_range=0.2,
)
PROMPTS = [[11, 27, 300, 5], [400, 2, 2, 97, 150, 8], [33]]
# bf16 engines against an fp32 reference of the same (dequantized) weights: bf16 activations and KV cache round
# every op to 8 mantissa bits; measured here mean |gap| 0.04-0.06 and max 0.3-0.75 nats per token, while the
# reference of the other version's weights is 5 nats away on average
BF16_MEAN_GAP, BF16_MAX_GAP, WRONG_MEAN_GAP = 0.15, 1.5, 1.0
# float32 engines against the float32 reference: float noise, which grows with these peaked logits and differs by CPU
# (other GEMM kernels and blocking). Max per-token gap measured on the AVX2-only EPYC 2.7e-5 over 1,080 tokens
# (10 runs of the llama test); CI's CPU once gave 1.08e-4 on a sampled token. 3e-4 stays 100x under bf16's mean gap.
FP32_GAP = 3e-4


def build(path: Path, arch: str, seed: int) -> Path:
    cls, cfg = {
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
    }[arch]
    torch.manual_seed(seed)
    cls(cfg(**ARCH)).save_pretrained(path)
    return path


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def perturbed(w: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in w.items()}


def reference_logprobs(path: Path, state: dict[str, torch.Tensor], prompt: list[int], tokens: list[int]) -> list[float]:
    """Teacher-forced log_softmax(logits) (T = 1) of `tokens` after `prompt`, fp32 transformers on `state`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    model.tie_weights()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def gaps(engine, path, state, requests) -> list[float]:
    """|engine logprob - reference logprob| over every sampled token of `requests`."""
    out = []
    for req, res in zip(requests, engine.generate(requests), strict=True):
        for s in res.samples:
            ref = reference_logprobs(path, state, req.prompt_ids, s.token_ids)
            out += [abs(a - b) for a, b in zip(s.logprobs, ref, strict=True)]
    return out


def sampled(n=2, tokens=12):
    return [GenRequest(prompt_ids=p, n=n, max_new_tokens=tokens, temperature=1.0) for p in PROMPTS]


def greedy(tokens=12):
    return [GenRequest(prompt_ids=p, n=1, max_new_tokens=tokens, temperature=0.0) for p in PROMPTS]


def storage(engine) -> dict[str, int]:
    """Data pointers of every quantized layer's buffers, read inside SGLang's scheduler by a test loader."""
    out = Path(os.environ["QURL_TEST_STORAGE_FILE"])  # set before the engine started: its scheduler inherited it
    sgl = engine.engine
    assert sgl.begin_weight_update()[0]
    ok, msg = sgl.update_weights_from_tensor(named_tensors=[], load_format=STORAGE_LOADER)
    assert sgl.end_weight_update()[0] and ok, msg
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("qwen2"), "qwen2", 0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("llama"), "llama", 1)


class TestUnquantized:
    """rollout.quant=none, float32: SGLang's own loaders and kernels against transformers, to float noise."""

    @pytest.fixture(scope="class")
    def engine(self, qwen):
        engine = load_engine(
            str(qwen), engine="sglang", quant="none", dtype="float32", device="cpu", max_batch=16, max_seq_len=128
        )
        yield engine
        engine.close()

    def test_samples_logprobs_and_versions_equal_transformers(self, engine, qwen):
        base = weights(qwen)
        results = engine.generate(sampled(n=3))
        for req, res in zip(sampled(n=3), results, strict=True):
            assert len(res.samples) == 3
            for s in res.samples:
                assert len(s.token_ids) == 12 and s.finish_reason == "length" and s.versions == [0] * 12
                ref = reference_logprobs(qwen, base, req.prompt_ids, s.token_ids)
                assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < FP32_GAP
            assert len({tuple(s.token_ids) for s in res.samples}) > 1  # n samples, not one repeated
        for req, res in zip(greedy(), engine.generate(greedy()), strict=True):
            model = transformers.AutoModelForCausalLM.from_pretrained(qwen)
            want = model.generate(torch.tensor([req.prompt_ids]), max_new_tokens=12, do_sample=False)[0]
            assert res.samples[0].token_ids == want[len(req.prompt_ids) :].tolist()

    def test_stop_tokens_end_a_sample_with_the_stop_token(self, engine):
        first = engine.generate(greedy())[0].samples[0].token_ids
        stop = first[4]
        out = engine.generate(
            [GenRequest(prompt_ids=PROMPTS[0], n=1, max_new_tokens=12, temperature=0.0, stop_token_ids=[stop])]
        )[0].samples[0]
        assert out.finish_reason == "stop" and out.token_ids == first[: first.index(stop) + 1]

    def test_refit_with_generation_in_flight_then_outputs_follow_the_pushed_weights(self, engine, qwen):
        new = perturbed(weights(qwen), seed=1)
        for i, req in enumerate(sampled(n=2, tokens=110)):
            engine.add_request(req, i)
        done, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 0.3:  # let decoding start (110 tokens take over a second)
            done += engine.step()
        engine.update_weights(quantize_state_dict(new, "none"), version=1)
        while engine.has_work():
            done += engine.step()
        assert engine.version == 1 and len(done) == 2 * len(PROMPTS)
        versions = [s.versions for _, _, s in done]
        assert all(v == sorted(v) and set(v) <= {0, 1} for v in versions)
        assert any(v[0] == 0 and v[-1] == 1 for v in versions), versions  # a sample that crossed the refit
        assert max(gaps(engine, qwen, new, greedy())) < FP32_GAP
        assert all(s.versions == [1] * 12 for r in engine.generate(greedy()) for s in r.samples)

    def test_a_bad_push_is_refused_and_changes_nothing(self, engine, qwen):
        before = [r.samples[0].token_ids for r in engine.generate(greedy())]
        bad = quantize_state_dict(perturbed(weights(qwen), seed=2), "none")
        bad["model.norm.weight"] = bad["model.norm.weight"][:-1]
        with pytest.raises(ValueError, match="model.norm.weight"):
            engine.update_weights(bad, version=5)
        assert engine.version == 1 and [r.samples[0].token_ids for r in engine.generate(greedy())] == before


def test_llama_greedy_and_logprobs_equal_transformers(llama):
    engine = load_engine(
        str(llama), engine="sglang", quant="none", dtype="float32", device="cpu", max_batch=8, max_seq_len=128
    )
    try:
        assert max(gaps(engine, llama, weights(llama), greedy() + sampled())) < FP32_GAP
    finally:
        engine.close()


@pytest.mark.parametrize("scheme", ["int8", "fp8-block"])
def test_quantized_version_zero_pushes_and_deltas_land_in_place(scheme, qwen, tmp_path):
    """Version 0 from the checkpoint, a full push, a delta push: each equals our dequantized reference."""
    from rollout_server.engines.sglang_engine import SGLangEngine

    os.environ["QURL_TEST_STORAGE_FILE"] = str(tmp_path / "storage.json")
    engine = SGLangEngine.from_pretrained(
        str(qwen),
        quant=scheme,
        dtype="bfloat16",
        device="cpu",
        max_batch=16,
        max_seq_len=128,
        server_args={"custom_weight_loader": [STORAGE_LOADER]},
    )
    try:

        def check(state, other):
            held = dequantize_state_dict(quantize_state_dict(state, scheme), scheme)
            g = gaps(engine, qwen, held, sampled())
            assert sum(g) / len(g) < BF16_MEAN_GAP and max(g) < BF16_MAX_GAP, (sum(g) / len(g), max(g))
            wrong = gaps(engine, qwen, dequantize_state_dict(quantize_state_dict(other, scheme), scheme), greedy())
            assert sum(wrong) / len(wrong) > WRONG_MEAN_GAP  # the check tells the versions apart

        base, v1, v2 = weights(qwen), perturbed(weights(qwen), 3), perturbed(weights(qwen), 4)
        check(base, v1)
        pointers = storage(engine)
        assert pointers and all(k.endswith((".weight", "_scale", "_scale_inv")) for k in pointers)
        engine.update_weights(quantize_state_dict(v1, scheme), version=1)
        check(v1, base)
        # a delta from v1 to v2 (here every code moves; the checksum proves the host copy is every tensor of v2)
        q1, q2 = quantize_state_dict(v1, scheme), quantize_state_dict(v2, scheme)
        whole, deltas = delta.diff(q1, q2)
        engine.apply_delta(whole, deltas, version=2, checksum=delta.checksum(q2))
        assert engine.version == 2 and delta.checksum(engine.host) == delta.checksum(q2)
        check(v2, v1)
        with pytest.raises(delta.ChecksumMismatch):
            engine.apply_delta(whole, deltas, version=3, checksum=delta.checksum(q1))
        assert engine.version == 2 and delta.checksum(engine.host) == delta.checksum(q2)
        assert storage(engine) == pointers  # every push wrote into the start-up storage
        # an empty delta (nothing moved): SGLang gets no weight update, but its weight version moves, so the tokens
        # that follow carry version 3 (before, they carried 2 and looked one version staler than they were)
        whole, deltas = delta.diff(q2, q2)
        assert not whole and not deltas
        engine.apply_delta(whole, deltas, version=3, checksum=delta.checksum(q2))
        sample = engine.generate(greedy())[0].samples[0]
        assert engine.version == 3 and set(sample.versions) == {3}, sample.versions
    finally:
        engine.close()


def test_qurl_async_with_sglang_trains_and_a_killed_server_restarts(demo_dir, tmp_path):
    """The whole pipeline on SGLang (fp32): learner pushes over ZeroMQ into the engine; SIGKILL, restart, resume."""
    from launch import finish, start, wait_for_step

    from qurl.outputs.report import read_metrics

    run_dir = tmp_path / "sgl"
    proc = start(demo_dir, run_dir, 6, "rollout.engine=sglang", "rollout.quant=none")
    wait_for_step(run_dir, 2, timeout=400)
    os.kill(json.loads((run_dir / "logs" / "pids.json").read_text())["rollout-0"], signal.SIGKILL)
    code, out = finish(proc, timeout=600)
    assert code == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["restarts"]["rollout-0"] == 1 and summary["books"]["balanced"]
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r]
    assert rows[0]["staleness/max"] == 0 and rows[0]["mismatch/kl_k3"] < 1e-6, rows[0]  # fp32 SGLang == learner
    assert all(r["sync/seconds"] > 0 and r["sync/bytes"] > 0 for r in rows), rows
    # a stale batch's kl_k3 also holds the policy's drift over its staleness (0.036 at 2 versions here, above 0.1
    # once under CI load), so parity is checked on every batch without staleness: step 1 and, when the restart
    # left the learner waiting on an empty buffer, the restarted server's first batch
    assert all(r["mismatch/kl_k3"] < 1e-6 for r in rows if r["staleness/max"] == 0), rows


def test_qurl_async_with_sglang_int8_pushes_through_our_loader(demo_dir, tmp_path):
    """INT8 rollout on SGLang (stand-in matmul, bf16): full and delta pushes through the custom loader."""
    from launch import finish, start

    from qurl.outputs.report import read_metrics

    run_dir = tmp_path / "sgl-int8"
    code, out = finish(
        start(demo_dir, run_dir, 3, "rollout.engine=sglang", "rollout.quant=int8", "rollout.dtype=bfloat16"),
        timeout=600,
    )
    assert code == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["books"]["balanced"]
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r]
    assert [r["sync/delta"] for r in rows] == [0, 1, 1]
    assert rows[0]["mismatch/kl_k3"] < 0.05, rows[0]  # bf16 weight-only INT8 sampler against the fp32 learner
    server_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "applied delta weights version 3" in server_log and "'weight_checksum_mismatches': 0" in server_log


def test_the_gpu_check_script_rehearses_every_step_on_cpu(tmp_path):
    """benchmarks/gpu_check_sglang.py --device cpu: the GPU check's own code, every scheme and transport, here."""
    import subprocess
    import sys

    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check_sglang.py", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), proc.stderr[-3000:]
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "fp8-block", "int8"}
    for scheme, row in rows.items():
        assert row["passed"] and "error" not in row, row
        assert row["cuda_ipc_tokens_equal"] and row["in_flight_versions"] == [2, 3], row
    assert rows["none"]["nccl_tokens_equal"] and rows["fp8-block"]["nccl_tokens_equal"]  # over gloo here
    assert proc.returncode == 0
