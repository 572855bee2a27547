"""The GPU check: what only a GPU can measure, sized for one borrowed GPU for a few minutes (torch CUDA, transformers,
safetensors, numpy; no sglang, pyzmq or omegaconf).

Steps, each in a process of its own under its own time limit, so that an OOM or a hang costs that step only; the JSON
(`--out`) is rewritten after every step, so every figure measured survives a later failure:

- logprob_memory  the learner's log-prob head, dense against chunked, forward and backward, at Qwen2.5-7B's shapes
                  (2 layers, hidden 3584, vocabulary 152,064) for 4k, 8k and 16k tokens: max_memory_allocated, time
- learner_step    one FSDP2 learner step (PolicyStep, bf16 mixed precision, one rank) at DeepSeek-R1-Distill-Qwen-1.5B's
                  shapes, random weights: 16 rollout-shaped samples, step seconds, tokens/s, peak memory
- decode          the embedded engine's bf16, int8 and fp8 decode tokens/s at the 1.5B shapes, batch 16 and 64
- eval_time       eval/acc_fp's greedy generation (transformers, bf16) at the 1.5B shapes, batch 30: seconds per
                  token at two layer counts and three answer lengths, extrapolated to 28 layers and the DeepScaleR
                  recipe's 8,192-token answers (benchmarks/eval_time.py)

    python3 benchmarks/gpu_check.py [--device cuda] [--out FILE] [--budget-s 420]
    python3 benchmarks/gpu_check.py --tiny --device cpu      # the rehearsal the default suite runs (tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
import common  # noqa: E402  (benchmarks/common.py)
from common import machine_info  # noqa: E402

QWEN2_15B = dict(common.QWEN2_15B, num_hidden_layers=28, max_position_embeddings=16384)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
# step -> seconds it may take; --budget-s (400 on the GPU) caps their sum, so the check stays under 10 minutes
BUDGETS = {"logprob_memory": 120, "learner_step": 90, "decode": 240, "eval_time": 80}


def qwen2(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-init Qwen2 of these shapes on `device` (the real config's shapes, not its weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0, use_cache=False)
    with device:
        return Qwen2ForCausalLM(config).to(dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def step_logprob_memory(args: argparse.Namespace) -> dict:
    """The log-prob head's memory and time, dense against chunked (benchmarks/logprob_memory.py, 2 layers)."""
    out = os.path.join(args.work, "logprob_memory.json")
    cmd = [sys.executable, os.path.join(HERE, "logprob_memory.py"), "--layers", "2", "--device", args.device]
    cmd += ["--quick"] if args.tiny else ["--dtype", "bfloat16", "--tokens", "4096,8192,16384"]
    subprocess.run(cmd + ["--out", out], check=True, capture_output=True, text=True)
    with open(out) as f:
        result = json.load(f)
    return {"rows": result["rows"], "ratios": result["ratios"]}


