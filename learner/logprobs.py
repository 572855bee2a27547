"""Token log-probs (and entropy) of a causal LM in memory bounded by a chunk, not by vocabulary x length.

The lm_head projection, log-softmax and gather run over chunks of positions, so the fp32 logits of a whole
micro-batch ([rows, positions, vocabulary]: 9.5 GB at 16k tokens of a 152k vocabulary) never exist at once; the
backward recomputes each chunk's logits from the saved hidden states (one extra head matmul) instead of keeping
them. Each chunk is computed exactly as the dense path would (the head's matmul in the model's dtype, then fp32,
then / T), so values equal the dense ones within fp32 rounding.

The chunked head replaces lm_head.forward for one call of the whole model, so that under FSDP2 the head runs
inside the root module's forward, with its parameters unsharded and the root's backward hooks on its output.

The learner passes `keep`, its response tokens: only those positions reach the head. A micro-batch's positions
start..T-1 also hold the longer prompts' tails and the shorter responses' padding, which were half of them or more
at the recipes' shapes (gym: about 1,700 positions for about 640 response tokens; the micro benchmark's: about twice
its 2,611).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from learner import attention, linear
from qurl import cpu_kernels

CHUNK_ELEMENTS = 1 << 26  # logits per chunk (256 MB in fp32); a few such buffers are the head's whole peak


@dataclass
class LogProbs:
    """log softmax(logits / T) of each target token [rows, positions], and the policy's entropy there (or None)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None


def chunk_rows(vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Positions per chunk: as many as fit chunk_elements logits, at least 1."""
    return max(1, chunk_elements // vocab)


class _ChunkedLogprob(torch.autograd.Function):
    """logp[i] = log softmax(h[i] W^T / T)[t[i]] over chunks of rows; backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, rows, entropy_out, shape):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        out = torch.empty(shape, dtype=torch.float32, device=hidden.device)  # returned whole: not a view
        logp = out.view(-1)
        kernels = _kernels(hidden)
        for s in range(0, hidden.shape[0], rows):
            if kernels is not None:  # one pass per row over the matmul's logits, no fp32 copy of them
                logits = F.linear(hidden[s : s + rows], weight)
                row_lse, row_logp, row_ent = kernels.head_forward(
                    logits, targets[s : s + rows], temperature, entropy_out is not None
                )
                lse[s : s + rows], logp[s : s + rows] = row_lse, row_logp
                if entropy_out is not None:
                    entropy_out[s : s + rows] = row_ent
                continue
            logits = _logits(hidden[s : s + rows], weight, temperature)
            lse[s : s + rows] = torch.logsumexp(logits, dim=-1)
            logp[s : s + rows] = logits.gather(-1, targets[s : s + rows, None]).squeeze(-1) - lse[s : s + rows]
            if entropy_out is not None:  # H = lse - sum(p * logits), p = exp(logits - lse)
                weighted = logits.sub(lse[s : s + rows, None]).exp_().mul_(logits).sum(-1)
                entropy_out[s : s + rows] = lse[s : s + rows] - weighted
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad = grad.reshape(-1).float().contiguous()  # a sum()'s gradient arrives expanded (stride 0)
        grad_h = torch.empty_like(hidden) if need_h else None
        starts = range(0, hidden.shape[0], ctx.rows)
        # one chunk (the CPU recipes' steps): its product is the gradient, with no fp32 sum to add it into (none, a
        # micro-batch with no response token: a zero gradient)
        sum_w = need_w and len(starts) != 1
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if sum_w else None
        kernels = _kernels(hidden)
        for s in starts:
            h, g = hidden[s : s + ctx.rows], grad[s : s + ctx.rows, None]
            # d logp / d logits = onehot(t) - softmax, times the incoming gradient, then / T (the forward's division)
            if kernels is not None:  # in place over the recomputed logits, rounded once to their dtype
                d = F.linear(h, weight)
                kernels.head_backward_(d, targets[s : s + ctx.rows], lse[s : s + ctx.rows], g[:, 0], ctx.temperature)
            else:
                d = _shifted_logits(h, weight, ctx.temperature, lse[s : s + ctx.rows, None]).exp_().mul_(-g)
                d.scatter_add_(-1, targets[s : s + ctx.rows, None], g)
                if ctx.temperature > 0 and ctx.temperature != 1:
                    d = d.div_(ctx.temperature)
            d = d.to(weight.dtype)  # the dense path's grad enters the head matmul in the matmul's dtype too
            if need_h:
                grad_h[s : s + ctx.rows] = d @ weight
            if need_w and not sum_w:
                grad_w = linear.weight_grad(d, h)
            elif need_w and d.dtype == torch.float32:
                grad_w.addmm_(d.t(), h)
            elif need_w:  # the chunk's product in the matmul's dtype, summed over chunks in fp32
                grad_w.add_(linear.weight_grad(d, h))
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None


def _kernels(hidden: torch.Tensor) -> ModuleType | None:
    """The CPU kernels' head ops for these hidden states (qurl/cpu_kernels.py: one module, built at set-up), or None:
    on GPUs, where no compiler built them, and on x86 CPUs without AVX2."""
    if hidden.device.type != "cpu" or hidden.dtype not in (torch.float32, torch.bfloat16):
        return None
    module = cpu_kernels.kernels()
    return module if module is not None and hasattr(module, "head_forward") else None


