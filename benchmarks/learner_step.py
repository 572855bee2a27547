"""Learner step benchmark: step time, tokens/s, weight-push seconds and bytes for int8, fp8 and none, 1 and 2 ranks.

Each row is one real `qurl-learner` run (its own processes, FSDP2 over gloo, real sockets): this script plays
the rollout server, PUSHes synthetic scored groups (random tokens and behaviour log-probs, mixed rewards) and
SUBscribes to the weights, then reads the learner's metrics.jsonl. The first step is a warm-up; the rest are
measured and their medians reported. `step_s` is one whole learner step (proximal pass, update, weight push);
`push_s` is the part spent gathering, quantizing and handing the push to ZeroMQ (sending continues in the
background I/O thread); tokens_per_s counts prompt + response tokens per step_s.

    python benchmarks/learner_step.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import yaml
import zmq
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import QWEN2_150M, emit, machine_info  # noqa: E402  (benchmarks/common.py)

from qurl.demo.prepare import Recipe, default_root, read_info  # noqa: E402
from qurl.wire import transport  # noqa: E402
from qurl.wire.protocol import Sample, Status, TrajectoryGroup  # noqa: E402

LARGE = dict(QWEN2_150M, tie_word_embeddings=False)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    tie_word_embeddings=True,
)
Length = int | tuple[int, int]  # a fixed token count, or (lo, hi) drawn uniformly
# model -> (prompts per batch, samples per prompt, prompt tokens, response tokens)
WORKLOADS = {"demo": (16, 8, 16, 8), "qwen2-150m": (2, 4, 32, 64), "tiny": (4, 4, 16, 16)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_qwen2(path: str, shape: dict) -> str:
    """A random-init Qwen2 saved as a Hugging Face folder."""
    torch.manual_seed(0)
    cfg = Qwen2Config(**shape, max_position_embeddings=1024, pad_token_id=0, eos_token_id=2, bos_token_id=None)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def demo_model(tmp: str) -> tuple[str, str]:
    """The prepared demo model, or (when `qurl-prepare-demo` has not run) a random one of the same shape."""
    root = default_root()
    if read_info(root) is not None:
        return os.path.join(root, "model"), "demo"
    r = Recipe()
    shape = dict(
        hidden_size=r.hidden,
        num_hidden_layers=r.layers,
        num_attention_heads=r.heads,
        num_key_value_heads=r.kv_heads,
        intermediate_size=r.intermediate,
        vocab_size=r.vocab_size,
        tie_word_embeddings=True,
    )
    return random_qwen2(os.path.join(tmp, "demo-shape"), shape), "demo-shape (random init; demo not prepared)"


def groups(
    n: int, samples: int, prompt_len: Length, response_len: Length, vocab: int, seed: int
) -> list[TrajectoryGroup]:
    """Scored groups of random tokens; a (lo, hi) length is drawn per group (prompt) or per sample (response)."""
    rng = np.random.default_rng(seed)
    draw = lambda length: int(rng.integers(length[0], length[1] + 1)) if isinstance(length, tuple) else length  # noqa: E731
    out = []
    for g in range(n):
        rewards = rng.permutation([1.0] * (samples // 2) + [0.0] * (samples - samples // 2))
        lengths = [draw(response_len) for _ in rewards]
        out.append(
            TrajectoryGroup(
                prompt_id=g,
                group_id=f"bench-{seed}-{g}",
                server_id="bench",
                prompt_ids=rng.integers(3, vocab, draw(prompt_len), dtype=np.int32),
                samples=tuple(
                    Sample(
                        token_ids=rng.integers(3, vocab, k, dtype=np.int32),
                        logprobs=-rng.uniform(0.01, 3.0, k).astype(np.float32),
                        versions=np.zeros(k, np.int32),
                        reward=float(r),
                        finish_reason="length",
                    )
                    for r, k in zip(rewards, lengths)
                ),
            )
        )
    return out


def run_learner(
    tmp: str, model: str, ranks: int, quant: str, steps: int, workload: tuple, threads: int, train: dict | None = None
) -> list[dict]:
    """One learner run fed with steps batches; its metrics.jsonl rows (`train`: more train.* keys, e.g. precision)."""
    prompts, samples, prompt_len, response_len = workload
    endpoints = {k: f"tcp://127.0.0.1:{free_port()}" for k in ("trajectories", "weights", "control")}
    data = os.path.join(tmp, "train.jsonl")
    with open(data, "w") as f:
        f.write('{"problem": "1+1", "answer": "2"}\n')
    run_dir = os.path.join(tmp, f"run-{os.path.basename(model)}-{ranks}-{quant}-{len(os.listdir(tmp))}")
    cfg = {
        "run": {"dir": run_dir},
        "model": {"path": model},
        "data": {"train_files": [data]},
        "rollout": {
            "quant": quant,
            "n_samples": samples,
            "sampling": {"max_new_tokens": max(response_len) if isinstance(response_len, tuple) else response_len},
        },
        "quant": {"invariant_scaling": {"s": 1.5}},
        "train": {"lr": 1e-5, "batch_prompts": prompts, "steps": steps, **(train or {})},
        "async": {"max_staleness": steps},
        "transport": endpoints,
        "cluster": {"learner_ranks": ranks},
        "checkpoint": {"every": 0, "keep": 1},
        "log": {"tensorboard": False, "level": "warning"},
    }
    config = run_dir + ".yaml"
    with open(config, "w") as f:
        yaml.safe_dump(cfg, f)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(
        [sys.executable, "-m", "learner.main", "--config", config],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ctx = zmq.Context()
    try:
        push = transport.Sender(transport.connect(ctx, zmq.PUSH, endpoints["trajectories"], max_bytes=1 << 20), "bench")
        transport.connect(ctx, zmq.SUB, endpoints["weights"], max_bytes=1 << 40, hwm=4)  # takes pushes, never read
        dealer = transport.connect(ctx, zmq.DEALER, endpoints["control"], max_bytes=1 << 20)
        control, replies = transport.Sender(dealer, "bench"), transport.Receiver(dealer, secret=None, max_bytes=1 << 20)
        while proc.poll() is None:  # hello until the learner is up, so the SUB is connected before the first push
            control.send(Status(type="hello", server_id="bench", version=0))
            if replies.recv(timeout_ms=500) is not None:
                break
        for step in range(steps):
            for g in groups(prompts, samples, prompt_len, response_len, vocab, seed=step):
                push.send(g)
        output, _ = proc.communicate(timeout=3600)
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.destroy(linger=0)
    if proc.returncode != 0:
        raise RuntimeError(f"learner failed ({proc.returncode}):\n{output[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarize(rows: list[dict], warmup: int) -> dict:
    measured = rows[warmup:] or rows
    med = lambda key: statistics.median(r[key] for r in measured)  # noqa: E731
    return {
        "step_s": med("time/step_s"),
        "push_s": med("sync/seconds"),
        "push_bytes": int(med("sync/bytes")),
        "changed_frac": med("sync/changed_frac"),
        "response_tokens": int(med("actor/tokens")),
        "peak_rss_mb": max(r["perf/peak_rss_mb"] for r in rows),
        "repeats": len(measured),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, one measured step (for tests)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank (1: on a shared machine more threads per process mostly wait)",
    )
    ap.add_argument("--steps", type=int, default=None, help="measured steps per row (default 3; 1 with --quick)")
    ap.add_argument("--models", default=None, help="comma-separated subset of demo,qwen2-150m (default both)")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--quants", default="int8,fp8,none")
    args = ap.parse_args(argv)
    measured = args.steps or (1 if args.quick else 3)
    names = ["tiny"] if args.quick else (args.models or "demo,qwen2-150m").split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="qurl-bench-learner-") as tmp:
        for name in names:
            if name == "demo":
                path, label = demo_model(tmp)
            elif name in ("qwen2-150m", "tiny"):
                path, label = random_qwen2(os.path.join(tmp, name), LARGE if name == "qwen2-150m" else TINY), name
            else:
                ap.error(f"--models: unknown model {name!r}; use demo or qwen2-150m")
            params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
            prompts, samples, prompt_len, response_len = WORKLOADS[name]
            for ranks in map(int, args.ranks.split(",")):
                for quant in args.quants.split(","):
                    started = time.monotonic()
                    metrics = run_learner(tmp, path, ranks, quant, 1 + measured, WORKLOADS[name], args.threads)
                    row = {
                        "model": label,
                        "model_params": params,
                        "ranks": ranks,
                        "quant": quant,
                        "threads_per_rank": args.threads,
                        "prompts": prompts,
                        "samples": samples,
                        "prompt_len": prompt_len,
                        "response_len": response_len,
                        **summarize(metrics, 1),
                    }
                    tokens = prompts * samples * (prompt_len + response_len)
                    row["tokens_per_s"] = tokens / row["step_s"]
                    row["train_s"] = row["step_s"] - row["push_s"]
                    row["run_wall_s"] = time.monotonic() - started
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    result = {"benchmark": "learner_step", "machine": machine_info(), "rows": rows}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