def step_learner_step(args: argparse.Namespace) -> dict:
    """One FSDP2 learner step on one device: the policy step the learner runs, on rollout-shaped samples."""
    import torch.distributed as dist

    from learner.batch import Batch
    from learner.model import shard
    from learner.policy_step import DistEnv, PolicyStep
    from qurl.corrections.spec import LossSpec

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # FSDP2 wants an indexed device
        torch.cuda.set_device(device)
    store = os.path.join(args.work, "pg.store")
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    shape = TINY if args.tiny else QWEN2_15B
    model = qwen2(shape, device, torch.float32)
    if not args.tiny:  # as the recipe: checkpointed layers, then FSDP2 with bf16 compute and fp32 masters
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = shard(model, bf16=device.type == "cuda")
    train = SimpleNamespace(  # the DeepScaleR recipe's learner settings (configs/deepscaler-1.5b-int8.yaml)
        lr=1e-6,
        weight_decay=0.0,
        warmup_steps=0,
        lr_schedule="constant",
        steps=1000,
        mini_batches=2,
        grad_clip=1.0,
        micro_batches="bucketed",
        micro_batch_tokens=16384,
    )
    algo = SimpleNamespace(  # the recipe's objective (ACR, clip-higher) and no KL term
        **LossSpec(mode="acr", eps_low=0.2, eps_high=0.28, tis_cap=2.0).as_config(),
        kl_coef=0.0,
        kl_kind="k3",
        advantage="grpo",
        overlong=SimpleNamespace(enable=False),
    )
    prompt, response = (16, 32) if args.tiny else (512, 1536)
    sampling = SimpleNamespace(temperature=0.6, max_new_tokens=response)
    policy = PolicyStep(model, None, train, algo, sampling, DistEnv(0, 1, 0, device))
    g = torch.Generator().manual_seed(0)
    n = 16  # 2 prompts x 8 samples, responses of random length up to `response`
    lengths = torch.randint(response // 4, response + 1, (n,), generator=g)
    total = prompt + lengths
    ids = torch.randint(3, shape["vocab_size"], (n, int(total.max())), generator=g)
    behav = torch.zeros(ids.shape)
    for i in range(n):
        behav[i, prompt : total[i]] = -torch.rand(int(lengths[i]), generator=g)
    batch = Batch(ids, torch.full((n,), prompt), total, behav, (torch.arange(n) % 3 == 0).float(), torch.arange(n) // 8)
    times = []
    for step in range(2):  # the first is a warm-up (allocator, kernels)
        sync(device)
        started = time.perf_counter()
        result = policy.step(batch, step)
        sync(device)
        times.append(time.perf_counter() - started)
    params = sum(p.numel() for p in model.parameters())
    tokens = int(total.sum())
    dist.destroy_process_group()
    return {
        "shape": "tiny" if args.tiny else "DeepSeek-R1-Distill-Qwen-1.5B",
        "params": params,
        "samples": n,
        "tokens": tokens,
        "step_s": times[-1],
        "tokens_per_s": tokens / times[-1],
        # forward + backward (2 + 4) plus the proximal forward (2) FLOPs per parameter and token, layers' matmuls
        "tflop_per_s": 8 * params * tokens / times[-1] / 1e12,
        "peak_mb": peak_mb(device),
        "updates": result.metrics["train/updates"],
        "loss": result.metrics["loss/policy"],
    }


def step_decode(args: argparse.Namespace) -> dict:
    """Decode tokens/s of the embedded engine per rollout format at the 1.5B shapes (random weights)."""
    from rollout_server.engines import GenRequest, load_engine

    shape = TINY if args.tiny else QWEN2_15B
    path = os.path.join(args.work, "model-1.5b")
    t0 = time.perf_counter()
    qwen2(shape, torch.device(args.device), torch.bfloat16).save_pretrained(path, safe_serialization=True)
    print(f"decode: model written at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    new_tokens = 16 if args.tiny else 128
    rows = []
    formats = [("bf16", "none"), ("int8", "int8"), ("fp8", "fp8")]
    for name, quant in formats:
        engine = None
        for batch in (16, 64):
            try:
                engine = engine or load_engine(  # one load per format, sized for the larger batch
                    path,
                    quant=quant,
                    dtype="bfloat16",
                    device=args.device,
                    max_batch=64,
                    max_seq_len=64 + new_tokens + 8,
                )
                if batch == 16:
                    print(f"decode: {name} loaded at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
                requests = [
                    GenRequest(
                        prompt_ids=list(range(3, 67)),
                        n=1,
                        max_new_tokens=new_tokens,
                        temperature=1.0,
                        top_p=1.0,
                        top_k=-1,
                        stop_token_ids=[],
                        seed=i,
                    )
                    for i in range(batch)
                ]
                engine.generate(requests[:2])  # warm-up
                sync(torch.device(args.device))
                started = time.perf_counter()
                results = engine.generate(requests)
                sync(torch.device(args.device))
                seconds = time.perf_counter() - started
                tokens = sum(len(s.token_ids) for r in results for s in r.samples)
                rows.append({"format": name, "batch": batch, "tokens_per_s": tokens / seconds, "seconds": seconds})
                print(f"decode {name} batch {batch}: {tokens / seconds:.0f} tokens/s", file=sys.stderr, flush=True)
            except Exception as exc:  # noqa: BLE001  (one format's failure is a figure too)
                rows.append({"format": name, "batch": batch, "error": f"{type(exc).__name__}: {exc}"[:300]})
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    by = {(r["format"], r["batch"]): r.get("tokens_per_s") for r in rows}
    ratios = {
        f"{f}_over_bf16_batch{b}": by[(f, b)] / by[("bf16", b)]
        for f in ("int8", "fp8")
        for b in (16, 64)
        if by.get((f, b)) and by.get(("bf16", b))
    }
    return {"new_tokens": new_tokens, "rows": rows, "ratios": ratios}


def step_eval_time(args: argparse.Namespace) -> dict:
    """eval/acc_fp's cost at the DeepScaleR recipe's settings (benchmarks/eval_time.py): greedy decode of 30 AIME
    prompts, 2 and 4 of the 1.5B's layers at 128-512 tokens, extrapolated to 28 layers and 8,192 tokens."""
    from eval_time import measure

    if args.tiny:
        return measure("tiny", [1, 2], [16, 32], args.device)
    return measure("1.5b", [2, 4], [128, 256, 512], args.device)


STEPS = {
    "logprob_memory": step_logprob_memory,
    "learner_step": step_learner_step,
    "decode": step_decode,
    "eval_time": step_eval_time,
}


def run_steps(names: list[str], run, budget_s: float, result: dict, out: str) -> None:
    """Run each step under min(its budget, what is left); record its figures, error or skip, and rewrite
    `out` after every step, so that a later failure loses nothing measured before it."""
    started = time.monotonic()
    for name in names:
        left = budget_s - (time.monotonic() - started)
        limit = min(BUDGETS[name], left)
        step_started = time.monotonic()
        if limit < 10:
            result["steps"][name] = {"skipped": f"{left:.0f} s of the check's budget left"}
        else:
            try:
                result["steps"][name] = run(name, limit)
            except subprocess.TimeoutExpired:
                result["steps"][name] = {"error": f"over its {limit:.0f} s limit"}
            except Exception:  # noqa: BLE001  (the JSON keeps what the other steps measured)
                result["steps"][name] = {"error": traceback.format_exc().strip().splitlines()[-1]}
        result["steps"][name]["seconds"] = round(time.monotonic() - step_started, 1)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"gpu_check: {name}: {json.dumps(result['steps'][name])[:400]}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: the CPU rehearsal of the default suite")
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole check's time; steps past it are skipped")
    p.add_argument("--steps", default=",".join(STEPS))
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--step", help=argparse.SUPPRESS)  # run one step in this process (the parent's child)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step:
        print(json.dumps(STEPS[args.step](args)))
        return 0
    started = time.monotonic()
    result = {"benchmark": "gpu_check", "machine": machine_info(), "device": args.device, "tiny": args.tiny}
    result["steps"] = {}
    with tempfile.TemporaryDirectory(prefix="qurl-gpu-check-") as work:

        def run(name: str, limit: float) -> dict:
            cmd = [sys.executable, os.path.abspath(__file__), "--step", name, "--work", work, "--device", args.device]
            cmd += ["--tiny"] if args.tiny else []
            log = f"{os.path.splitext(args.out)[0]}.{name}.log"  # the step's progress, kept when it overruns
            with open(log, "w") as err:
                done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=limit, cwd=ROOT)
            if done.returncode != 0:
                with open(log) as err:
                    return {"error": (err.read().strip().splitlines() or ["(no output)"])[-1]}
            return json.loads(done.stdout.strip().splitlines()[-1])

        run_steps(args.steps.split(","), run, args.budget_s, result, args.out)
    result["seconds"] = round(time.monotonic() - started, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 1 if any("error" in r for r in result["steps"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
