"""Held-out evaluation shared by both processes: the eval prompts, and avg@k scoring of responses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qurl.config import get
from qurl.data import DatasetError, PromptDataset
from qurl.rewards import RewardPool


@dataclass
class EvalSet:
    """Tokenised eval prompts with their gold answers, in file order (no shuffle)."""

    prompt_ids: list[list[int]]
    answers: list[str]

    def __len__(self) -> int:
        return len(self.answers)


def load_prompts(cfg: Any, files: list[str], tokenizer: Any, **options: Any) -> PromptDataset:
    """The prompts that fit both data.max_prompt_len and the KV cache's room before a full response; when none
    fits, DatasetError names the key that limits them."""
    room = get(cfg, "rollout.max_seq_len") - get(cfg, "rollout.sampling.max_new_tokens")
    limit = get(cfg, "data.max_prompt_len")
    try:
        return PromptDataset(
            files,
            tokenizer,
            max_prompt_len=max(1, min(limit, room)),
            instruction=get(cfg, "data.instruction"),
            **options,
        )
    except DatasetError as exc:
        if room >= limit:
            raise
        raise DatasetError(
            f"rollout.max_seq_len={get(cfg, 'rollout.max_seq_len')} leaves {max(room, 0)} tokens for a "
            f"prompt after rollout.sampling.max_new_tokens={get(cfg, 'rollout.sampling.max_new_tokens')} "
            f"(data.max_prompt_len={limit}); raise rollout.max_seq_len ({exc})"
        ) from None


def eval_max_new_tokens(cfg: Any) -> int:
    """eval.max_new_tokens, or the rollout's answer length when it is 0: the longest answer either engine writes."""
    return get(cfg, "eval.max_new_tokens") or get(cfg, "rollout.sampling.max_new_tokens")


def load_eval_set(cfg: Any, tokenizer: Any) -> EvalSet | None:
    """The first eval.max_problems prompts of data.eval_files, or None when there are none."""
    files = list(get(cfg, "data.eval_files"))
    if not files:
        return None
    ds = load_prompts(cfg, files, tokenizer, shuffle=False)
    n = min(len(ds), get(cfg, "eval.max_problems"))
    examples = [ds[i] for i in range(n)]
    return EvalSet([list(e.prompt_ids) for e in examples], [e.answer for e in examples])


def avg_at_k(pool: RewardPool, responses: Sequence[Sequence[str]], answers: Sequence[str]) -> float:
    """Mean reward over k responses per problem (greedy accuracy when k = 1)."""
    items = [(text, answer) for texts, answer in zip(responses, answers) for text in texts]
    if not items:
        return 0.0
    results = pool.score(items)
    return float(sum(r.reward for r in results)) / len(results)


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module,
    prompts: list[list[int]],
    pad_id: int,
    eos_ids: list[int],
    max_new_tokens: int,
    batch_size: int = 256,
) -> list[list[int]]:
    """Greedy responses of a transformers model, left-padded in batches (the full-precision reference)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
        )
        for row in gen[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
            out.append(row[:cut])
    model.train(was_training)
    return out