def _shifted_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, lse: torch.Tensor) -> torch.Tensor:
    """_logits(...) - lse, as fp32. Unscaled 16-bit logits promote in the subtraction itself: one pass over the
    chunk where .float() then .sub_() made two (the values are the same: bf16 -> fp32 is exact)."""
    if temperature > 0 and temperature != 1:
        return _logits(hidden, weight, temperature).sub_(lse)
    logits = F.linear(hidden, weight)
    if logits.dtype in (torch.bfloat16, torch.float16):
        return torch.sub(logits, lse)
    return logits.float().sub_(lse)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's logits as the dense path makes them: the head's matmul, then fp32, then / T (T = 0: unscaled;
    T = 1 skips the division, which is exact)."""
    logits = F.linear(hidden, weight).float()
    return logits / temperature if temperature > 0 and temperature != 1 else logits


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> LogProbs:
    """log softmax(hidden W^T / T) at `targets`: hidden [..., H], weight [V, H], targets [...] -> [...] fp32."""
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    ent = torch.empty(flat_t.shape[0], dtype=torch.float32, device=hidden.device) if entropy else None
    rows = chunk_rows(weight.shape[0], chunk_elements)
    logp = _ChunkedLogprob.apply(flat_h, weight, flat_t, float(temperature), rows, ent, shape)
    return LogProbs(logp, ent.view(shape) if ent is not None else None)


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    start: int,
    temperature: float,
    entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
    keep: torch.Tensor | None = None,
) -> LogProbs:
    """log softmax(logits / T) of tokens input_ids[:, start:], each predicted from its prefix: [B, T - start].

    Right padding needs no attention mask: under the causal mask a real token never sees the pads after it. Only the
    last T - start + 1 hidden states reach the head, which runs in chunks (chunked_logprobs) inside the model's own
    forward. `entropy`: also the policy's entropy at each of those positions (no gradient). `keep` [B, T - start]:
    only these positions (see head_logprobs).
    """
    if start < 1:
        raise ValueError(f"token_logprobs needs start >= 1 (a token needs a prefix), got {start}")
    targets = input_ids[:, start:]
    return head_logprobs(
        model,
        lambda hidden: hidden[:, :-1],  # the last T - start + 1 positions of the final norm, less the last
        targets,
        temperature,
        entropy,
        chunk_elements,
        keep,
        input_ids=input_ids,
        logits_to_keep=targets.shape[1] + 1,
    )


def head_logprobs(
    model: nn.Module,
    select: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float,
    entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
    keep: torch.Tensor | None = None,
    **inputs: Any,
) -> LogProbs:
    """One forward of `model` on `inputs` whose lm_head is the chunked log-prob of `targets` at the hidden states
    select(final hidden states) picks, one per target; it runs inside the model's forward, so FSDP2's hooks hold.
    `keep` (bool, targets' shape): only those positions go through the head; the others read 0, with no gradient."""
    head = model.get_output_embeddings()
    side: dict[str, torch.Tensor | None] = {}

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        picked = select(hidden)
        if keep is None:
            out = chunked_logprobs(picked, head.weight, targets, temperature, entropy, chunk_elements)
            side["entropy"] = out.entropy
            return out.logp  # the model returns it as .logits, so FSDP2's backward hooks see it
        at = keep.reshape(-1).nonzero().squeeze(1)
        flat = picked.reshape(-1, picked.shape[-1]).index_select(0, at)
        out = chunked_logprobs(
            flat, head.weight, targets.reshape(-1).index_select(0, at), temperature, entropy, chunk_elements
        )
        side["entropy"] = None if out.entropy is None else _spread(out.entropy, at, targets.shape)
        return _spread(out.logp, at, targets.shape)

    swapped = head.__dict__.get("forward")  # a module swap's own forward (learner/linear.py's), put back after
    head.forward = forward
    try:
        with _attention(model, inputs["input_ids"]):
            logp = model(use_cache=False, **inputs).logits
    finally:
        del head.forward
        if swapped is not None:
            head.forward = swapped
    return LogProbs(logp, side["entropy"])


# torch's CPU flash attention splits queries into blocks of 32 below 192 positions (64 from there), where its
# backward ran 1.2-1.7x slower than the math path's matmuls, forward and backward together (bf16, SmolLM2's 9 / 3
# heads, 4k tokens per call, AMX Xeon; at 192 and above flash is 1.9-3.6x faster): the gym recipe's packed rows are
# ~135 positions. With learner/attention.py's compiled backward, flash's forward and that backward were 2.3-3.6x
# faster than the math path from 64 positions up (same machine; its compiled forward is faster still), so a model
# using it keeps it at every length.
MATH_ATTENTION_BELOW = 192


def _attention(model: nn.Module, input_ids: torch.Tensor) -> contextlib.AbstractContextManager:
    """The SDPA backend for rows this long: the math path for short rows on CPU, unless the model uses the compiled
    attention, else torch's own choice. The choice made in forward holds in backward (its autograd graph);
    activation checkpointing recomputes the forward in backward, outside this context, so a checkpointed model keeps
    torch's choice."""
    compiled = getattr(model.config, "_attn_implementation", None) == attention.NAME
    short = input_ids.device.type == "cpu" and input_ids.shape[-1] < MATH_ATTENTION_BELOW and not compiled
    checkpointed = getattr(model, "is_activation_checkpointing", None)  # transformers 5's name, else 4's
    if checkpointed is None:
        checkpointed = getattr(model, "is_gradient_checkpointing", False)
    if short and not checkpointed:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _spread(values: torch.Tensor, at: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """values [K] at flat positions `at` of a zero tensor of `shape` (differentiable in values)."""
    return values.new_zeros(shape.numel()).index_copy(0, at, values).view(shape)
