"""A short supervised warm start of the real model on the recipe's tasks, so that RL starts with a learning signal.

The bare SmolLM2-135M-Instruct almost never writes ``<answer>`` tags and solves a few percent of even
two-term sums, so nearly every GRPO group has zero advantage. As the demo does, and as reasoning RL recipes
do before RL, a few minutes of supervised training on the recipe's solutions (for these tasks, the answer in
tags: ``<answer>N</answer>``, the shortest response the reward reads) teaches the format and some of the skill.
It stops once greedy accuracy on a dev slice of the train side reaches ``target_acc``, leaving room for RL
(checked every ``eval_every`` steps, then after every step once within ``close_margin`` of it), or at
``max_steps``; then it measures greedy accuracy on the held-out rows and saves a Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from qurl.data import sft_batch, tokenize_prompts
from qurl.real.gym import gold


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """The supervised schedule; with the recipe's fingerprint, the cache key of the warm model."""

    max_steps: int = 160
    batch: int = 32
    lr: float = 3e-5
    warmup: int = 10
    eval_every: int = 5
    # within this of target_acc the dev slice is checked after every step: checked every 5, a bf16 warm start on the
    # AMX Xeon went 0.297 -> 0.398 between two checks and RL from there gained +0.11 (docs/RESULTS.md §11)
    close_margin: float = 0.1
    dev_size: int = 128
    # room for RL: from 0.3, RL with dynamic sampling gained +0.16 in 60 steps; from 0.4, +0.05 to +0.09
    # (docs/RESULTS.md §11; without the filter, a start at 0.15-0.3 left most groups all wrong)
    target_acc: float = 0.3
    max_new_tokens: int = 16
    seed: int = 0


def target_text(entry: dict) -> str:
    """The response the warm start teaches: the gold answer in the tags the reward reads."""
    return f"<answer>{entry['answer']}</answer>"


def sft_tensors(tokenizer: Any, rows: list[dict]) -> tuple[Any, Any, Any]:
    """Right-padded ids, labels on the response and its end token only, and lengths."""
    eos = tokenizer.eos_token_id
    prompts = tokenize_prompts(tokenizer, [r["prompt"] for r in rows])
    answers = tokenizer([target_text(gold(r)[1]) for r in rows], add_special_tokens=False)["input_ids"]
    return sft_batch(prompts, answers, eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)


def response_loss(model: Any, ids: Any, labels: Any) -> Any:
    """Mean next-token cross-entropy over the labelled positions, the head applied to those positions alone.

    The prompt is ~4x the response here, and the 49k-word head is a fifth of the model's FLOPs per position.
    """
    import torch

    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    logits = model.lm_head(hidden[keep]).float()
    return torch.nn.functional.cross_entropy(logits, target[keep])


def greedy_accuracy(model: Any, tokenizer: Any, rows: list[dict], max_new_tokens: int, batch_size: int = 64) -> float:
    """Mean gym reward of greedy responses: the same verifier and extraction as the RL run's evaluation."""
    from qurl.evaluate import hf_greedy
    from qurl.rewards import gym_reward

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = tokenize_prompts(tokenizer, [r["prompt"] for r in rows])
    responses = hf_greedy(model, prompts, pad, [eos], max_new_tokens, batch_size)
    out = tokenizer.batch_decode(responses, skip_special_tokens=True)
    return sum(gym_reward(t, r["reward_model"]["ground_truth"]) for t, r in zip(out, rows)) / len(rows)


def train(
    model_dir: Path,
    out: Path,
    train_rows: list[dict],
    heldout_rows: list[dict],
    ws: WarmStart,
    progress: bool = True,
) -> dict:
    """Supervised steps until the dev accuracy reaches ws.target_acc; saves the model to out; returns the measures."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qurl.hardware import native_bf16

    bf16 = native_bf16(torch.device("cpu"))  # fp32 weights and optimizer, bf16 matmuls where the CPU has them
    start = time.perf_counter()
    torch.manual_seed(ws.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dev, rows = train_rows[-ws.dev_size :], train_rows[: -ws.dev_size]
    ids, labels, lengths = sft_tensors(tokenizer, rows)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, ws.warmup)))
    gen = torch.Generator().manual_seed(ws.seed)
    base_dev = greedy_accuracy(model, tokenizer, dev, ws.max_new_tokens)
    history = [[0, None, base_dev]]
    dev_acc, loss_value, step = base_dev, float("nan"), 0
    bar = tqdm(total=ws.max_steps, desc="warm start", unit="step", disable=not progress, file=sys.stderr)
    bar.set_postfix(dev_acc=f"{dev_acc:.3f}")
    model.train()
    while dev_acc < ws.target_acc and step < ws.max_steps:
        step += 1
        idx = torch.randint(len(ids), (ws.batch,), generator=gen)
        width = int(lengths[idx].max())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = response_loss(model, ids[idx, :width], labels[idx, :width])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        loss_value = loss.item()
        bar.update(1)
        close = dev_acc >= ws.target_acc - ws.close_margin
        if close or step % ws.eval_every == 0 or step == ws.max_steps:
            dev_acc = greedy_accuracy(model, tokenizer, dev, ws.max_new_tokens)
            model.train()
            history.append([step, round(loss_value, 4), dev_acc])
            bar.set_postfix(loss=f"{loss_value:.3f}", dev_acc=f"{dev_acc:.3f}")
    bar.close()
    sft_s = time.perf_counter() - start
    heldout_acc = greedy_accuracy(model, tokenizer, heldout_rows, ws.max_new_tokens)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "warm_start": dataclasses.asdict(ws),
        "steps": step,
        "reached_target": dev_acc >= ws.target_acc,
        "base_dev_acc": base_dev,
        "dev_acc": dev_acc,
        "heldout_acc": heldout_acc,
        "heldout_size": len(heldout_rows),
        "final_loss": loss_value,
        "history": history,
        "sft_s": round(sft_s, 1),
        "threads": torch.get_num_threads(),
        "bf16_matmuls": bf16,
    }
