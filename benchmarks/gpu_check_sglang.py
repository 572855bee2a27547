"""GPU check of the SGLang engine adapter; `--device cpu` rehearses every step on SGLang's CPU engine.

For each of none / fp8-block / int8 on a tiny random bf16 Qwen2 (every projection a multiple of 128): start one
sglang.Engine (version 0 = the checkpoint, quantized by qurl.quant), generate greedy and n=4 samples, compare
greedy logprobs with a teacher-forced transformers forward of the weights the engine should hold, refit to other
weights (version 1) and compare again, refit back (version 2) and require the version-0 greedy tokens, and refit
while a request is running (its per-token versions must go 2 -> 3, in order). Then the learner-driven transports
end to end (learner/weight_sync's transports in a spawned "learner rank 0" process, a real WeightSync over ZeroMQ,
the server's rollout_server.weight_receiver.WeightReceiver here): cuda-ipc (every scheme; on one GPU the
learner shares the engine's GPU, i.e. colocated; on CPU the buffers are shared by file descriptor) and nccl
(none and fp8-block, with 2+ GPUs; over gloo on CPU).

GPU: `bash benchmarks/gpu_check_sglang.sh` on a node with `pip install -e '.[sglang]'`. CPU rehearsal (what
`make test-sglang` runs, so that the script cannot rot unseen): SGLANG_USE_CPU_ENGINE=1 and tests/sglang_cpu on
PYTHONPATH, `--device cpu`. Prints one JSON object (design.md section 9), keeping every figure measured before a
step fails; exits 0 only when every check passed.
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import time

import torch
import transformers

from qurl.quant import dequantize_state_dict, quantize_state_dict
from qurl.wire import sglang_payload as payload
from rollout_server.engines import GenRequest
from rollout_server.engines.sglang_engine import SGLangEngine, expected_tensors

SCHEMES = ("none", "fp8-block", "int8")
SERVER = {"cuda": {"cuda_graph_max_bs_decode": 8}, "cpu": {}}
# bf16 against a bf16 (GPU) or fp32 (CPU) reference; the GPU's quantized engines also quantize activations
MEAN_GAP_LIMIT = {"none": 0.05, "fp8-block": 0.2, "int8": 0.2}
CPU_MEAN_GAP_LIMIT = 0.15  # the CPU rehearsal: a bf16 engine against an fp32 reference (measured 0.02-0.06)
# no EOS: samples end at max_new_tokens; initializer_range 0.2 makes logits peaked (std ~3), so wrong weights show
CFG = transformers.Qwen2Config(
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


def random_weights(seed):
    torch.manual_seed(seed)
    return {
        k: v.to(torch.bfloat16)
        for k, v in transformers.Qwen2ForCausalLM(CFG).state_dict().items()
        if k != "lm_head.weight"
    }


def reference_logprobs(weights, prompt, tokens, device):
    """Teacher-forced log_softmax(logits) of `tokens` after `prompt` (T = 1): bf16 on a GPU, fp32 on the CPU."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.Qwen2ForCausalLM(CFG).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    model.tie_weights()
    model = model.to(device).eval()
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0].tolist()


def held(weights, scheme):
    """The full-precision weights an engine holding quantize_state_dict(weights, scheme) computes with."""
    if scheme == "none":
        return weights
    return dequantize_state_dict(quantize_state_dict(weights, scheme), scheme)


