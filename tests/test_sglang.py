"""The SGLang engine adapter, its INT8 loader and the SGLang weight payloads.

Tests of our own logic run everywhere. Tests marked `needs_sglang` run against the real sglang 0.5.23 package,
on CPU, in the venv made by scripts/setup_sglang_cpu.sh (SGLang's own ServerArgs resolution, request
normalisation, FlattenedTensorBucket, MultiprocessingSerializer, W8A8Int8LinearMethod / Fp8LinearMethod layers at
TP 2 and 4, WeightUpdater's flattened-bucket receive over gloo). The running engine: tests/test_sglang_engine.py.
"""

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qurl.quant import quantize_int8, quantize_state_dict
from qurl.wire import sglang_payload as payload
from qurl.wire.protocol import WeightRef
from rollout_server.engines import GenRequest, load_engine
from rollout_server.engines import sglang_args as sargs
from rollout_server.engines import sglang_engine as se
from rollout_server.engines.sglang_int8_loader import LOADER_PATH, split

ROOT = Path(__file__).resolve().parents[1]
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(not HAVE_SGLANG, reason="sglang not installed (scripts/setup_sglang_cpu.sh)")


# -- helpers ------------------------------------------------------------------------------------------


def layer_tensors(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, seed: int = 0):
    """Full-precision HF-named projection weights of one decoder layer."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    return {f"{prefix}.{k}.weight": torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}


def rank_slice(name: str, t: torch.Tensor, rank: int, tp: int, kv_heads: int):
    """This TP rank's part of a full HF tensor or scale: rows for column-parallel, columns for row-parallel."""
    if "o_proj" in name or "down_proj" in name:
        if t.shape[1] == 1:  # a per-row scale is not split by row parallelism
            return t
        cols = t.shape[1] // tp
        return t[:, rank * cols : (rank + 1) * cols]
    if "k_proj" in name or "v_proj" in name:
        replicas = max(1, tp // kv_heads)
        parts = min(tp, kv_heads)
        index = rank // replicas
    else:
        parts, index = tp, rank
    rows = t.shape[0] // parts
    return t[index * rows : (index + 1) * rows]


@pytest.fixture(scope="module")
def sg():
    """Import sglang for the tests below."""
    pytest.importorskip("sglang")
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        pytest.skip("SGLANG_USE_CPU_ENGINE=1 selects SGLang's AMX path; these tests check the CUDA layouts")
    import sglang

    assert sglang.__version__ == se.SGLANG_VERSION
    return sglang


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny bf16 Qwen2 folder (config.json + safetensors) for ServerArgs and ModelConfig resolution."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-qwen2")
    cfg = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


# -- our own logic (runs without sglang) --------------------------------------------------------------


def test_request_dict_sets_every_sampling_field():
    req = GenRequest(
        prompt_ids=[5, 6, 7],
        n=4,
        max_new_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        stop_token_ids=[2, 3],
        seed=11,
    )
    d = se.request_dict(req)
    assert d == {
        "input_ids": [5, 6, 7],
        "return_logprob": True,
        "sampling_params": {
            "n": 4,
            "max_new_tokens": 9,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "stop_token_ids": [2, 3],
        },
    }
    assert se.request_dict(GenRequest(prompt_ids=[1]))["sampling_params"]["max_new_tokens"] == 256


def test_parse_output_expands_version_spans_per_token():
    meta = {
        "finish_reason": {"type": "stop", "matched": 2},
        "weight_version": "7",
        "weight_versions": [{"version": "6", "start": 0, "end": 3}, {"version": "7", "start": 3, "end": 5}],
        "output_token_logprobs": [
            (-0.5, 10, None),
            (-1.0, 11, None),
            (-0.1, 12, None),
            (-2.0, 13, None),
            (-0.3, 2, None),
        ],
    }
    s = se.parse_output({"output_ids": [10, 11, 12, 13, 2], "meta_info": meta})
    assert s.token_ids == [10, 11, 12, 13, 2] and s.logprobs == [-0.5, -1.0, -0.1, -2.0, -0.3]
    assert s.versions == [6, 6, 6, 7, 7] and s.finish_reason == "stop"
    meta = {
        "finish_reason": {"type": "length", "length": 2},
        "weight_version": "3",
        "output_token_logprobs": [(-0.5, 10, None), (-1.0, 11, None)],
    }
    assert se.parse_output({"meta_info": meta}).versions == [3, 3]


def test_parse_output_refuses_aborts_and_bad_versions():
    with pytest.raises(RuntimeError, match="did not finish"):
        se.parse_output(
            {
                "meta_info": {
                    "finish_reason": {"type": "abort", "message": "oom"},
                    "weight_version": "0",
                    "output_token_logprobs": [],
                }
            }
        )
    with pytest.raises(ValueError, match="weight_version='0'"):
        se.parse_output(
            {
                "meta_info": {
                    "finish_reason": {"type": "length"},
                    "weight_version": "default",
                    "output_token_logprobs": [(-1.0, 4, None)],
                }
            }
        )
    with pytest.raises(ValueError, match="do not cover"):
        se.token_versions({"weight_versions": [{"version": "1", "start": 0, "end": 1}]}, 2)


