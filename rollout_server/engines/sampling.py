"""Batched temperature / top-k / top-p / greedy sampling with the logprob of each sampled token.

The logprob is log_softmax(logits / T) over the full vocabulary (T = 1 for greedy rows); top-k and
top-p only restrict which tokens can be drawn and never renormalise it (SGLang semantics).
Each row draws with its own uniform number, so a row's token does not depend on its batch-mates.
Without top-k / top-p, fp32 logits on CPU are drawn by the CPU kernels' `sample_rows` in one pass per row
(csrc/decode_cpu.cpp); the same draw up to summation order.
"""

from __future__ import annotations

import torch

from qurl.cpu_kernels import usable


def sample(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ps: list[float],
    top_ks: list[int],
    uniforms: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 and per-row settings: temperature (0 = greedy), top_p, top_k (<= 0 = off), uniform in (0, 1].

    Returns the sampled token ids [B] (int64) and their logprobs [B] (fp32).
    """
    dev, vocab = logits.device, logits.shape[-1]
    restricted = any(0 < k < vocab for k in top_ks) or any(p < 1 for p in top_ps)
    kernels = usable(logits)
    if not restricted and hasattr(kernels, "sample_rows") and logits.dim() == 2 and logits.dtype == torch.float32:
        return kernels.sample_rows(
            logits.contiguous(),
            torch.tensor(temperatures, dtype=torch.float32),
            torch.tensor(uniforms, dtype=torch.float32),
        )
    greedy = [t == 0 for t in temperatures]
    if all(t in (0, 1) for t in temperatures):
        scaled = logits
    else:
        scaled = logits / torch.tensor([t or 1.0 for t in temperatures], device=dev)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    if all(greedy):
        tokens = logits.argmax(-1)
    else:
        probs = logprobs.exp()
        order = None
        if restricted:
            probs, order = _restrict(probs, top_ps, top_ks)
        cdf = probs.cumsum(-1)
        u = torch.tensor(uniforms, device=dev)
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=vocab - 1)
        tokens = tokens[:, 0] if order is None else order.gather(1, tokens)[:, 0]
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=dev), logits.argmax(-1), tokens)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def _restrict(probs: torch.Tensor, top_ps: list[float], top_ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities sorted in descending order with everything outside each row's top-k / top-p set zeroed."""
    dev, vocab = probs.device, probs.shape[-1]
    probs, order = probs.sort(-1, descending=True)
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=dev)
    probs = probs.masked_fill(torch.arange(vocab, device=dev)[None, :] >= k[:, None], 0.0)
    cdf = probs.cumsum(-1)
    top_p = torch.tensor(top_ps, device=dev)
    mass = torch.where(top_p < 1, top_p * cdf[:, -1], torch.inf)
    return probs.masked_fill(cdf - probs >= mass[:, None], 0.0), order  # smallest prefix reaching top_p