def gaps(a, b):
    """(max, mean) absolute difference of two logprob lists."""
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return round(max(d), 4), round(sum(d) / len(d), 4)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def learner_push(kind, endpoint, group_port, weights_path, scheme, version, done_path, device_kind):
    """Learner rank 0 (the last GPU, or the CPU): the real push transport publishes `version`, stays up until told."""
    import zmq

    from learner.servers import ServerRegistry
    from learner.weight_sync import IpcTransport, NcclTransport, WeightSync
    from qurl.wire import transport

    if device_kind == "cuda":
        torch.cuda.set_device(torch.cuda.device_count() - 1)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    ctx = zmq.Context()
    pub = transport.Sender(transport.bind(ctx, zmq.PUB, endpoint, secret=None, max_bytes=1 << 20, hwm=4), "learner")
    servers = ServerRegistry()
    if kind == "nccl":
        push = NcclTransport(pub, scheme, device, f"tcp://127.0.0.1:{group_port}", 1, 1, bucket_bytes=1 << 20)
        push.open()
    else:
        push = IpcTransport(pub, scheme, device, ranks=1, servers=servers, bucket_bytes=1 << 20)
    sync = WeightSync(push, servers, scheme)
    time.sleep(1.0)  # PUB/SUB: the server's subscription lands
    sync.push(version, torch.load(weights_path))
    if kind == "nccl":
        push.drain()
    deadline = time.time() + 300
    while not os.path.exists(done_path) and time.time() < deadline:  # the IPC buffers must outlive the load
        time.sleep(0.1)
    ctx.destroy(linger=0)


def transport_check(eng, kind, scheme, weights, version, greedy, expect_tokens, row, device):
    """Push `weights` as `version` through transport `kind`; the greedy tokens must be expect_tokens."""
    import zmq

    from qurl.wire import transport
    from rollout_server.weight_receiver import WeightReceiver

    tmp = tempfile.mkdtemp()
    weights_path, done = os.path.join(tmp, "w.pt"), os.path.join(tmp, "done")
    torch.save(quantize_state_dict(weights, scheme), weights_path)
    endpoint, group_port = f"tcp://127.0.0.1:{free_port()}", free_port()
    ctx = zmq.Context()
    rx = transport.Receiver(
        transport.connect(ctx, zmq.SUB, endpoint, max_bytes=1 << 30),
        secret=None,
        max_bytes=1 << 30,
        kinds=("weight_ref",),
    )
    proc = mp.get_context("spawn").Process(
        target=learner_push, args=(kind, endpoint, group_port, weights_path, scheme, version, done, device)
    )
    proc.start()
    key = kind.replace("-", "_")
    try:
        if kind == "nccl":
            world, offsets = payload.update_group_layout(1, 1)
            eng.init_update_group(
                "127.0.0.1", group_port, offsets[0], world, backend="nccl" if device == "cuda" else "gloo"
            )
        ref = rx.recv(timeout_ms=120_000)
        if ref is None:
            raise RuntimeError(f"{kind}: no weight_ref arrived within 120 s")
        t0 = time.perf_counter()
        receiver = WeightReceiver(eng, scheme, lambda: None)
        if not receiver.apply([ref]):
            raise RuntimeError(f"{kind}: the weight_ref of version {version} was refused (see the log)")
        row[f"{key}_refit_s"] = round(time.perf_counter() - t0, 3)
        s = eng.generate([greedy])[0].samples[0]
        row[f"{key}_tokens_equal"] = s.token_ids == expect_tokens and all(v == version for v in s.versions)
    finally:
        open(done, "w").close()
        proc.join(60)
        ctx.destroy(linger=0)


