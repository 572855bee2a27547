"""Prompt-shared packing (train.micro_batches=packed): a group's prompt runs through the model once, not n times.

A GRPO group is n responses to one prompt. Padded or bucketed, a micro-batch runs that prompt n times. Packed, the
group is one row [prompt, r_1, ..., r_n]: response i's tokens take positions P, P+1, ... (as if right after the
prompt) and attend to the prompt and to their own earlier tokens only, through a [rows, 1, L, L] mask. Every token's
log-prob is then the unpacked one within rounding, and its gradient too: the prompt's last hidden state, which
predicts every response's first token, takes the sum of their gradients.

It pays where prompts are long against answers: the gym recipe's 35-50 prompt tokens, ~10 answer tokens and 8
samples are 3.8x fewer tokens per step (docs/RESULTS.md §11). The mask grows as L^2 per row (L = P + n x answer
length), so answers of thousands of tokens stay bucketed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from learner.logprobs import LogProbs, head_logprobs

ATTENTION = ("sdpa", "qurl_sdpa", "eager")  # the model's attention implementations that take a custom 4D mask


@dataclass
class Packed:
    """One row per group: ids and positions [G, L], who attends whom [G, 1, L, L], and for each target token of the
    unpacked rows [n, T - start] the flat index (into G x L) of the hidden state that predicts it."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    source: torch.Tensor


def pack(
    input_ids: torch.Tensor,
    prompt_len: torch.Tensor,
    total_len: torch.Tensor,
    group: torch.Tensor,
    start: int,
    pad_id: int,
) -> Packed:
    """Pack right-padded rows [n, T] (samples of one group share a prompt) into one row per group."""
    n, width = input_ids.shape
    order = list(dict.fromkeys(group.tolist()))  # groups in order of first appearance
    members = {g: [r for r in range(n) if int(group[r]) == g] for g in order}
    lengths = []
    for g, rows in members.items():
        p = int(prompt_len[rows[0]])
        if any(int(prompt_len[r]) != p or not torch.equal(input_ids[r, :p], input_ids[rows[0], :p]) for r in rows):
            raise ValueError(f"packing: the samples of group {g} do not share one prompt")
        lengths.append(p + sum(int(total_len[r]) - p for r in rows))
    length = max(lengths)
    ids = torch.full((len(order), length), pad_id, dtype=input_ids.dtype)
    pos = torch.zeros((len(order), length), dtype=torch.int64)
    segment = torch.full((len(order), length), -1, dtype=torch.int64)  # 0: the prompt, k: response k, -1: padding
    source = torch.zeros((n, width - start), dtype=torch.int64)
    for row, (g, rows) in enumerate(members.items()):
        p = int(prompt_len[rows[0]])
        ids[row, :p], pos[row, :p], segment[row, :p] = input_ids[rows[0], :p], torch.arange(p), 0
        at = p
        for k, r in enumerate(rows, start=1):
            t = int(total_len[r])
            ids[row, at : at + t - p] = input_ids[r, p:t]
            pos[row, at : at + t - p] = torch.arange(p, t)
            segment[row, at : at + t - p] = k
            # target j is predicted at position j - 1: the prompt's below p, this response's from p (padding
            # targets, masked out of the loss, read the row's last real position)
            before = torch.arange(start, width).sub_(1).clamp_(max=t - 1)
            local = torch.where(before < p, before, before - p + at)
            source[r] = row * length + local
            at += t - p
    causal = torch.ones(length, length, dtype=torch.bool).tril_()
    same = (segment[:, None, :] == 0) | (segment[:, :, None] == segment[:, None, :])  # [G, query, key]
    return Packed(ids, pos, (causal & same)[:, None], source)


def packed_logprobs(
    model: nn.Module,
    packed: Packed,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool = False,
    keep: torch.Tensor | None = None,
) -> LogProbs:
    """log softmax(logits / T) of targets [n, T - start] from one forward of the packed rows (see token_logprobs;
    `keep`: only those targets, see head_logprobs)."""
    kind = getattr(model.config, "_attn_implementation", None)
    if kind not in ATTENTION:
        raise ValueError(f"train.micro_batches=packed needs {' or '.join(ATTENTION)} attention; the model uses {kind}")
    device = packed.input_ids.device
    # sdpa takes the boolean mask; eager adds it to the scores
    mask = packed.allowed
    if kind == "eager":
        mask = torch.zeros(mask.shape, device=device).masked_fill_(~mask, torch.finfo(torch.float32).min)

    def gather(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return flat.index_select(0, packed.source.reshape(-1)).view(*packed.source.shape, hidden.shape[-1])

    return head_logprobs(
        model,
        gather,
        targets,
        temperature,
        entropy,
        keep=keep,
        input_ids=packed.input_ids,
        attention_mask=mask,
        position_ids=packed.position_ids,
        logits_to_keep=0,
    )