def test_engine_args_per_scheme_and_gpu_placement():
    common = dict(dtype="bfloat16", tp_size=2, max_batch=32, max_seq_len=1024, seed=3)
    int8 = sargs.engine_args("/m", scheme="int8", gpus=[2, 3], **common)
    assert int8["quantization"] == "w8a8_int8" and int8["custom_weight_loader"] == [LOADER_PATH]
    assert (int8["dp_size"], int8["tp_size"], int8["base_gpu_id"], int8["gpu_id_step"]) == (1, 2, 2, 1)
    assert int8["skip_tokenizer_init"] and int8["load_format"] == "dummy" and int8["weight_version"] == "0"
    assert (int8["context_length"], int8["max_running_requests"], int8["random_seed"]) == (1024, 32, 3)
    fp8 = sargs.engine_args("/m", scheme="fp8-block", gpus=[0, 2], **common)
    assert fp8["quantization"] == "fp8" and fp8["gpu_id_step"] == 2
    assert json.loads(fp8["json_model_override_args"])["quantization_config"]["weight_block_size"] == [128, 128]
    none = sargs.engine_args("/m", scheme="none", gpus=[4, 5], **common)
    assert "quantization" not in none and "load_format" not in none
    with pytest.raises(ValueError, match="fp8-channel"):
        sargs.engine_args("/m", scheme="fp8-channel", gpus=[0, 1], **common)
    with pytest.raises(ValueError, match="evenly spaced"):
        sargs.engine_args("/m", scheme="int8", gpus=[3, 1], **common)
    assert sargs.replica_gpus([0, 1, 2, 3], 2, 1) == [2, 3] and sargs.replica_gpus([4, 5, 6, 7], 1, 3) == [7]
    with pytest.raises(ValueError, match="no 2 GPUs for rollout replica 2"):
        sargs.replica_gpus([0, 1, 2, 3], 2, 2)


