"""Embedded torch engine: fp32 parity with transformers under continuous batching, sampling, seeds,
in-place weight updates, sharded loading and error messages.

QURL_TEST_DEVICE=cuda runs the same checks on a GPU.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from rollout_server.engines import GenRequest, load_engine, run_to_completion
from rollout_server.engines.sampling import sample
from rollout_server.engines.torch_engine import TorchEngine

DEVICE = os.environ.get("QURL_TEST_DEVICE", "cpu")
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=101,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
FAMILIES = {
    "qwen2": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),  # q/k/v biases, tied lm_head
    "llama": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False),
    "llama3": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
    # q/k norms, and head_dim != hidden / heads
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=False),
}
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [14], [20, 21, 22, 23, 24]]


def build_model(family: str, path, seed: int = 0, std: float = 0.15):
    """Random-init HF model with weights large enough that next-token distributions are peaked."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 2 * std if p.dim() == 1 else std)
    model.save_pretrained(path, safe_serialization=True)
    return AutoModelForCausalLM.from_pretrained(path).eval().to(DEVICE)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), build_model(request.param, path)


def teacher_forced(model, prompt, tokens, temperature=1.0):
    """HF logprobs of `tokens` following `prompt`, log_softmax(logits / T)."""
    ids = torch.tensor([prompt + tokens], device=DEVICE)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.tensor(tokens, device=DEVICE)[:, None]
    return torch.log_softmax(logits / temperature, -1).gather(1, picked)[:, 0].cpu()


