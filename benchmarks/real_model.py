"""Real-model figures on SmolLM2-135M-Instruct (the real track, `qurl-prepare-real`) with GSM-Symbolic prompts.

Parts (all by default, or a subset with --parts):
- mismatch: step-0 mismatch of each rollout format against fp32. The format's engine samples responses (T=1) to
  real held-out prompts; transformers in fp32 (what the learner computes) scores the same tokens. Per token
  log_rho = logp_fp32 - logp_format; reports kl_k3 = mean(rho - 1 - log_rho) and kl_k1 (as the learner's
  mismatch/kl_* metrics), rho_max and rho_min. Formats (MISMATCH_FORMATS): bf16; int8 in an fp32 and a bf16
  engine, each with and without the int8 lm_head (quant.lm_head); fp8 (block 128x128; a quarter of the tokens,
  it is slow on CPU) at s = 1; and int8 with invariant scaling s = 1.5 on q/k/v (the recipe: the engine then
  holds the scaled weights; fp32 is unchanged by it).
- decode: tokens/s of the embedded engine per format on real prompts, fixed decode length (no stop token):
  prefill seconds (one new token), and decode tokens/s from the rest of the generation.
- learner: one real qurl-learner (benchmarks/learner_step.py's harness, synthetic groups of the recipe's shape)
  with train.precision fp32 and bf16 (FSDP2 mixed precision).
- micro: the learner step with padded against length-bucketed micro-batches (train.micro_batches), in --precision
  (auto: bf16 where the CPU has native bf16, fp32 elsewhere, as train.precision auto trains), on
  the pipeline benchmark's rollout-shaped batches (2 prompts x 8 samples of 190-260 prompt tokens, responses of
  16-256 tokens drawn per sample, one update per step); the same batches in both runs. padded_tokens is
  rows x longest row per forward, summed over the step's micro-batches (the learner's actor/padded_tokens).
  achieved_flops = step_flops / train_s (learner_flops: the decoder layers 6 per weight per padded token, the
  lm_head 6 per weight per response token, causal attention; one update per step: no separate proximal pass)
  against matmul_flops, a [4096, hidden] x [hidden, intermediate] matmul in that precision timed in the same run
  (before each learner run and after the last; the best of them):
  share_of_matmul_roofline.
- packed: the learner step with length-bucketed against prompt-packed micro-batches (learner/packing.py: each
  group's prompt once), in --precision, at the gym recipe's shape (8 prompts x 8 samples, 35-50 prompt tokens,
  8-12-token answers) and at the micro part's; the same batches for both modes.
- profile: where a learner step's time goes (--precision) on one gloo rank in this process (learner/policy_step.py's
  PolicyStep, the gym recipe's settings), at the micro part's batch shape (bucketed micro-batches) and at the gym
  recipe's (packed, as it trains): torch.profiler's self CPU time grouped by kind (matmuls, attention, the log-softmax
  head, the optimizer, the rest), after two warm-up steps.
- fused: the learner step (in --precision, one gloo rank in this process) with learner/fused.py's RMSNorm, SwiGLU
  and rotary embedding against transformers' own modules, at the gym recipe's shape (packed) and the micro part's
  (bucketed): both policies built side by side, their steps alternating for --rounds after a warm-up round; medians
  and their ratio.
- attention: the same as fused for learner/attention.py's compiled attention against torch's flash attention (both
  learners fused); and single forward and backward calls (ATTENTION_CALLS: SmolLM2's heads on the micro part's longest
  bucket and on its groups packed by learner/packing.py, Qwen2.5-7B's heads), the compiled against torch's flash
  attention, the backward from the same forward, alternating for --rounds, medians.
- rotary: the same as fused for learner/fused.py's attention forward (q, k and v in one GEMM, the rotary kernel)
  against transformers' own (both learners otherwise fused).
- linear: the learner step with learner/linear.py's weight gradients (dy transposed first) against torch's, one policy
  stepping in turns under each: SmolLM2 gym (packed) and micro (bucketed), and two of Qwen2.5-7B's decoder layers.
- layer: decoder layers of Qwen2.5-7B (hidden 3584, 28 heads; random weights, a vocabulary of 8,192) on the micro
  part's batches (bucketed): learners with 0 and 2 layers side by side in this process, steps alternating for --rounds
  after a warm-up; half their difference is one layer's seconds (fsdp, optimizer and all), and its share of the matmul
  roofline at the 7B's MLP shape (learner_flops for one layer), the part of the step that grows with depth (x 28).
- sync: int8 codes changed per push and delta / full push bytes per engine dtype after AdamW steps at the
  recipe's learning rate (or --sync-lr), s = 1 and 1.5 (benchmarks/sync.py's run on GSM text).

    python benchmarks/real_model.py [--parts mismatch,decode,learner,micro,packed,profile,fused,attention,rotary,
        linear,layer,sync] [--threads 2] [--sync-lr LR] [--precision auto|fp32|bf16] [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import OWN, QWEN25_7B, emit, machine_info, step_bytes  # noqa: E402  (benchmarks/common.py)

from learner import attention, fused, linear  # noqa: E402
from learner.batch import Batch  # noqa: E402
from learner.main import keep_freed_memory  # noqa: E402
from learner.model import bf16_training  # noqa: E402
from qurl import cpu_kernels  # noqa: E402
from qurl.data import PromptDataset  # noqa: E402
from qurl.quant.invariant_scaling import apply_invariant_scaling  # noqa: E402
from qurl.real.prepare import MODEL_DIR, default_root, read_info  # noqa: E402
from rollout_server.engines import GenRequest, load_engine  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the learner's train.precision -> its matmul dtype
PARTS = tuple("mismatch decode learner micro packed profile fused attention rotary linear layer sync".split())
# prompts, samples, prompt tokens, response tokens (a range: drawn per prompt / per sample)
MICRO_WORKLOAD = (2, 8, (190, 260), (16, 256))  # the pipeline benchmark's rollout-shaped batches
GYM_WORKLOAD = (8, 8, (35, 50), (8, 12))  # configs/smollm2-gym-cpu.yaml: 8 x 8 samples, ~10-token answers
# the side-by-side parts: each learner's name and which of learner/model.py's CPU swaps it makes (SWAPS), shipped first
SIDE_BY_SIDE = {
    "fused": {"fused": ("fuse", "attention", "rotary"), "torch": ("attention",)},  # learner/fused.py's swaps or none
    "attention": {"compiled": ("fuse", "attention", "rotary"), "flash": ("fuse", "rotary")},  # learner/attention.py's
    "rotary": {"rotary": ("fuse", "attention", "rotary"), "transformers": ("fuse", "attention")},  # its attention
}
LAYER_SHAPE = dict(QWEN25_7B, vocab_size=8192)  # the layer part: the 7B's decoder layer (its head is §9's figure)
LAYER_DEPTHS = (0, 2)  # the layer part's two learners: their difference is two decoder layers
PACKED_MODES = ("bucketed", "packed")
RECIPE_LR = 1e-5  # configs/smollm2-gsm-cpu.yaml train.lr
# (quant, model dtype, s, int8 lm_head): bf16 rollout's own mismatch, then INT8's with and without the int8 lm_head
MISMATCH_FORMATS = (
    ("none", "bfloat16", 1.0, False),
    ("int8", "float32", 1.0, False),
    ("int8", "float32", 1.0, True),
    ("int8", "bfloat16", 1.0, False),
    ("int8", "bfloat16", 1.0, True),
    ("fp8", "float32", 1.0, False),
    ("int8", "float32", 1.5, False),
)
DECODE_FORMATS = {
    name: OWN[name] for name in ("fp32", "bf16", "int8", "int8+head", "int8+bf16", "int8+bf16+head", "fp8")
}


def real_paths() -> tuple[str, str]:
    root = default_root()
    if read_info(root) is None:
        raise SystemExit(f"real_model.py: no real track at {root}; run qurl-prepare-real")
    return str(root / MODEL_DIR), str(root / "gsm")


def real_prompts(model: str, gsm: str, n: int) -> list[list[int]]:
    ds = PromptDataset(os.path.join(gsm, "heldout.jsonl"), AutoTokenizer.from_pretrained(model), shuffle=False)
    return [ds[i].prompt_ids for i in range(n)]


def scaled_copy(model: str, path: str, s: float) -> str:
    """The model with invariant scaling s on q/k/v, saved as a folder (what the learner pushes to the engine)."""
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    apply_invariant_scaling(hf, s, ("qkv",))
    hf.save_pretrained(path)
    return path


@torch.no_grad()
def mismatch_rows(model: str, prompts: list[list[int]], new_tokens: int, tmp: str) -> list[dict]:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rows = []
    for quant, dtype, s, head in MISMATCH_FORMATS:
        path = model if s == 1.0 else scaled_copy(model, os.path.join(tmp, f"s{s}"), s)
        engine = load_engine(path, quant=quant, dtype=dtype, max_batch=len(prompts), max_seq_len=512, int8_lm_head=head)
        tokens = new_tokens if quant != "fp8" else max(2, new_tokens // 4)  # fp8 on CPU is a correctness path
        reqs = [
            GenRequest(p, max_new_tokens=tokens, temperature=1.0, seed=i, stop_token_ids=[2])
            for i, p in enumerate(prompts)
        ]
        log_rho = []
        for p, res in zip(prompts, engine.generate(reqs)):
            sample = res.samples[0]
            logits = hf(torch.tensor([p + sample.token_ids])).logits[0, len(p) - 1 : -1]
            fp = torch.log_softmax(logits, -1).gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            log_rho.append(fp - torch.tensor(sample.logprobs))
        lr = torch.cat(log_rho).double()
        rho = lr.exp()
        rows.append(
            {
                "part": "mismatch",
                "quant": quant,
                "model_dtype": dtype,
                "s": s,
                "int8_lm_head": head,
                "reference": "transformers fp32",
                "prompts": len(prompts),
                "tokens": lr.numel(),
                "temperature": 1.0,
                "kl_k3": (rho - 1 - lr).mean().item(),
                "kl_k1": (-lr).mean().item(),
                "rho_max": rho.max().item(),
                "rho_min": rho.min().item(),
                "abs_log_rho_mean": lr.abs().mean().item(),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def decode_rows(model: str, prompts: list[list[int]], new_tokens: int, repeats: int, formats: list[str]) -> list[dict]:
    """Prefill alone (1 new token) and the whole generation; decode tokens/s is the difference's rate."""
    rows = []
    for name in formats:
        quant, dtype, head = DECODE_FORMATS[name]
        engine = load_engine(
            model, quant=quant, dtype=dtype, max_batch=len(prompts), max_seq_len=512, int8_lm_head=head
        )
        tokens = new_tokens if quant != "fp8" else max(2, new_tokens // 8)  # fp8 on CPU is a correctness path
        engine.generate([GenRequest(prompts[0], max_new_tokens=2)])  # warm-up

        def timed(n: int) -> float:
            reqs = [GenRequest(p, max_new_tokens=n, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
            t = time.perf_counter()
            engine.generate(reqs)
            return time.perf_counter() - t

        prefill = statistics.median(timed(1) for _ in range(repeats))
        whole = statistics.median(timed(tokens) for _ in range(repeats))
        rows.append(
            {
                "part": "decode",
                "config": name,
                "quant": quant,
                "model_dtype": dtype,
                "int8_lm_head": head,
                "weight_bytes_per_step": step_bytes(engine),
                "batch": len(prompts),
                "prompt_len_mean": statistics.mean(map(len, prompts)),
                "new_tokens": tokens,
                "prefill_s": round(prefill, 3),
                "seconds": round(whole, 3),
                # None when load noise makes the whole generation look no longer than its prefill
                "decode_tokens_per_s": (
                    round(len(prompts) * (tokens - 1) / (whole - prefill), 1) if whole > prefill else None
                ),
                "tokens_per_s": round(len(prompts) * tokens / whole, 1),
                "repeats": repeats,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def learner_rows(model: str, steps: int, threads: int, tmp: str) -> list[dict]:
    from learner_step import run_learner, summarize

    workload = (4, 4, 230, 100)  # prompts, samples, prompt tokens, response tokens: the recipe's shapes
    rows = []
    for precision in ("fp32", "bf16"):
        metrics = run_learner(
            tmp, model, 1, "int8", 1 + steps, workload, threads, train={"precision": precision, "mini_batches": 2}
        )
        row = {
            "part": "learner",
            "precision": precision,
            "prompts": workload[0],
            "samples": workload[1],
            "prompt_len": workload[2],
            "response_len": workload[3],
            "mini_batches": 2,
            "threads": threads,
            **summarize(metrics, 1),
        }
        row["train_s"] = row["step_s"] - row["push_s"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def micro_rows(
    model: str,
    steps: int,
    threads: int,
    tmp: str,
    precision: str,
    workload: tuple = MICRO_WORKLOAD,
    modes: tuple[str, ...] = ("padded", "bucketed"),
    part: str = "micro",
) -> list[dict]:
    """One learner run per train.micro_batches mode on the same batches; each row's speedup over the first mode."""
    from learner_step import run_learner, summarize

    cfg = AutoConfig.from_pretrained(model)
    peaks = []  # the matmul rate before each run and after the last: the roofline is the best of them
    rows = []
    for mode in modes:
        peaks.append(matmul_flops(cfg.hidden_size, cfg.intermediate_size, DTYPES[precision]))
        train = {"precision": precision, "mini_batches": 1, "micro_batches": mode}
        metrics = run_learner(tmp, model, 1, "int8", 1 + steps, workload, threads, train=train)
        row = {
            **workload_row(part, workload, mode, precision, threads),
            **summarize(metrics, 1),
            "padded_tokens": statistics.median(r["actor/padded_tokens"] for r in metrics[1:]),
            "micro_batches_per_step": statistics.median(r["actor/micro_batches"] for r in metrics[1:]),
        }
        row["train_s"] = row["step_s"] - row["push_s"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    for row in rows[1:]:
        row[f"speedup_over_{modes[0]}"] = rows[0]["train_s"] / row["train_s"]
    peaks.append(matmul_flops(cfg.hidden_size, cfg.intermediate_size, DTYPES[precision]))
    peak = max(peaks)
    rows_per_step = workload[0] * workload[1]
    for row in rows:
        row["matmul_flops"] = round(peak)
        row["matmul_flops_samples"] = [round(p) for p in peaks]
        row["step_flops"] = round(learner_flops(cfg, row["padded_tokens"], row["response_tokens"], rows_per_step))
        row["achieved_flops"] = round(row["step_flops"] / row["train_s"])
        row["share_of_matmul_roofline"] = round(row["achieved_flops"] / peak, 3)
    return rows


def learner_flops(cfg, padded_tokens: float, response_tokens: float, rows: int, layers: int | None = None) -> float:
    """Matmul FLOPs of a one-update learner step, forward 2 and backward 4 per weight per token: the decoder layers
    on every padded token, the lm_head on the response tokens only (learner/logprobs.py runs it there), causal
    attention's 6 T^2 (heads x head_dim) per row and layer with T the mean row (padded_tokens / rows). With one
    update per step the proximal log-probs come from the same forward; the head's recomputation in backward is not
    counted. `layers`: that many decoder layers and no head (one layer's share, the figure that carries to depth)."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    layer = hidden * (2 * q + 2 * kv) + 3 * hidden * inter  # q, o; k, v; gate, up, down
    n = cfg.num_hidden_layers if layers is None else layers
    attention = 6 * q * padded_tokens * (padded_tokens / rows)
    body = n * (6 * layer * padded_tokens + attention)
    return body if layers is not None else body + 6 * hidden * cfg.vocab_size * response_tokens


def layer_rows(threads: int, tmp: str, precision: str, rounds: int) -> list[dict]:
    """Decoder layers of Qwen2.5-7B (LAYER_SHAPE, random weights) trained on the micro part's batches: learners with
    0 and 2 layers in this process, their steps alternating (the machine's drift cancels in each round's difference);
    a layer's seconds are half the difference, the part of a 28-layer step that grows with depth, against the matmul
    roofline at the 7B's MLP shape, measured before and after (the faster of the two)."""
    from learner_step import random_qwen2

    cfg = AutoConfig.for_model("qwen2", **LAYER_SHAPE)
    peak = [matmul_flops(cfg.hidden_size, cfg.intermediate_size, DTYPES[precision], repeats=3)]
    lo, hi = LAYER_DEPTHS
    paths = {
        n: random_qwen2(os.path.join(tmp, f"qwen25-7b-{n}"), dict(LAYER_SHAPE, num_hidden_layers=n)) for n in (lo, hi)
    }
    with one_rank():
        policies = {n: policy_step(path, precision, "bucketed") for n, path in paths.items()}
        seconds, result = alternate(steps(policies, profile_batch(MICRO_WORKLOAD, cfg.vocab_size)), rounds)
    peak.append(matmul_flops(cfg.hidden_size, cfg.intermediate_size, DTYPES[precision], repeats=3))
    padded = result.metrics["actor/padded_tokens"]
    layer_s = statistics.median((b - a) / (hi - lo) for a, b in zip(seconds[lo], seconds[hi]))
    flops = learner_flops(cfg, padded, 0, MICRO_WORKLOAD[0] * MICRO_WORKLOAD[1], layers=1)
    row = {
        **workload_row("layer", MICRO_WORKLOAD, "bucketed", precision, threads),
        "model": "Qwen2.5-7B's decoder layer (hidden 3584, intermediate 18944, 28 / 4 heads)",
        "rounds": rounds,
        "padded_tokens": padded,
        "steps_s": {f"{n} layers": v for n, v in seconds.items()},
        "layer_s": round(layer_s, 3),
        "layer_flops": round(flops),
        "matmul_flops": round(max(peak)),
        "matmul_flops_before_after": [round(p) for p in peak],
        "achieved_flops": round(flops / layer_s),
        "share_of_matmul_roofline": round(flops / layer_s / max(peak), 3),
        "layers_s_at_28_layers": round(28 * layer_s, 1),
    }
    print(json.dumps(row), file=sys.stderr, flush=True)
    return [row]


# torch.profiler op name -> kind, first match wins; everything else is "other" (norms, activations, copies, ...)
PROFILE_KINDS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn")),
    ("attention", ("scaled_dot_product", "flash_attention", "_attention")),  # learner/attention.py's _Attention too
    # the chunked head (learner/logprobs.py): logits - logsumexp and its exp over 49,152-wide rows, forward
    # (entropy) and backward; the step's other subs and exps act on small tensors
    ("log-softmax head", ("log_softmax", "logsumexp", "chunkedlogprob", "aten::sub", "aten::exp", "aten::gather")),
    ("optimizer", ("adam", "foreach", "clip_grad", "aten::_fused")),
    ("collectives", ("c10d", "gloo", "all_reduce", "allreduce", "all_gather", "reduce_scatter")),
)


def profile_rows(model: str, threads: int, precision: str) -> list[dict]:
    """Where a learner step's time goes: one profiled step at the micro part's shape (bucketed) and one at the gym
    recipe's (packed, as configs/smollm2-gym-cpu.yaml trains)."""
    return [
        profile_row(model, threads, precision, MICRO_WORKLOAD, "bucketed"),
        profile_row(model, threads, precision, GYM_WORKLOAD, "packed"),
    ]


def profile_batch(workload: tuple, vocab: int) -> Batch:
    """Random groups of the workload's shape: each group's samples share one prompt (prompt length drawn per group,
    response length per sample), as the server's groups do."""
    prompts, samples, (plo, phi), (rlo, rhi) = workload
    g = torch.Generator().manual_seed(0)
    group = torch.arange(prompts * samples) // samples
    prompt = torch.randint(plo, phi + 1, (prompts,), generator=g)[group]
    total = prompt + torch.randint(rlo, rhi + 1, (prompts * samples,), generator=g)
    ids = torch.randint(3, vocab, (prompts * samples, int(total.max())), generator=g)
    heads = torch.randint(3, vocab, (prompts, int(prompt.max())), generator=g)
    for i in range(len(ids)):
        ids[i, : prompt[i]] = heads[group[i], : prompt[i]]
    behav = -torch.rand(ids.shape, generator=g) * 2
    rewards = torch.rand(prompts * samples, generator=g).round()
    return Batch(ids, prompt, total, behav, rewards, group)


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """A one-rank gloo group in this process, as PolicyStep's collectives need."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# the attention part's single calls: name, heads, kv heads, head_dim, and the micro part's batch as bucketed rows (its
# longest) or packed (one row per group, learner/packing.py's mask)
ATTENTION_CALLS = (
    ("SmolLM2, bucketed", 9, 3, 64, "bucketed"),
    ("SmolLM2, packed", 9, 3, 64, "packed"),
    ("Qwen2.5-7B heads, bucketed", 28, 4, 128, "bucketed"),
)


def attention_call_rows(rounds: int) -> list[dict]:
    """One attention forward and backward per ATTENTION_CALLS shape in bf16: learner/attention.py's against torch's
    flash attention (its forward with the repeated k, v and additive mask it takes), the backward from the same
    forward, alternating after a warm-up, medians (dk, dv of torch's summed over each group)."""
    from learner.packing import pack

    batch = profile_batch(MICRO_WORKLOAD, 1000)
    rows = []
    for name, h, hk, d, layout in ATTENTION_CALLS:
        if layout == "packed":
            mask = pack(batch.input_ids, batch.prompt_len, batch.total_len, batch.group, 1, 0).allowed
            n, length = mask.shape[0], mask.shape[-1]
        else:
            mask, n, length = None, batch.input_ids.shape[0], batch.input_ids.shape[1]
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (
            torch.randn(n, length, heads, d, generator=g).to(torch.bfloat16).transpose(1, 2) for heads in (h, hk, hk, h)
        )

        def flash_forward(i: int) -> tuple:
            kr, vr = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
            additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, -torch.inf)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, kr, vr, 0.0, mask is None, attn_mask=additive
            )[:2]
            return out, lse, kr, vr, additive

        out, lse, kr, vr, additive = flash_forward(0)
        kernels = cpu_kernels.kernels()
        calls = {
            "forward": lambda i: kernels.attention_forward(q, k, v, mask is None, mask, d**-0.5),
            "flash_forward": flash_forward,
            "backward": lambda i: kernels.attention_backward(dout, q, k, v, out, lse, mask is None, mask, d**-0.5),
            "flash_backward": lambda i: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, kr, vr, out, lse, 0.0, mask is None, attn_mask=additive
            ),
        }
        seconds, _ = alternate(calls, rounds)
        ms = {key: round(1e3 * statistics.median(value), 2) for key, value in seconds.items()}
        row = {"part": "attention", "call": name, "shape": [n, h, hk, length, d], "masked": mask is not None}
        row |= {"rounds": rounds, **{f"{key}_ms": value for key, value in ms.items()}}
        row["forward_speedup"] = round(ms["flash_forward"] / ms["forward"], 3)
        row["backward_speedup"] = round(ms["flash_backward"] / ms["backward"], 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


# learner/model.py's CPU swaps, each as what a learner without it has stubbed out (rotary: FUSED less the attentions)
SWAPS = {
    "fuse": ("learner.model.fuse", lambda m: 0),
    "attention": ("learner.model.attention.install", lambda m: False),
    "rotary": ("learner.fused.FUSED", {k: v for k, v in fused.FUSED.items() if v[1] is not fused.attention_forward}),
}


def policy_step(model: str, precision: str, micro_batches: str, swaps: tuple[str, ...] = tuple(SWAPS)):
    """The gym recipe's PolicyStep for `model` on this process's rank (inside one_rank()), with those of
    learner/model.py's CPU swaps that `swaps` names (SWAPS; the others not made)."""
    from learner import model as policy_model
    from learner.policy_step import DistEnv, PolicyStep
    from qurl.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(
        os.path.join(root, "configs", "smollm2-gym-cpu.yaml"),
        [
            f"model.path={model}",
            "data.eval_files=[]",
            f"train.precision={precision}",
            "train.mini_batches=1",
            f"train.micro_batches={micro_batches}",
        ],
        check_paths=False,
    )
    torch.manual_seed(0)
    with contextlib.ExitStack() as stack:
        for name, (call, stub) in SWAPS.items():
            if name not in swaps:
                stack.enter_context(mock.patch(call, stub))
        policy = policy_model.build_policy(cfg, torch.device("cpu"))
    return PolicyStep(policy, None, cfg.train, cfg.algo, cfg.rollout.sampling, DistEnv(0, 1, 0, torch.device("cpu")))


def alternate(calls: dict[str, Callable[[int], object]], rounds: int) -> tuple[dict, object]:
    """Each call's seconds (it is given the round), the calls taking turns for a warm-up round and then `rounds` more
    (a drift of the machine's speed reaches them alike); and the last call's result."""
    seconds: dict = {name: [] for name in calls}
    for i in range(1 + rounds):
        for name, call in calls.items():
            t = time.perf_counter()
            result = call(i)
            if i:
                seconds[name].append(time.perf_counter() - t)
    return seconds, result


def steps(policies: dict, batch: Batch) -> dict[str, Callable[[int], object]]:
    """Each policy's learner step on `batch` as a call of alternate (the round is the step)."""
    return {
        name: functools.partial(lambda policy, i: policy.step(batch, step=i), policy)
        for name, policy in policies.items()
    }


def workload_row(part: str, workload: tuple, micro_batches: str, precision: str, threads: int) -> dict:
    """The fields every learner row shares."""
    return {
        "part": part,
        "micro_batches": micro_batches,
        "precision": precision,
        "prompts": workload[0],
        "samples": workload[1],
        "prompt_len": list(workload[2]),
        "response_len": list(workload[3]),
        "threads": threads,
    }


def profile_row(model: str, threads: int, precision: str, workload: tuple, micro_batches: str) -> dict:
    """One profiled learner step of the workload's shape, self CPU time by kind and the top operators."""
    from torch.profiler import ProfilerActivity, profile

    with one_rank():
        policy = policy_step(model, precision, micro_batches)
        batch = profile_batch(workload, AutoConfig.from_pretrained(model).vocab_size)
        for i in range(2):  # warm-up: the kept heap reaches its size by the third step (no page faults from there)
            policy.step(batch, step=i)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            result = policy.step(batch, step=2)
            seconds = time.perf_counter() - t
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_us = sum(e.self_cpu_time_total for e in events)
    kinds = {name: 0.0 for name, _ in PROFILE_KINDS} | {"other": 0.0}
    for e in events:
        kind = next((k for k, keys in PROFILE_KINDS if any(key in e.key.lower() for key in keys)), "other")
        kinds[kind] += e.self_cpu_time_total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    row = {
        **workload_row("profile", workload, micro_batches, precision, threads),
        "step_s": round(seconds, 2),
        "padded_tokens": result.metrics.get("actor/padded_tokens"),
        "share_by_kind": {k: round(v / total_us, 3) for k, v in kinds.items()},
        "top_ops": [{"op": e.key, "share": round(e.self_cpu_time_total / total_us, 3), "calls": e.count} for e in top],
    }
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def side_by_side_rows(part: str, model: str, threads: int, precision: str, rounds: int) -> list[dict]:
    """The learner step with and without one CPU swap (SIDE_BY_SIDE[part]), at the gym recipe's shape (packed) and the
    micro part's (bucketed): both policies in this process, their steps alternating, medians and their ratio."""
    rows = []
    for workload, micro_batches in ((GYM_WORKLOAD, "packed"), (MICRO_WORKLOAD, "bucketed")):
        with one_rank():
            policies = {
                name: policy_step(model, precision, micro_batches, swaps) for name, swaps in SIDE_BY_SIDE[part].items()
            }
            batch = profile_batch(workload, AutoConfig.from_pretrained(model).vocab_size)
            seconds, _ = alternate(steps(policies, batch), rounds)
        rows.append(compared_row(workload_row(part, workload, micro_batches, precision, threads), rounds, seconds))
    return rows


def compared_row(fields: dict, rounds: int, seconds: dict) -> dict:
    """A side-by-side row: `fields`, each learner's median step seconds (the shipped one first in `seconds`), every
    step's, and the other's median over the shipped one's; printed as it comes."""
    shipped, other = seconds
    row = {
        **fields,
        "rounds": rounds,
        f"{shipped}_s": statistics.median(seconds[shipped]),
        f"{other}_s": statistics.median(seconds[other]),
        "steps_s": seconds,
    }
    row["speedup"] = round(row[f"{other}_s"] / row[f"{shipped}_s"], 3)
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def linear_rows(model: str, threads: int, precision: str, rounds: int, tmp: str) -> list[dict]:
    """The learner step with learner/linear.py's weight gradients and with torch's (weight_grad's threshold out of
    reach), one policy stepping in turns under each: SmolLM2 at the gym recipe's shape (packed) and the micro part's
    (bucketed), and two of Qwen2.5-7B's decoder layers at the micro part's; medians and their ratio."""
    from learner_step import random_qwen2

    layers = random_qwen2(os.path.join(tmp, "qwen25-7b-linear"), dict(LAYER_SHAPE, num_hidden_layers=LAYER_DEPTHS[1]))
    rows = []
    for path, name, workload, micro_batches in (
        (model, "SmolLM2-135M", GYM_WORKLOAD, "packed"),
        (model, "SmolLM2-135M", MICRO_WORKLOAD, "bucketed"),
        (layers, "Qwen2.5-7B, 2 decoder layers", MICRO_WORKLOAD, "bucketed"),
    ):
        with one_rank():
            laid = steps(
                {"laid": policy_step(path, precision, micro_batches)},
                profile_batch(workload, AutoConfig.from_pretrained(path).vocab_size),
            )["laid"]

            def torch_grads(i: int, laid=laid) -> object:
                with mock.patch.object(linear, "WIDE", sys.maxsize):
                    return laid(i)

            seconds, _ = alternate({"laid": laid, "torch": torch_grads}, rounds)
        fields = workload_row("linear", workload, micro_batches, precision, threads)
        rows.append(compared_row({**fields, "model": name}, rounds, seconds))
    return rows


def matmul_flops(hidden: int, inter: int, dtype: torch.dtype, tokens: int = 4096, repeats: int = 7) -> float:
    """FLOP/s of one [tokens, hidden] x [hidden, inter] matmul in dtype, the learner's MLP shape (median)."""
    a, b = torch.randn(tokens, hidden, dtype=dtype), torch.randn(hidden, inter, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * tokens * hidden * inter / statistics.median(times)


def sync_rows(model: str, gsm: str, pushes: int, threads: int, lr: float) -> list[dict]:
    import sync

    tok = AutoTokenizer.from_pretrained(model)
    with open(os.path.join(gsm, "train.jsonl")) as f:
        texts = [
            (lambda r: r["prompt"][-1]["content"] + " #### " + r["reward_model"]["ground_truth"])(json.loads(x))
            for _, x in zip(range(sync.BATCH * pushes * 2), f)
        ]
    ids = [i for t in texts for i in tok(t)["input_ids"]]
    need = sync.BATCH * sync.SEQ
    data = [torch.tensor(ids[k * need : (k + 1) * need]).view(sync.BATCH, sync.SEQ) for k in range(pushes)]
    rows = []
    for s in (1.0, 1.5):
        runs = sync.run("smollm2-135m", model, lr, s, data, threads)
        rows += [dict(r, part="sync") for r in runs + sync.summaries(runs)]
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (learner: per rank)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for mismatch and decode")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="decode repeats (median)")
    ap.add_argument("--formats", default=",".join(DECODE_FORMATS), help="decode formats (comma-separated)")
    ap.add_argument("--steps", type=int, default=2, help="measured learner steps per precision")
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument(
        "--rounds", type=int, default=5, help="fused, attention, linear, layer: alternating measured steps per learner"
    )
    ap.add_argument("--precision", default="auto", choices=("auto", *DTYPES), help="micro and profile parts")
    ap.add_argument("--sync-lr", type=float, default=RECIPE_LR, help="the sync part's AdamW learning rate")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown part {bad[0]!r}; allowed: {', '.join(PARTS)}")
    bad = [f for f in args.formats.split(",") if f not in DECODE_FORMATS]
    if bad:
        ap.error(f"--formats: unknown format {bad[0]!r}; allowed: {', '.join(DECODE_FORMATS)}")
    torch.set_num_threads(args.threads)
    precision = "bf16" if bf16_training(args.precision, torch.device("cpu")) else "fp32"  # the learner's own rule
    model, gsm = real_paths()
    prompts = real_prompts(model, gsm, args.prompts)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="qurl-bench-real-") as tmp, torch.inference_mode(False):
        if "mismatch" in parts:
            rows += mismatch_rows(model, prompts, args.new_tokens, tmp)
        if "decode" in parts:
            with torch.inference_mode():
                rows += decode_rows(model, prompts, args.new_tokens, args.repeats, args.formats.split(","))
        if "learner" in parts:
            rows += learner_rows(model, args.steps, args.threads, tmp)
        if "micro" in parts:
            rows += micro_rows(model, args.steps, args.threads, tmp, precision)
        if "packed" in parts:
            for workload in (GYM_WORKLOAD, MICRO_WORKLOAD):
                rows += micro_rows(model, args.steps, args.threads, tmp, precision, workload, PACKED_MODES, "packed")
        keep_freed_memory()  # the parts below train in this process: its heap as the learner process keeps it
        if "profile" in parts:
            rows += profile_rows(model, args.threads, precision)
        for part in SIDE_BY_SIDE:
            if part in parts:
                rows += side_by_side_rows(part, model, args.threads, precision, args.rounds)
        if "attention" in parts and attention.ready():
            rows += attention_call_rows(args.rounds)
        if "linear" in parts:
            rows += linear_rows(model, args.threads, precision, args.rounds, tmp)
        if "layer" in parts:
            rows += layer_rows(args.threads, tmp, precision, args.rounds)
        if "sync" in parts:
            rows += sync_rows(model, gsm, args.pushes, args.threads, args.sync_lr)
    emit(
        {
            "benchmark": "real_model",
            "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32)",
            "machine": machine_info(load_avg_1m=f"{os.getloadavg()[0]:.2f}"),
            "rows": rows,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