def test_named_tensors_checks_codes_and_scales():
    w = {"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 130), "model.norm.weight": torch.ones(130)}
    q = quantize_state_dict(w, "fp8-block")
    assert [n for n, _ in payload.named_tensors(q, "fp8-block")] == list(q)
    assert q["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)
    bad = dict(q, **{"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 1)})
    with pytest.raises(ValueError, match=r"weight_scale_inv: need float32 \(2, 2\)"):
        payload.named_tensors(bad, "fp8-block")
    with pytest.raises(ValueError, match="weight must be 2-D torch.int8"):
        payload.named_tensors(q, "int8")
    with pytest.raises(ValueError, match="no SGLang refit"):
        payload.named_tensors(quantize_state_dict(w, "fp8-channel"), "fp8-channel")
    orphan = {"model.layers.0.mlp.up_proj.weight_scale": torch.ones(4, 1)}
    with pytest.raises(ValueError, match="scale without its weight"):
        payload.named_tensors(orphan, "int8")


def test_buckets_cap_size_keep_pairs_and_align_offsets():
    tensors = quantize_state_dict(
        {
            **layer_tensors("model.layers.0", 64, 4, 2, 16, 96),
            "model.norm.weight": torch.ones(63, dtype=torch.bfloat16),
            "model.embed_tokens.weight": torch.randn(37, 64),
        },
        "int8",
    )
    named = payload.named_tensors(tensors, "int8")
    cap = 10_000
    bs = payload.buckets(named, cap)
    assert sorted(n for b in bs for n, _ in b) == sorted(tensors) and len(bs) > 2
    for b in bs:
        names = {n for n, _ in b}
        assert all(n + "_scale" in names for n in names if n.endswith("proj.weight"))
        nbytes = sum(t.numel() * t.element_size() for _, t in b)
        assert nbytes <= cap or len(names) <= 2
        flat = payload.flatten(b)
        assert flat.dtype == torch.uint8 and flat.numel() == nbytes
        offset = 0
        for name, t in b:  # the bytes of each tensor sit at an offset aligned to its itemsize
            assert offset % t.element_size() == 0
            back = flat[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            assert torch.equal(back, t), name
            offset += t.numel() * t.element_size()
    with pytest.raises(ValueError, match="multiple of"):
        payload.flatten([("a", torch.ones(3, dtype=torch.int8)), ("b", torch.ones(2))])
    names, dtypes, shapes = payload.bucket_meta(bs[0])
    assert dtypes[0] in ("float32", "int8", "bfloat16") and shapes[0] == list(bs[0][0][1].shape)
    assert payload.update_group_layout(4, 2) == (9, [1, 3, 5, 7])


def test_pushes_are_checked_against_the_checkpoint(tiny_model):
    from safetensors.torch import load_file

    sd = load_file(str(Path(tiny_model) / "model.safetensors"))
    for scheme in ("none", "int8", "fp8-block"):
        expected = se.expected_tensors(tiny_model, scheme)
        push = quantize_state_dict(sd, scheme)
        se.check_push(expected, push)  # exactly the learner's push passes
        se.check_push(
            expected,
            {
                k: v.float()
                for k, v in push.items()
                if v.is_floating_point() and "scale" not in k and not k.endswith("proj.weight")
            },
            partial=True,
        )  # any float dtype for the rest
    expected = se.expected_tensors(tiny_model, "int8")
    push = quantize_state_dict(sd, "int8")
    with pytest.raises(ValueError, match="missing tensor 'model.embed_tokens.weight'"):
        se.check_push(expected, {k: v for k, v in push.items() if k != "model.embed_tokens.weight"})
    with pytest.raises(ValueError, match="tied embeddings"):
        se.check_push(expected, dict(push, **{"lm_head.weight": sd["model.embed_tokens.weight"]}))
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=f"{name} is torch.bfloat16 .* the engine loads torch.int8"):
        se.check_push(expected, dict(push, **{name: sd[name]}))
    with pytest.raises(
        ValueError, match="weight_scale is torch.float32 \\(256, 1\\), the engine loads torch.float32 \\(512, 1\\)"
    ):
        se.check_push(expected, {"model.layers.0.mlp.gate_proj.weight_scale": torch.ones(256, 1)}, partial=True)


def test_int8_loader_split_quantizes_bf16_and_passes_the_rest():
    w = layer_tensors("model.layers.0", 64, 4, 2, 16, 96)
    q = quantize_state_dict(w, "int8")
    named = list(q.items()) + [("model.norm.weight", torch.ones(64))]
    linears, rest = split(named)
    assert set(linears) == set(w) and rest == [("model.norm.weight", named[-1][1])]
    name = "model.layers.0.mlp.up_proj.weight"
    from_bf16, _ = split([(name, w[name].to(torch.bfloat16))])
    codes, scale = quantize_int8(w[name].to(torch.bfloat16))
    assert torch.equal(from_bf16[name][0], codes) and torch.equal(from_bf16[name][1], scale)
    with pytest.raises(ValueError, match="need model.layers.0.mlp.up_proj.weight_scale"):
        split([(name, q[name])])
    with pytest.raises(ValueError, match="computed here"):
        split([(name, w[name]), (name + "_scale", q[name + "_scale"])])


def test_load_engine_without_sglang_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` now fails, as where it is not installed
    with pytest.raises(ValueError) as info:
        load_engine("/nonexistent", engine="sglang", quant="int8", dtype="bfloat16", device="cuda")
    assert str(info.value) == se.INSTALL_HINT and "\n" not in str(info.value)
    assert "`sglang` extra" in str(info.value) and "GPU node" in str(info.value)


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory):
    """A demo folder (tokenizer, model, prompts) from one warm-start step: all a server needs to start."""
    from qurl.demo.prepare import Recipe, prepare

    root = tmp_path_factory.mktemp("demo")
    threads = torch.get_num_threads()
    prepare(root, Recipe(max_steps=1, train_size=256, heldout_size=16, dev_size=16), threads=1, progress=False)
    torch.set_num_threads(threads)
    return root


@pytest.mark.skipif(HAVE_SGLANG, reason="checks the start of a server where sglang is absent")
def test_rollout_server_with_sglang_engine_fails_at_start_with_one_line(small_demo):
    demo_dir = small_demo
    server = str(Path(sys.executable).parent / "qurl-rollout-server")
    out = subprocess.run(
        [
            server,
            "--config",
            str(ROOT / "configs/demo-cpu.yaml"),
            f"model.path={demo_dir / 'model'}",
            f"data.train_files=[{demo_dir / 'train.jsonl'}]",
            "data.eval_files=[]",
            "rollout.engine=sglang",
            "rollout.dtype=bfloat16",
            "transport.trajectories=tcp://127.0.0.1:9",
            "transport.weights=tcp://127.0.0.1:9",
            "transport.control=tcp://127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2  # EXIT_INPUT: qurl-async does not restart it
    assert out.stderr.strip() == f"qurl-rollout-server: {se.INSTALL_HINT}"


# -- against the real sglang 0.5.23 (CPU) --------------------------------------------------------------


@needs_sglang
@pytest.mark.parametrize("scheme,tp", [("int8", 1), ("fp8-block", 2), ("none", 2)])
def test_engine_args_resolve_to_a_valid_server_args(sg, tiny_model, scheme, tp):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _get_quantization_config
    from sglang.srt.server_args import ServerArgs

    args = sargs.engine_args(
        tiny_model,
        scheme=scheme,
        dtype="bfloat16",
        tp_size=tp,
        gpus=list(range(2, 2 + tp)),
        max_batch=16,
        max_seq_len=512,
        seed=1,
    )
    sa = ServerArgs(**args)
    sa.resolve_once()  # SGLang's whole resolution pipeline: hooks, model config, validation
    got = sa.resolved_dict()
    assert (got["tp_size"], got["dp_size"], got["base_gpu_id"], got["skip_tokenizer_init"]) == (tp, 1, 2, True)
    assert got["weight_version"] == "0" and got["context_length"] == 512 and got["max_running_requests"] == 16
    quant = _get_quantization_config(ModelConfig.from_server_args(sa), LoadConfig(load_format=sa.load_format))
    if scheme == "int8":
        assert type(quant).__name__ == "W8A8Int8Config" and got["custom_weight_loader"] == [LOADER_PATH]
    elif scheme == "fp8-block":
        assert type(quant).__name__ == "Fp8Config" and quant.weight_block_size == [128, 128]
    else:
        assert quant is None
    with pytest.raises(TypeError):
        ServerArgs(**args, not_a_server_arg=1)


@needs_sglang
def test_request_dicts_pass_sglang_normalisation(sg):
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import TOP_K_ALL, SamplingParams

    for req in (
        GenRequest(
            prompt_ids=[5, 6, 7], n=4, max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[2, 3]
        ),
        GenRequest(prompt_ids=[5], n=1, max_new_tokens=3, temperature=0.0),
        GenRequest(prompt_ids=[1, 2], n=2, max_new_tokens=5, top_k=-1),
    ):
        obj = GenerateReqInput(**se.request_dict(req))
        obj.normalize_batch_and_arguments()
        assert obj.parallel_sample_num == req.n
        copies = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
        assert len(copies) == (req.n if req.n > 1 else 1)
        rl = obj.return_logprob if isinstance(obj.return_logprob, list) else [obj.return_logprob]
        assert all(rl)
        sp = SamplingParams(**copies[0])
        sp.verify(vocab_size=300)
        sp.normalize(None)  # skip_tokenizer_init: no tokenizer
        assert sp.max_new_tokens == req.max_new_tokens and sp.n == req.n
        assert sp.stop_token_ids == (set(req.stop_token_ids) or None)
        if req.temperature == 0:
            assert sp.top_k == 1  # SGLang's greedy
        else:
            assert sp.temperature == req.temperature and sp.top_p == req.top_p
            assert sp.top_k == (TOP_K_ALL if req.top_k == -1 else req.top_k)


@needs_sglang
def test_parse_output_reads_sglang_built_meta_info(sg):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN
    from sglang.srt.utils.weight_versions import (
        WeightVersionEvent,
        add_weight_versions_to_meta_info,
        compute_weight_version_spans,
    )

    tokens = [(-0.25, 9, None), (-1.5, 4, None), (-0.75, 8, None), (-0.5, 2, None)]
    # a request that saw two updates: 3 -> 4 after its first token, 4 -> 5 after its third
    spans = compute_weight_version_spans([WeightVersionEvent("3", 1), WeightVersionEvent("4", 3)], "5", 4)
    meta = {
        "finish_reason": FINISH_MATCHED_TOKEN(matched=2).to_json(),
        "weight_version": "5",
        "output_token_logprobs": tokens,
    }
    add_weight_versions_to_meta_info(meta, spans, num_output_tokens=4)
    s = se.parse_output({"output_ids": [9, 4, 8, 2], "meta_info": meta})
    assert s.versions == [3, 4, 4, 5] and s.token_ids == [9, 4, 8, 2] and s.finish_reason == "stop"
    meta = {"finish_reason": FINISH_LENGTH(length=4).to_json(), "weight_version": "2", "output_token_logprobs": tokens}
    assert se.parse_output({"meta_info": meta}).versions == [2, 2, 2, 2]


@needs_sglang
def test_payloads_round_trip_through_sglang_buckets_and_serializer(sg):
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    full = {
        **layer_tensors("model.layers.0", 256, 4, 2, 64, 384),
        "model.norm.weight": torch.ones(256),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(256, dtype=torch.bfloat16),
    }
    for scheme in ("fp8-block", "int8"):
        named = payload.named_tensors(quantize_state_dict(full, scheme), scheme)
        bs = payload.buckets(named, 200_000)
        assert len(bs) > 1
        for bucket in bs:
            # the learner's flat buffer is byte-identical to SGLang's own flattening
            ours = payload.flatten(bucket)
            assert torch.equal(ours, FlattenedTensorBucket(named_tensors=bucket).get_flattened_tensor())
            # distributed receive: SGLang allocates from our metadata, the broadcast fills it with our bytes
            names, dtypes, shapes = payload.bucket_meta(bucket)
            rx = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
            rx.get_flattened_tensor().copy_(ours)
            assert_same(rx.reconstruct_tensors(), bucket)
            # tensor path: flattened bucket and named pairs, each through SGLang's allow-list unpickler
            for blob in payload.serialize_flattened(bucket, tp_size=2):
                got = MultiprocessingSerializer.deserialize(blob)
                fb = FlattenedTensorBucket(flattened_tensor=got["flattened_tensor"], metadata=got["metadata"])
                assert_same(fb.reconstruct_tensors(), bucket)
            blobs = payload.serialize_named(bucket, tp_size=2)
            assert len(blobs) == 2
            assert_same(MultiprocessingSerializer.deserialize(blobs[1]), bucket)


def assert_same(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


# Geometry shared by the layer tests: 4 heads / 2 kv heads (kv replicated at tp 4), head dim 16
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 128
PREFIX = "model.layers.0"


def sglang_layer(
    quant_config, tp: int, rank: int, hidden=HIDDEN, heads=HEADS, kv=KV_HEADS, head_dim=HEAD_DIM, inter=INTER
):
    """One decoder layer's projections built from SGLang's own layer classes, named as SGLang's Qwen2 names them."""
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from sglang.srt.runtime_context import get_parallel

    dtype = torch.bfloat16
    with get_parallel().override(tp_size=tp, tp_rank=rank):
        attn, mlp = torch.nn.Module(), torch.nn.Module()
        attn.qkv_proj = QKVParallelLinear(
            hidden,
            head_dim,
            heads,
            kv,
            bias=False,
            quant_config=quant_config,
            prefix=f"{PREFIX}.self_attn.qkv_proj",
            params_dtype=dtype,
        )
        attn.o_proj = RowParallelLinear(
            heads * head_dim,
            hidden,
            bias=False,
            quant_config=quant_config,
            prefix=f"{PREFIX}.self_attn.o_proj",
            params_dtype=dtype,
        )
        mlp.gate_up_proj = MergedColumnParallelLinear(
            hidden,
            [inter, inter],
            bias=False,
            quant_config=quant_config,
            prefix=f"{PREFIX}.mlp.gate_up_proj",
            params_dtype=dtype,
        )
        mlp.down_proj = RowParallelLinear(
            inter, hidden, bias=False, quant_config=quant_config, prefix=f"{PREFIX}.mlp.down_proj", params_dtype=dtype
        )
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    model, decoder = torch.nn.Module(), torch.nn.Module()
    decoder.layers = torch.nn.ModuleList([layer])
    model.model = decoder
    return model


def int8_engine_state(model):
    """What an INT8 engine holds for the layer: full [N, K] int8 and [N] scales from its kernel-layout storage."""
    out = {}
    for name, m in model.named_modules():
        if type(getattr(m, "quant_method", None)).__name__ == "W8A8Int8LinearMethod":
            out[name] = (m.weight.t().contiguous(), m.weight_scale.detach().clone())
    return out


def expected_int8_shard(q, rank, tp):
    """The local int8 storage a rank must hold: SGLang's fused order q|k|v and gate|up, TP slices of each."""

    def part(proj, what):
        name = f"{PREFIX}.{proj}.weight" + ("_scale" if what == "scale" else "")
        return rank_slice(name, q[name], rank, tp, KV_HEADS)

    out = {}
    for fused, projs in (
        ("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]),
        ("self_attn.o_proj", ["self_attn.o_proj"]),
        ("mlp.down_proj", ["mlp.down_proj"]),
    ):
        out[f"{PREFIX}.{fused}"] = (
            torch.cat([part(p, "w") for p in projs]),
            torch.cat([part(p, "scale") for p in projs]),
        )
    return out


@pytest.fixture(scope="module")
def int8_context(sg, tiny_model):
    """Runtime context made from our INT8 engine arguments at a TP size, as each SGLang scheduler process has one."""
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import ServerArgs

    def make(tp: int):
        sa = ServerArgs(
            **sargs.engine_args(
                tiny_model,
                scheme="int8",
                dtype="bfloat16",
                tp_size=tp,
                gpus=list(range(tp)),
                max_batch=8,
                max_seq_len=256,
            )
        )
        sa.resolve_once()
        return create_context(sa, role="test")

    return make


@pytest.fixture
def sglang_reducers():
    """SGLang's receiver patches torch's tensor reducers process-wide (then CPU tensors cannot be pickled); undo it."""
    from torch.multiprocessing import reductions

    yield
    if hasattr(reductions, "_reduce_tensor_original"):
        with pytest.raises(ValueError, match="cannot pickle CPU tensors"):
            payload.serialize_named([("x", torch.ones(1))], 1)
        reductions.reduce_tensor = reductions._reduce_tensor_original
        reductions.rebuild_cuda_tensor = reductions._rebuild_cuda_tensor_original
        del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
        reductions.init_reductions()


@needs_sglang
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_int8_loader_refits_sglang_w8a8_layers_through_its_weight_updater(sg, int8_context, sglang_reducers, tp):
    """begin_weight_update -> update_weights_from_tensor(load_format=our loader) -> end_weight_update, as SGLang runs
    them on each TP rank, twice; after each step the int8 storage equals qurl.quant.quantize_int8 of the weights."""
    from sglang.srt.layers.quantization.w8a8_int8 import W8A8Int8Config
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.runtime_context import get_parallel, use_context
    from sglang.srt.utils import MultiprocessingSerializer

    from rollout_server.engines.sglang_int8_loader import is_kernel_layout

    pushes = []  # serialized up front: in one process the receiver's patched reducers would follow the sender
    for version, seed in ((1, 1), (2, 2)):
        full = layer_tensors(PREFIX, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, seed=seed)
        if version == 2:  # bf16 weights: the loader quantizes them with qurl.quant.quantize_int8
            full = {n: t.to(torch.bfloat16) for n, t in full.items()}
        pushed = quantize_state_dict(full, "int8") if version == 1 else full
        request = se.tensor_update_request(
            payload.serialize_named(list(pushed.items()), tp), LOADER_PATH, last=True, version=version
        )
        assert request.load_format == LOADER_PATH and request.weight_version == str(version)
        pushes.append((request, quantize_state_dict(full, "int8")))
    context = int8_context(tp)
    for rank in range(tp):
        model = sglang_layer(W8A8Int8Config({}), tp, rank)
        for m in model.modules():  # startup: dummy int8 weights, then SGLang's own post-processing (transpose)
            if hasattr(m, "weight_scale"):
                m.weight.data.random_(-127, 128)
                m.weight_scale.data.uniform_(0.001, 0.01)
        DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
        layers = [m for m in model.modules() if hasattr(m, "weight_scale")]
        assert len(layers) == 4 and all(is_kernel_layout(m) for m in layers)
        storage = [(m.weight.data_ptr(), m.weight_scale.data_ptr()) for m in layers]
        updater = WeightUpdater(
            tp_rank=rank,
            device="cpu",
            gpu_id=0,
            model_config=None,
            custom_weight_loaders=[LOADER_PATH],
            get_model=lambda: model,
            update_model_fields=None,
            recapture_cuda_graph=None,
            get_model_runner=None,
        )
        for request, reference in pushes:  # the second refit meets the first one's state
            want = expected_int8_shard(reference, rank, tp)
            with use_context(context), get_parallel().override(tp_rank=rank):
                updater.begin_weight_update()
                named = MultiprocessingSerializer.deserialize(request.serialized_named_tensors[rank])
                assert updater.update_weights_from_tensor(named_tensors=named, load_format=request.load_format) == (
                    True,
                    "Success",
                )
                check_int8(model, want, "before end_weight_update")
                updater.end_weight_update(run_post_load=False)  # re-runs process_weights_after_loading
            check_int8(model, want, "after end_weight_update")
            assert all(is_kernel_layout(m) for m in layers)
            assert [(m.weight.data_ptr(), m.weight_scale.data_ptr()) for m in layers] == storage


def check_int8(model, want, when):
    got = int8_engine_state(model)
    assert set(got) == set(want)
    for name, (codes, scale) in want.items():
        assert torch.equal(got[name][0], codes), f"{name} codes {when}"
        assert torch.equal(got[name][1], scale), f"{name} scales {when}"


@needs_sglang
def test_stock_w8a8_post_processing_transposes_again(sg):
    """The trap the loader exists for: without pinning, end_weight_update's re-run flips the int8 layout."""
    from sglang.srt.layers.quantization.w8a8_int8 import W8A8Int8Config
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from rollout_server.engines.sglang_int8_loader import is_kernel_layout

    model = sglang_layer(W8A8Int8Config({}), 1, 0)
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert is_kernel_layout(qkv) and not hasattr(qkv.weight, "weight_loader")
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
    assert not is_kernel_layout(qkv) and tuple(qkv.weight.shape) == ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)


@needs_sglang
def test_fp8_block_payload_refits_sglang_fp8_layers_in_place(sg):
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.runtime_context import get_parallel

    from rollout_server.engines.sglang_int8_loader import FUSED

    tp, hidden, heads, kv, head_dim, inter = 2, 256, 4, 2, 128, 256  # every TP shard a multiple of 128
    cfg = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
    for rank in range(tp):
        model = sglang_layer(cfg, tp, rank, hidden, heads, kv, head_dim, inter)
        for refit, seed in enumerate((5, 6)):
            pushed = quantize_state_dict(layer_tensors(PREFIX, hidden, heads, kv, head_dim, inter, seed), "fp8-block")
            with get_parallel().override(tp_size=tp, tp_rank=rank):
                for name, t in payload.named_tensors(pushed, "fp8-block"):  # what Qwen2.load_weights does per tensor
                    base = name.rsplit(".", 1)[0]
                    proj = base.rpartition(".")[2]
                    fused, shard = FUSED.get(proj, (proj, None))
                    module = model.get_submodule(base.rpartition(".")[0] + "." + fused)
                    param = getattr(module, name.rsplit(".", 1)[1])
                    args = (param, t) if shard is None else (param, t, shard)
                    param.weight_loader(*args)
            if refit == 0:
                for m in model.modules():
                    if hasattr(m, "weight_scale_inv"):
                        m.quant_method.process_weights_after_loading(m)
                storage = {n: p.data_ptr() for n, p in model.named_parameters()}
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage
            for fused, projs in (
                ("self_attn.qkv_proj", ["q_proj", "k_proj", "v_proj"]),
                ("mlp.gate_up_proj", ["gate_proj", "up_proj"]),
                ("self_attn.o_proj", ["o_proj"]),
                ("mlp.down_proj", ["down_proj"]),
            ):
                m = model.get_submodule(f"{PREFIX}.{fused}")
                group = fused.split(".")[0]
                names = [f"{PREFIX}.{group}.{p}.weight" for p in projs]
                codes = torch.cat([rank_slice(n, pushed[n], rank, tp, kv) for n in names])
                scales = torch.cat([rank_slice(n, pushed[n + "_scale_inv"], rank, tp, kv) for n in names])
                assert torch.equal(m.weight.view(torch.uint8), codes.view(torch.uint8)), fused
                assert torch.equal(m.weight_scale_inv, scales), fused
                assert tuple(m.weight_scale_inv.shape) == (
                    math.ceil(m.weight.shape[0] / 128),
                    math.ceil(m.weight.shape[1] / 128),
                )


@needs_sglang
def test_learner_nccl_push_reaches_a_replica_through_sglang_distributed_receive(sg, tmp_path, weight_hub):
    """The learner's NcclTransport (gloo here, NCCL on GPUs) sends a WeightRef over ZeroMQ and broadcasts the buckets,
    at most sync.buckets_in_flight queued at once; in another process a TP-1 replica decodes the ref and SGLang's own
    WeightUpdater receives every bucket."""
    from learner.weight_sync import NcclTransport

    hub = weight_hub
    endpoint = hub.endpoint
    pushed = quantize_state_dict(layer_tensors(PREFIX, 256, 4, 2, 64, 384), "fp8-block")
    port = _free_port()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"port": port, "weights": endpoint}))
    out = tmp_path / "received.pt"
    child = subprocess.Popen([sys.executable, __file__, "--replica", str(spec), str(out)])
    try:
        push = NcclTransport(
            hub.pub,
            "fp8-block",
            torch.device("cpu"),
            f"tcp://127.0.0.1:{port}",
            replicas=1,
            tp_size=1,
            bucket_bytes=200_000,
        )
        push.open()  # returns once the replica has joined (it subscribed to the weights first)
        time.sleep(0.5)  # PUB/SUB: let the subscription land
        push.send(3, pushed)
        push.drain()  # the broadcasts run in a thread of their own; this returns once the replica took them all
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
    version, received = torch.load(out)
    bs = payload.buckets(payload.named_tensors(pushed, "fp8-block"), 200_000)
    assert version == 3 and len(received) == len(bs) > 1
    for got, bucket in zip(received, bs):
        assert_same(got, bucket)
    assert push.peak_queued == 2 < len(bs)  # never the whole push queued on the device


@needs_sglang
def test_the_nccl_group_waits_for_its_replicas_as_long_as_sync_group_timeout_s(sg, weight_hub):
    """Learner rank 0 joins with SGLang's init_custom_process_group; its wait is sync.group_timeout_s (SGLang's own
    default is 30 minutes, less than a first FP8 start may take): here 3 s with no replica, then a one-line error."""
    from learner.weight_sync import NcclTransport

    push = NcclTransport(
        weight_hub.pub, "fp8-block", torch.device("cpu"), f"tcp://127.0.0.1:{_free_port()}", 1, 1, timeout_s=3.0
    )
    started = time.monotonic()
    with pytest.raises(Exception) as info:
        push.open()
    assert 2.5 < time.monotonic() - started < 60, info.value


ORDERED_GROUP = "qurl-weights-ordered"


@needs_sglang
def test_a_replica_busy_while_two_nccl_versions_go_out_takes_each_in_order(sg, tmp_path, weight_hub):
    """Two versions announced back to back, their broadcasts queued, while a replica is busy (an evaluation): it
    applies both refs in version order through the server's WeightReceiver and SGLang's WeightUpdater, and ends on
    the newest version's bytes labelled with it (before, it applied only the newest ref and took the first version's
    broadcasts as the second's, one version behind for the rest of the run)."""
    import threading

    hub = weight_hub
    versions = {v: quantize_state_dict(layer_tensors(PREFIX, 256, 4, 2, 64, 384, seed=v), "fp8-block") for v in (3, 4)}
    port = _free_port()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"port": port, "weights": hub.endpoint, "pause_s": 3.0}))
    out = tmp_path / "received.pt"
    child = subprocess.Popen([sys.executable, __file__, "--ordered-replica", str(spec), str(out)])
    try:
        world, _ = payload.update_group_layout(1, 1)
        # a group name of its own: this process already holds the test above's group
        group = payload.open_update_group("127.0.0.1", port, world, ORDERED_GROUP, "gloo", timeout_s=120)
        time.sleep(0.5)  # PUB/SUB: let the subscription land
        buckets = {v: payload.buckets(payload.named_tensors(t, "fp8-block"), 200_000) for v, t in versions.items()}
        for v in (3, 4):  # both refs out before the replica reads either
            hub.pub.send(
                WeightRef(
                    version=v,
                    scheme="fp8-block",
                    transport="nccl",
                    buckets=[payload.bucket_meta(b) for b in buckets[v]],
                )
            )
        sender = threading.Thread(
            target=lambda: [payload.broadcast_buckets(buckets[v], group, "cpu") for v in (3, 4)], daemon=True
        )
        sender.start()
        assert child.wait(timeout=180) == 0
        sender.join(30)
    finally:
        if child.poll() is None:
            child.kill()
    version, received, applied = torch.load(out)
    assert version == 4 and applied == 2
    for v in (3, 4):
        assert len(received[v]) == len(buckets[v]) > 1
        for got, bucket in zip(received[v], buckets[v]):
            assert_same(got, bucket)


def _weights_subscriber(endpoint: str):
    """(context, receiver) of a replica's SUB socket on the learner's weights."""
    import zmq

    from qurl.wire import transport

    ctx = zmq.Context()
    sub = transport.connect(ctx, zmq.SUB, endpoint, max_bytes=1 << 30)
    return ctx, transport.Receiver(sub, secret=b"k", max_bytes=1 << 30, kinds=("weight_push", "weight_ref"))


def _joined_updater(port: int, group: str = payload.GROUP_NAME):
    """A TP-1 replica's SGLang WeightUpdater in its own (gloo) world, joined to the learner's update group."""
    import torch.distributed as dist
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)  # the replica's own (TP) world
    updater = WeightUpdater(
        tp_rank=0,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=None,
        update_model_fields=None,
        recapture_cuda_graph=None,
        get_model_runner=None,
    )
    world, offsets = payload.update_group_layout(1, 1)
    ok, msg = updater.init_weights_update_group(
        "127.0.0.1", port, rank_offset=offsets[0], world_size=world, group_name=group, backend="gloo"
    )
    assert ok, msg
    return updater


def _ordered_replica_main(spec_path: str, out_path: str) -> None:
    """Child side of the test above: join the group, stay busy while both refs arrive, then let the server's
    WeightReceiver apply what the SUB socket holds, over SGLang's own WeightUpdater."""

    from rollout_server.weight_receiver import WeightReceiver

    spec = json.loads(Path(spec_path).read_text())
    ctx, rx = _weights_subscriber(spec["weights"])
    updater = _joined_updater(spec["port"], ORDERED_GROUP)

    class Replica:  # the SGLangEngine surface the receiver uses for nccl refs, over SGLang's own WeightUpdater
        tp_size, version = 1, 0
        received: dict = {}

        def receive_broadcast(self, metas, version):
            self.received[version] = [
                [
                    (n, t.clone())
                    for n, t in updater.receive_weights_from_distributed(
                        names=n, dtypes=d, shapes=s, group_name=ORDERED_GROUP, load_format="flattened_bucket"
                    )
                ]
                for n, d, s in metas
            ]
            self.version = version

    time.sleep(spec["pause_s"])  # busy: both refs are waiting on the socket when it looks
    messages = []
    while len(messages) < 2:
        msg = rx.recv(timeout_ms=60_000)
        assert msg is not None
        messages.append(msg)
    replica = Replica()
    receiver = WeightReceiver(replica, "fp8-block", lambda: None)
    receiver.apply(messages)
    torch.save((replica.version, replica.received, receiver.counters["weight_pushes_applied"]), out_path)
    ctx.destroy(linger=0)


def _replica_main(spec_path: str, out_path: str) -> None:
    """Child side of the test above: subscribe, join the group with SGLang's WeightUpdater, receive per the ref."""

    from qurl.wire.protocol import WeightRef

    spec = json.loads(Path(spec_path).read_text())
    ctx, rx = _weights_subscriber(spec["weights"])
    updater = _joined_updater(spec["port"])
    ref = rx.recv(timeout_ms=60_000)
    assert isinstance(ref, WeightRef) and ref.transport == "nccl", ref
    received = [
        updater.receive_weights_from_distributed(
            names=n, dtypes=d, shapes=s, group_name=payload.GROUP_NAME, load_format="flattened_bucket"
        )
        for n, d, s in ref.buckets
    ]
    torch.save((ref.version, [[(name, t.clone()) for name, t in bucket] for bucket in received]), out_path)
    ctx.destroy(linger=0)


@needs_sglang
def test_learner_ipc_push_rewrites_its_buffers_and_payloads_open_in_sglang(sg, weight_hub):
    """IpcTransport (CPU tensors here, CUDA on GPUs): per-rank payloads of views into persistent buffers, sent as a
    WeightRef; SGLang's allow-list unpickler opens each as the pushed (name, tensor) pairs; a second push rewrites
    the same buffers once the servers report the first version."""
    import zmq
    from sglang.srt.utils import MultiprocessingSerializer

    from learner.servers import ServerInfo
    from learner.weight_sync import IpcTransport
    from qurl.wire import transport
    from qurl.wire.protocol import WeightRef
    from rollout_server.weight_receiver import WeightReceiver

    hub = weight_hub
    rx = transport.Receiver(
        transport.connect(hub.ctx, zmq.SUB, hub.endpoint, max_bytes=1 << 30),
        secret=b"k",
        max_bytes=1 << 30,
        kinds=("weight_ref",),
    )
    time.sleep(0.3)
    push = IpcTransport(
        hub.pub, "int8", torch.device("cpu"), ranks=4, servers=hub.servers, bucket_bytes=200_000, ack_timeout_s=0.2
    )
    sets = None
    for version, seed in ((1, 0), (2, 1), (3, 2)):
        pushed = quantize_state_dict(layer_tensors(PREFIX, 256, 4, 2, 64, 384, seed=seed), "int8")
        assert push.send(version, pushed) is not None
        sets = sets or [list(s) for s in push.sets]
        assert all(a is b for s, t in zip(sets, push.sets) for a, b in zip(s, t))  # rewritten, never reallocated
        assert push.versions == ([1, None], [1, 2], [3, 2])[version - 1]  # the two sets alternate
        ref = rx.recv(timeout_ms=5000)
        assert isinstance(ref, WeightRef) and ref.version == version and ref.ranks == 4
        opened = dict(pair for p in ref.payloads for pair in MultiprocessingSerializer.deserialize(p[3]))
        assert opened.keys() == pushed.keys()
        assert all(torch.equal(opened[k].view(torch.uint8), pushed[k].view(torch.uint8)) for k in pushed)
        hub.servers["rollout-0"] = ServerInfo(version, 0, 0, time.monotonic())  # as its heartbeat says
    # a server still on version 1 has yet to read set 1 (version 2): push 4 would overwrite it, so it is skipped
    hub.servers["rollout-0"] = ServerInfo(1, 0, 0, time.monotonic())
    before = [t.clone() for t in push.sets[1]]
    assert push.send(4, pushed) is None and push.skipped == 1 and push.versions == [3, 2]
    assert all(torch.equal(a, b) for a, b in zip(before, push.sets[1])) and rx.recv(timeout_ms=300) is None

    class Replica:  # the SGLangEngine surface the receiver uses; a live one needs CUDA (gpu_check_sglang.sh)
        tp_size, scheme, version = 2, "int8", 0

        def check_metas(self, metas):
            self.metas = metas

        def apply_serialized(self, payloads, version):
            self.got, self.version = (payloads, version), version

    replica = Replica()
    receiver = WeightReceiver(replica, "int8", lambda: None, replica=1)
    assert receiver.apply([ref]) and replica.got == ([p[2:4] for p in ref.payloads], 3) and replica.metas == ref.buckets
    replica.version = 0
    assert not WeightReceiver(replica, "int8", lambda: None, replica=2).apply([ref])  # replica 2 with tp 2: refused


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_context_past_the_models_positions_is_refused_at_start_and_the_recipes_fit():
    from transformers import Qwen2Config

    from qurl.config import get, load_config
    from rollout_server.main import check_context

    check_context(4096, Qwen2Config(max_position_embeddings=4096), "m")
    with pytest.raises(ValueError, match=r"rollout.max_seq_len=22528 exceeds the 4096 positions"):
        check_context(22528, Qwen2Config(max_position_embeddings=4096), "m")
    yarn = Qwen2Config(max_position_embeddings=4096, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    check_context(16384, yarn, "m")
    # the base models' max_position_embeddings (their Hugging Face config.json), which SGLang enforces
    positions = {"configs/dapo-7b-fp8.yaml": 4096, "configs/deepscaler-1.5b-int8.yaml": 131072}
    for recipe, limit in positions.items():
        cfg = load_config(str(ROOT / recipe), check_paths=False)
        assert get(cfg, "rollout.max_seq_len") <= limit, recipe
        assert get(cfg, "data.max_prompt_len") + get(cfg, "rollout.sampling.max_new_tokens") <= get(
            cfg, "rollout.max_seq_len"
        ), recipe


def test_fp8_refits_are_refused_off_hopper_and_logprob_switches_are_refused():
    assert sargs.fp8_refit_problem((9, 0)) is None
    for cap, why in (((10, 0), "DeepGEMM"), ((12, 0), "DeepGEMM"), ((8, 9), "Marlin"), ((8, 0), "Marlin")):
        problem = sargs.fp8_refit_problem(cap)
        assert why in problem and f"SM{cap[0]}{cap[1]}" in problem and "\n" not in problem
    common = dict(dtype="bfloat16", tp_size=1, gpus=[0], max_batch=8, max_seq_len=64)
    with pytest.raises(ValueError, match="rl_on_policy_target"):
        sargs.engine_args("/m", scheme="none", server_args={"rl_on_policy_target": "fsdp"}, **common)
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    try:
        with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
            sargs.engine_args("/m", scheme="none", **common)
    finally:
        del os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"]
    with pytest.raises(ValueError, match="bfloat16"):
        sargs.engine_args("/m", scheme="int8", **{**common, "dtype": "float32"})


def test_server_args_merge_into_the_fp8_override_and_loader_lists():
    common = dict(dtype="bfloat16", tp_size=1, gpus=[0], max_batch=8, max_seq_len=64)
    args = sargs.engine_args(
        "/m",
        scheme="fp8-block",
        server_args={
            "json_model_override_args": json.dumps({"rope_theta": 1e6}),
            "custom_weight_loader": ["my.loader"],
            "cuda_graph_max_bs_decode": 8,
        },
        **common,
    )
    assert json.loads(args["json_model_override_args"]) == {
        "rope_theta": 1e6,
        "quantization_config": sargs.FP8_BLOCK_CONFIG,
    }
    assert args["custom_weight_loader"] == [se.FP8_LOADER_PATH, "my.loader"] and args["cuda_graph_max_bs_decode"] == 8
    cpu = sargs.engine_args("/m", scheme="none", **{**common, "gpus": None, "dtype": "float32"})
    assert (cpu["device"], cpu["attention_backend"], cpu["disable_cuda_graph"]) == ("cpu", "torch_native", True)
    assert cpu["max_total_tokens"] == 8 * 64 and "base_gpu_id" not in cpu
    with pytest.raises(ValueError, match="JSON object"):
        sargs.engine_args("/m", scheme="none", server_args={"json_model_override_args": "[1]"}, **common)


if __name__ == "__main__" and sys.argv[1:2] == ["--replica"]:
    _replica_main(sys.argv[2], sys.argv[3])
if __name__ == "__main__" and sys.argv[1:2] == ["--ordered-replica"]:
    _ordered_replica_main(sys.argv[2], sys.argv[3])
