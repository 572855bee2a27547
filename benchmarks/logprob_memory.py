"""Peak memory and time of the learner's log-prob computation: the dense head (every logit of a micro-batch at once,
the learner before issue 28) against the chunked head (learner/logprobs.py), forward and backward, side by side.

Each (head, tokens) case runs in a process of its own, so that its peak is its own: RSS on CPU (ru_maxrss),
torch.cuda.max_memory_allocated on GPU. `base_mb` is the process after building its inputs (and the model),
`extra_mb` = peak - base is what the log-prob computation itself adds. Shapes default to Qwen2.5-7B's head
(hidden 3584, vocabulary 152,064) over a micro-batch of 4 rows; `--layers 2` puts two decoder layers of the 7B's
shapes in front (the GPU check does; on a 24 GB CPU machine the dense head alone at 8k tokens nearly fills it).
A dense case whose logits would not fit in the memory this machine has free is reported as skipped, not run.

    python benchmarks/logprob_memory.py [--tokens 4096,8192,16384] [--layers 0] [--device cpu] [--quick] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import QWEN25_7B, emit, machine_info  # noqa: E402  (benchmarks/common.py)

from learner.logprobs import CHUNK_ELEMENTS, chunked_logprobs, token_logprobs  # noqa: E402

QUICK = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)
ROWS = 4  # rows per micro-batch: tokens / 4 positions each (DAPO: prompt <= 1024 + response <= 3072)
DENSE_COPIES = 3  # fp32 [tokens, vocabulary] buffers the dense head holds at once (logits and two temporaries)


def dense_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """The learner's log-probs before issue 28: fp32 logits of every position at once, logsumexp and gather."""
    logits = torch.nn.functional.linear(hidden, weight).float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def dense_model(model: torch.nn.Module, ids: torch.Tensor, start: int, temperature: float) -> torch.Tensor:
    """The same through a whole model, as learner/model.py:token_logprobs computed it."""
    keep = ids.shape[1] - start + 1
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[:, :-1].float() / temperature
    return logits.gather(-1, ids[:, start:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case(head: str, tokens: int, shape: dict, layers: int, device: str, dtype: str, repeats: int) -> dict:
    """One case in this process: build inputs, measure the base, then forward + backward `repeats` times."""
    dev, dt = torch.device(device), getattr(torch, dtype)
    torch.manual_seed(0)
    positions = tokens // ROWS
    vocab, hidden_size = shape["vocab_size"], shape["hidden_size"]
    ids = torch.randint(0, vocab, (ROWS, positions + 1), device=dev)
    if layers:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(**shape, num_hidden_layers=layers, use_cache=False)
        with dev:
            model = Qwen2ForCausalLM(config).to(dt)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # the gradients exist before the step, as in training

        def step() -> None:
            if head == "dense":
                logp = dense_model(model, ids, 1, 1.0)
            else:
                logp = token_logprobs(model, ids, 1, 1.0).logp
            logp.sum().backward()

    else:
        hidden = torch.randn(ROWS, positions, hidden_size, device=dev, dtype=dt, requires_grad=True)
        weight = (torch.randn(vocab, hidden_size, device=dev) * 0.02).to(dt).requires_grad_()
        weight.grad, hidden.grad = torch.zeros_like(weight), torch.zeros_like(hidden)
        targets = ids[:, 1:]

        def step() -> None:
            if head == "dense":
                logp = dense_head(hidden, weight, targets, 1.0)
            else:
                logp = chunked_logprobs(hidden, weight, targets, 1.0).logp
            logp.sum().backward()

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    base = peak_mb(dev)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - started)
    peak = peak_mb(dev)
    return {
        "head": head,
        "tokens": tokens,
        "layers": layers,
        "vocab": vocab,
        "hidden": hidden_size,
        "dtype": dtype,
        "device": device,
        "seconds": statistics.median(times),
        "repeats": repeats,
        "base_mb": round(base, 1),
        "peak_mb": round(peak, 1),
        "extra_mb": round(peak - base, 1),
        "memory": "max_memory_allocated" if dev.type == "cuda" else "ru_maxrss",
    }


def free_mb(device: str) -> float:
    """Memory this machine can still give a process: MemAvailable on CPU, free device memory on GPU."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0] / 2**20
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("MemAvailable"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,8192,16384", help="micro-batch sizes in tokens (4 rows each)")
    p.add_argument("--layers", type=int, default=0, help="decoder layers before the head (0: the head alone)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--heads", default="dense,chunked")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny shapes, for the test suite")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args(argv)
    shape = QUICK if args.quick else QWEN25_7B
    if args.child:  # one case, printed as JSON for the parent
        head, tokens = args.child.split(":")
        print(json.dumps(run_case(head, int(tokens), shape, args.layers, args.device, args.dtype, args.repeats)))
        return 0
    tokens_list = [int(t) for t in args.tokens.split(",")] if not args.quick else [256]
    rows = []
    for tokens in tokens_list:
        for head in args.heads.split(","):
            need_mb = DENSE_COPIES * tokens * shape["vocab_size"] * 4 / 2**20
            if head == "dense" and need_mb > 0.95 * free_mb(args.device):
                rows.append(
                    {
                        "head": head,
                        "tokens": tokens,
                        "skipped": f"needs ~{need_mb:.0f} MB of logits, {free_mb(args.device):.0f} MB free",
                    }
                )
                print(f"{head} {tokens}: skipped ({rows[-1]['skipped']})", file=sys.stderr)
                continue
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                f"{head}:{tokens}",
                "--layers",
                str(args.layers),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--repeats",
                str(args.repeats),
            ]
            limit = None
            if args.device == "cpu":  # an allocation past the free memory fails in the case, not in the OOM killer

                def limit() -> None:
                    cap = int((free_mb("cpu") + 2048) * 2**20)
                    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

            done = subprocess.run(
                cmd + (["--quick"] if args.quick else []), capture_output=True, text=True, preexec_fn=limit
            )
            if done.returncode != 0:
                rows.append({"head": head, "tokens": tokens, "failed": done.stderr.strip().splitlines()[-1:]})
            else:
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{head} {tokens}: {rows[-1]}", file=sys.stderr)
    ratios = {}
    for tokens in tokens_list:
        case = {r["head"]: r for r in rows if r["tokens"] == tokens and "seconds" in r}
        if len(case) == 2:
            ratios[str(tokens)] = {
                "extra_mb_chunked_over_dense": round(case["chunked"]["extra_mb"] / case["dense"]["extra_mb"], 3),
                "peak_mb_chunked_over_dense": round(case["chunked"]["peak_mb"] / case["dense"]["peak_mb"], 3),
                "seconds_chunked_over_dense": round(case["chunked"]["seconds"] / case["dense"]["seconds"], 3),
            }
    emit(
        {
            "benchmark": "logprob_memory",
            "machine": machine_info(),
            "chunk_elements": CHUNK_ELEMENTS,
            "rows": rows,
            "ratios": ratios,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