def check(scheme, path, w_a, w_b, prompt, max_new, device, row):
    """Every step for one scheme; each figure lands in `row` as soon as it is measured (a failure keeps them)."""
    row["model_params"] = sum(v.numel() for v in w_a.values())
    t0 = time.perf_counter()
    eng = SGLangEngine.from_pretrained(
        path,
        quant=scheme,
        dtype="bfloat16",
        device="cuda:0" if device == "cuda" else "cpu",
        max_batch=8,
        max_seq_len=256,
        mem_fraction=0.3 if device == "cuda" else None,
        server_args=SERVER[device],
        bucket_bytes=1 << 20,
    )
    row["startup_s"] = round(time.perf_counter() - t0, 2)
    greedy = GenRequest(prompt_ids=prompt, n=1, max_new_tokens=max_new, temperature=0.0)
    try:
        t0 = time.perf_counter()
        g0, sampled = eng.generate([greedy, GenRequest(prompt_ids=prompt, n=4, max_new_tokens=max_new)])
        gen_s = time.perf_counter() - t0
        row["tokens_per_s"] = round(sum(len(s.token_ids) for s in g0.samples + sampled.samples) / gen_s, 1)
        s0 = g0.samples[0]
        row["n_samples_ok"] = len(sampled.samples) == 4 and all(
            len(s.logprobs) == len(s.token_ids) == len(s.versions) == max_new for s in sampled.samples
        )
        row["v0_versions_ok"] = all(v == 0 for s in g0.samples + sampled.samples for v in s.versions)
        row["logprob_gap_v0"] = gaps(s0.logprobs, reference_logprobs(held(w_a, scheme), prompt, s0.token_ids, device))

        push = quantize_state_dict(w_b, scheme)
        t0 = time.perf_counter()
        eng.update_weights(push, 1)
        row["refit_s"] = round(time.perf_counter() - t0, 3)
        row["refit_bytes"] = sum(t.numel() * t.element_size() for t in push.values())
        s1 = eng.generate([greedy])[0].samples[0]
        row["v1_versions_ok"] = all(v == 1 for v in s1.versions) and eng.version == 1
        row["logprob_gap_v1"] = gaps(s1.logprobs, reference_logprobs(held(w_b, scheme), prompt, s1.token_ids, device))
        row["refit_changed_tokens_ok"] = s1.token_ids != s0.token_ids

        eng.update_weights(quantize_state_dict(w_a, scheme), 2)
        s2 = eng.generate([greedy])[0].samples[0]
        row["round_trip_tokens_equal"] = s2.token_ids == s0.token_ids
        row["round_trip_logprob_gap"] = gaps(s2.logprobs, s0.logprobs)
        row["v2_versions_ok"] = all(v == 2 for v in s2.versions)

        eng.add_request(GenRequest(prompt_ids=prompt, n=1, max_new_tokens=200, temperature=1.0), "long")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.3:  # decoding has started; 200 tokens take longer
            eng.step()
        eng.update_weights(push, 3)
        done = []
        while eng.has_work():
            done += eng.step()
        versions = done[0][2].versions
        row["in_flight_versions"] = sorted(set(versions))
        row["in_flight_versions_ok"] = versions == sorted(versions) and set(versions) == {2, 3}

        two_ranks = device == "cpu" or torch.cuda.device_count() >= 2
        if scheme != "int8" and two_ranks:  # nccl refuses int8 (docs/sglang.md, limits)
            transport_check(eng, "nccl", scheme, w_b, 4, greedy, s1.token_ids, row, device)
        transport_check(eng, "cuda-ipc", scheme, w_a, 5, greedy, s0.token_ids, row, device)
    finally:
        eng.close()
    ok_keys = [k for k in row if k.endswith(("_ok", "_equal"))]
    mean_gap = max(row["logprob_gap_v0"][1], row["logprob_gap_v1"][1])
    limit = MEAN_GAP_LIMIT[scheme] if device == "cuda" else CPU_MEAN_GAP_LIMIT
    row["passed"] = all(row[k] for k in ok_keys) and mean_gap < limit


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a rehearsal on SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, tests/sglang_cpu stand-ins)",
    )
    p.add_argument("--schemes", default=",".join(SCHEMES))
    args = p.parse_args()
    torch.set_num_threads(4 if args.device == "cuda" else 1)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check_sglang: no CUDA GPU (use --device cpu for the CPU rehearsal)")
    import sglang

    tmp = tempfile.mkdtemp()
    w_a, w_b = random_weights(0), random_weights(1)
    model = transformers.Qwen2ForCausalLM(CFG).to(torch.bfloat16)
    model.load_state_dict(w_a, strict=False)
    model.save_pretrained(tmp)
    assert set(expected_tensors(tmp, "none")) == set(w_a), "checkpoint names differ from the pushed names"
    prompt = [5, 17, 42, 99, 3, 250, 7]
    rows = []
    for scheme in args.schemes.split(","):
        row = {"engine": "sglang", "scheme": scheme, "device": args.device}
        rows.append(row)
        try:
            check(scheme, tmp, w_a, w_b, prompt, 8 if args.quick else 24, args.device, row)
        except Exception as exc:  # one step failing must not hide the figures before it, nor the other schemes
            row.update(passed=False, error=f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}")
    out = {
        "benchmark": "gpu_check_sglang",
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "sglang": sglang.__version__,
            "threads": torch.get_num_threads(),
        },
        "rows": rows,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