def hf_greedy(model, prompt, max_new_tokens):
    out = model.generate(
        torch.tensor([prompt], device=DEVICE),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_fp32_parity_with_transformers_under_continuous_batching(family_model):
    family, path, hf = family_model
    engine = load_engine(path, quant="none", dtype="float32", device=DEVICE, max_batch=3, max_seq_len=64)
    greedy = [hf_greedy(hf, p, 12) for p in PROMPTS]
    # stop requests 0 and 2 early at the first occurrence of their 4th greedy token
    stops = [[greedy[0][3]], [], [greedy[2][3]], []]
    reqs = [GenRequest(p, n=2, max_new_tokens=12, temperature=0, stop_token_ids=s) for p, s in zip(PROMPTS, stops)]
    reqs += [GenRequest(p, n=2, max_new_tokens=10, temperature=0.8, top_p=0.95, seed=3) for p in PROMPTS[:2]]
    results = engine.generate(reqs)  # 12 sequences through 3 slots: slots are freed and refilled

    for i, (req, res) in enumerate(zip(reqs, results)):
        assert len(res.samples) == 2
        for s in res.samples:
            assert len(s.logprobs) == len(s.token_ids) == len(s.versions)
            assert set(s.versions) == {0}
            if i < len(PROMPTS):
                want = greedy[i]
                if stops[i]:
                    want = want[: want.index(stops[i][0]) + 1]
                    assert s.finish_reason == "stop" and len(want) < 12
                else:
                    assert s.finish_reason == "length"
                assert s.token_ids == want, f"{family} request {i}"
            tf = teacher_forced(hf, req.prompt_ids, s.token_ids, req.temperature or 1.0)
            torch.testing.assert_close(torch.tensor(s.logprobs), tf, atol=1e-4, rtol=0)
    assert engine.num_running == 0 and engine.num_waiting == 0 and not engine.has_work()


def test_seeds_reproducible_and_samples_differ(family_model):
    _, path, _ = family_model
    engine = load_engine(path, quant="none", device=DEVICE, max_batch=4, max_seq_len=64)
    req = GenRequest(PROMPTS[1], n=3, max_new_tokens=16, temperature=1.0, seed=7)
    alone = engine.generate([req])[0]
    # same request again, now batched with others and through fewer free slots
    other = GenRequest(PROMPTS[0], n=3, max_new_tokens=5, temperature=1.0)
    mixed = engine.generate([other, req])[1]
    assert [s.token_ids for s in alone.samples] == [s.token_ids for s in mixed.samples]
    ids = [tuple(s.token_ids) for s in alone.samples]
    assert len(set(ids)) == 3
    reseeded = engine.generate([GenRequest(PROMPTS[1], n=3, max_new_tokens=16, temperature=1.0, seed=8)])[0]
    assert [tuple(s.token_ids) for s in reseeded.samples] != ids


def test_top_k_and_top_p_restrict_the_draw_but_not_the_logprob(family_model):
    _, path, hf = family_model
    engine = load_engine(path, quant="none", device=DEVICE, max_batch=4, max_seq_len=64)
    greedy = engine.generate([GenRequest(PROMPTS[3], max_new_tokens=8, temperature=0)])[0].samples[0]
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        s = engine.generate([GenRequest(PROMPTS[3], max_new_tokens=8, temperature=0.7, seed=1, **kw)])[0].samples[0]
        assert s.token_ids == greedy.token_ids
        # the logprob is of the full distribution at T=0.7, not renormalised over the single allowed token
        tf = teacher_forced(hf, PROMPTS[3], s.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(s.logprobs), tf, atol=1e-4, rtol=0)
        assert max(s.logprobs) < 0


def test_sampler_frequencies_follow_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    probs = logits.softmax(-1)[0]
    n = 40000
    rows = logits.expand(n, -1)
    u = (1 - torch.rand(n)).tolist()

    def freqs(top_p=1.0, top_k=-1, temperature=1.0):
        tok, lp = sample(rows, [temperature] * n, [top_p] * n, [top_k] * n, u)
        want_lp = torch.log_softmax(logits[0] / (temperature or 1.0), -1)[tok]  # greedy: T = 1
        torch.testing.assert_close(lp, want_lp)  # full-vocabulary logprob whatever the filter
        return torch.bincount(tok, minlength=12).float() / n

    torch.testing.assert_close(freqs(), probs, atol=0.01, rtol=0)
    torch.testing.assert_close(freqs(temperature=0.5), (logits[0] / 0.5).softmax(-1), atol=0.01, rtol=0)
    order = probs.argsort(descending=True)
    top3 = torch.zeros(12).index_fill_(0, order[:3], 1.0) * probs
    torch.testing.assert_close(freqs(top_k=3), top3 / top3.sum(), atol=0.01, rtol=0)
    cum = probs[order].cumsum(0)
    keep = int((cum < 0.6).sum()) + 1  # smallest prefix with mass >= 0.6
    nucleus = torch.zeros(12).index_fill_(0, order[:keep], 1.0) * probs
    torch.testing.assert_close(freqs(top_p=0.6), nucleus / nucleus.sum(), atol=0.01, rtol=0)
    assert set(freqs(temperature=0.0).nonzero()[:, 0].tolist()) == {int(order[0])}  # greedy


def test_n_larger_than_max_batch_and_step_api(family_model):
    _, path, _ = family_model
    engine = load_engine(path, quant="none", device=DEVICE, max_batch=2, max_seq_len=64)
    engine.add_request(GenRequest(PROMPTS[0], n=5, max_new_tokens=6, temperature=1.0, seed=0), "a")
    engine.add_request(GenRequest(PROMPTS[1], n=1, max_new_tokens=3, temperature=0), "b")
    assert engine.num_waiting == 6 and engine.num_running == 0
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(GenRequest(PROMPTS[2], max_new_tokens=4), "a")
    got = {}
    steps = 0
    while engine.has_work():
        assert engine.num_running <= 2
        for rid, index, s in engine.step():
            got[(rid, index)] = s
        steps += 1
    assert sorted(got) == [("a", i) for i in range(5)] + [("b", 0)]
    assert all(len(s.token_ids) == 6 for k, s in got.items() if k[0] == "a") and len(got[("b", 0)].token_ids) == 3
    # decode runs over all active slots at once: 33 tokens in 2 slots take about 33 / 2 steps, not 33
    assert steps <= 20


def test_one_step_prefills_a_bounded_number_of_prompt_tokens(family_model, monkeypatch):
    from rollout_server.engines import torch_engine

    _, path, _ = family_model
    monkeypatch.setattr(torch_engine, "PREFILL_TOKENS_PER_STEP", 2 * len(PROMPTS[0]))
    engine = load_engine(path, quant="none", device=DEVICE, max_batch=8, max_seq_len=64)
    long = GenRequest(list(PROMPTS[0]) * 3, max_new_tokens=4, temperature=0)
    engine.add_request(long, "long")  # alone over the budget: admitted anyway
    for i in range(5):
        engine.add_request(GenRequest(PROMPTS[0], max_new_tokens=4, temperature=0), i)
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 5
    engine.step()
    assert engine.num_running == 3 and engine.num_waiting == 3  # two prompts fill the budget exactly
    finished = {}
    while engine.has_work():
        finished.update({rid: s for rid, _, s in engine.step()})
    alone = load_engine(path, quant="none", device=DEVICE, max_batch=8, max_seq_len=64)
    (want,) = alone.generate([GenRequest(PROMPTS[0], max_new_tokens=4, temperature=0)])
    assert len(finished) == 6 and all(finished[i].token_ids == want.samples[0].token_ids for i in range(5))


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_prefill_many_equals_one_prompt_at_a_time(family_model, quant):
    """Prompts of different lengths prefilled together, right-padded, into slots that are not adjacent: the same
    last-position logits and cache rows as one prompt per forward (a one-step admission prefills them together)."""
    _, path, _ = family_model
    engine = load_engine(path, quant=quant, device=DEVICE, max_batch=6, max_seq_len=64)
    model, prompts, slots = engine.model, [PROMPTS[0] * 2, [7], PROMPTS[1]], [0, 3, 5]
    one = [
        model.prefill_many(torch.tensor([p]), [len(p)], engine.k_cache, engine.v_cache, [s])[0]
        for p, s in zip(prompts, slots)
    ]
    rows = [
        (engine.k_cache[:, s, :, : len(p)].clone(), engine.v_cache[:, s, :, : len(p)].clone())
        for p, s in zip(prompts, slots)
    ]
    engine.k_cache.zero_(), engine.v_cache.zero_()
    lengths = [len(p) for p in prompts]
    padded = torch.zeros(3, max(lengths), dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = torch.tensor(p)
    many = model.prefill_many(padded, lengths, engine.k_cache, engine.v_cache, slots)
    for i, (p, s) in enumerate(zip(prompts, slots)):
        torch.testing.assert_close(many[i], one[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(engine.k_cache[:, s, :, : len(p)], rows[i][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(engine.v_cache[:, s, :, : len(p)], rows[i][1], atol=1e-5, rtol=0)


def test_run_to_completion_calls_on_sample_once_per_finished_sample(family_model):
    _, path, _ = family_model
    engine = load_engine(path, quant="none", device=DEVICE, max_batch=2, max_seq_len=64)
    reqs = [
        GenRequest(PROMPTS[0], n=3, max_new_tokens=5, temperature=1.0, seed=0),
        GenRequest(PROMPTS[1], n=2, max_new_tokens=3),
    ]
    seen = []
    results = run_to_completion(engine, reqs, on_sample=lambda: seen.append(engine.has_work()))
    assert len(seen) == 5 and [len(r.samples) for r in results] == [3, 2]
    assert seen[0] and not seen[-1]  # called as samples finish, not once at the end
    assert all(s is not None for r in results for s in r.samples)


def test_update_weights_in_place_matches_engine_built_on_new_weights(tmp_path):
    build_model("qwen2", tmp_path / "a", seed=0)
    build_model("qwen2", tmp_path / "b", seed=1)
    with torch.inference_mode():  # buffers made in inference mode can still be updated outside it
        a = load_engine(str(tmp_path / "a"), quant="none", device=DEVICE, max_batch=4, max_seq_len=64)
    b = load_engine(str(tmp_path / "b"), quant="none", device=DEVICE, max_batch=4, max_seq_len=64)
    reqs = [GenRequest(p, n=2, max_new_tokens=8, temperature=1.0, seed=5) for p in PROMPTS]
    before = a.generate(reqs)
    ptrs = {k: v.data_ptr() for k, v in a.weights.items()}
    a.update_weights(b.weights, version=3)
    assert a.version == 3 and {k: v.data_ptr() for k, v in a.weights.items()} == ptrs
    after, want = a.generate(reqs), b.generate(reqs)
    for ra, rb in zip(after, want):
        for sa, sb in zip(ra.samples, rb.samples):
            assert sa.token_ids == sb.token_ids and sa.logprobs == sb.logprobs and set(sa.versions) == {3}
    assert [s.token_ids for s in before[0].samples] != [s.token_ids for s in after[0].samples]


def test_update_between_steps_tags_tokens_with_versions(tmp_path):
    build_model("qwen2", tmp_path / "a", seed=0)
    build_model("qwen2", tmp_path / "b", seed=1)
    a = load_engine(str(tmp_path / "a"), quant="none", device=DEVICE, max_batch=4, max_seq_len=64)
    b = load_engine(str(tmp_path / "b"), quant="none", device=DEVICE, max_batch=4, max_seq_len=64)
    a.add_request(GenRequest(PROMPTS[1], n=2, max_new_tokens=10, temperature=0), 0)
    for _ in range(4):
        assert a.step() == []
    a.update_weights(b.weights, version=1)  # mid-flight: sequences keep their KV cache and continue
    out = {}
    while a.has_work():
        out.update({(rid, i): s for rid, i, s in a.step()})
    for s in out.values():
        assert s.versions == [0] * 5 + [1] * 5  # prefill + 4 decode steps ran on version 0


def test_bad_update_changes_nothing(tmp_path):
    build_model("qwen2", tmp_path / "a", seed=0)
    engine = load_engine(str(tmp_path / "a"), quant="none", device=DEVICE, max_batch=2, max_seq_len=32)
    snapshot = {k: v.clone() for k, v in engine.weights.items()}
    good = {k: torch.zeros_like(v) for k, v in snapshot.items()}
    last = sorted(good)[-1]
    bad_cases = {
        "is torch.float32 (3, 3)": {**good, last: torch.zeros(3, 3)},
        "torch.float64": {**good, last: good[last].double()},
        "unknown tensor 'model.extra'": {**good, "model.extra": torch.zeros(1)},
        "unknown tensor 'lm_head.weight'": {**good, "lm_head.weight": torch.zeros(101, 64)},  # tied model
        "missing tensor": {k: v for k, v in good.items() if k != last},
    }
    for msg, tensors in bad_cases.items():
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            engine.update_weights(tensors, version=9)
        assert engine.version == 0
        for k, v in engine.weights.items():
            assert torch.equal(v, snapshot[k]), k
    engine.update_weights({last: good[last]}, version=2, partial=True)
    assert engine.version == 2 and not engine.weights[last].any()


def test_sharded_checkpoint_loads_the_same(tmp_path):
    hf = build_model("llama", tmp_path / "one")
    hf.cpu().save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reqs = [GenRequest(p, max_new_tokens=6, temperature=0) for p in PROMPTS]
    one = load_engine(str(tmp_path / "one"), quant="none", device=DEVICE, max_seq_len=32).generate(reqs)
    sharded = load_engine(str(tmp_path / "sharded"), quant="none", device=DEVICE, max_seq_len=32).generate(reqs)
    assert [r.samples[0].logprobs for r in one] == [r.samples[0].logprobs for r in sharded]


def test_engine_keeps_no_view_of_the_checkpoint(tmp_path):
    build_model("qwen3", tmp_path / "a", seed=0)
    engine = load_engine(str(tmp_path / "a"), quant="none", device=DEVICE, max_seq_len=32)
    reqs = [GenRequest(p, max_new_tokens=6, temperature=0) for p in PROMPTS]
    before = engine.generate(reqs)
    build_model("qwen3", tmp_path / "b", seed=1)
    new = (tmp_path / "b" / "model.safetensors").read_bytes()
    with open(tmp_path / "a" / "model.safetensors", "r+b") as f:  # rewritten in place, same inode
        f.write(new)
    after = engine.generate(reqs)
    assert [r.samples[0].logprobs for r in before] == [r.samples[0].logprobs for r in after]


def test_clear_errors(tmp_path):
    build_model("llama", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*supported: llama, qwen2, qwen3"):
        load_engine(str(tmp_path / "gpt2"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json in"):
        load_engine(str(tmp_path / "empty"), quant="none")
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    (tmp_path / "wide" / "model.safetensors").write_bytes((tmp_path / "m" / "model.safetensors").read_bytes())
    wrong = r"'model.layers.0.mlp.gate_proj.weight' .* has shape \(96, 64\), config.json implies \(100, 64\)"
    with pytest.raises(ValueError, match=wrong):
        load_engine(str(tmp_path / "wide"), quant="none")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight' in .*model.safetensors"):
        load_engine(str(tmp_path / "m"), quant="none")
    with pytest.raises(ValueError, match="unknown quant 'int4'"):
        load_engine(str(tmp_path / "m"), quant="int4")


def test_bad_requests_are_refused(tmp_path):
    build_model("qwen2", tmp_path / "m")
    engine = load_engine(str(tmp_path / "m"), quant="none", device=DEVICE, max_batch=2, max_seq_len=16)
    for req, msg in [
        (GenRequest([]), "prompt_ids is empty"),
        (GenRequest([1, 500]), r"outside \[0, 101\)"),
        (GenRequest([1] * 10, max_new_tokens=7), "exceeds max_seq_len 16"),
        (GenRequest([1], n=0), "n >= 1"),
        (GenRequest([1], top_p=0.0, max_new_tokens=4), "top_p"),
        (GenRequest([1], temperature=-1.0, max_new_tokens=4), "temperature"),
    ]:
        with pytest.raises(ValueError, match=msg):
            engine.add_request(req, 0)
    assert not engine.has_work()


def test_engine_is_a_torch_engine_with_its_contract_defaults(tmp_path):
    build_model("qwen2", tmp_path / "m")
    engine = load_engine(str(tmp_path / "m"), device=DEVICE, max_seq_len=32)  # default quant: int8
    assert isinstance(engine, TorchEngine) and engine.version == 0
    w = engine.weights
    assert w["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert w["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 1)
    assert w["model.layers.0.self_attn.q_proj.bias"].dtype == torch.float32
    assert "lm_head.weight" not in w and w["model.embed_tokens.weight"].dtype == torch.float32


def test_throughput_benchmark_quick(tmp_path):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "rollout_throughput.py")
    spec = importlib.util.spec_from_file_location("rollout_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    result = bench.main(["--quick", "--threads", "1", "--device", DEVICE, "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "rollout_throughput"
    assert set(result["machine"]) >= {"cpu", "cores", "gpu", "torch", "python"}
    rows = result["rows"]
    kinds = {(r["engine"], r["dtype"]) for r in rows}
    assert kinds >= {("qurl", "fp32"), ("qurl", "bf16"), ("qurl", "int8"), ("hf", "fp32"), ("hf", "bf16")}
    assert {r["workload"] for r in rows} == {"decode", "rl"}
    assert {r["batch"] for r in rows if r["workload"] == "decode"} == {1, 4}
    assert all(r["tokens_per_s"] > 0 and r["repeats"] == 1 and r["model_params"] > 0 for r in rows)
    assert {"int8/fp32@batch4", "int8/bf16@batch4", "fp32/hf-fp32@batch4", "continuous/static"} <= set(result["ratios"])
    limit = result["byte_limits"]["int8+head/fp32@batch4"]  # int8 codes and an int8 lm_head against fp32 weights
    assert 3 < limit["limit"] < 4 and limit["share_of_limit"] > 0
    assert DEVICE != "cpu" or limit["gemm_only_share_of_limit"] > 0  # the GEMM share is profiled on the CPU only
    heads = {r["config"]: r["weight_bytes_per_step"] for r in rows if r["batch"] == 4 and "weight_bytes_per_step" in r}
    assert heads["int8+head"] < heads["int8"] < heads["fp32"] and heads["bf16"] * 2 == heads["fp32"]


def test_admission_prefills_in_runs_of_similar_length():
    """Each padded prefill batch stays within PAD_WASTE of its real tokens; every admitted prompt is in one run."""
    from rollout_server.engines.torch_engine import PAD_WASTE, _similar_lengths

    lengths = [45] * 8 + [250, 240, 3, 47]
    runs = _similar_lengths(lengths)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    for run in runs:
        assert max(lengths[i] for i in run) * len(run) <= PAD_WASTE * sum(lengths[i] for i in run)
    assert len(runs) == 3  # the 3-token prompt, the ~45-token ones, the long two
