"""Held-out evaluation on rank 0 with the full-precision weights (`eval/acc_fp`).

The quantized side (`eval/acc_quant`) is measured by a rollout server with its own engine, on request
over the control channel (WeightSender.request_eval); both use qurl.evaluate.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from transformers import AutoTokenizer, GenerationConfig

from learner.model import load_hf
from qurl.config import get
from qurl.evaluate import EvalSet, avg_at_k, hf_greedy, load_eval_set
from qurl.rewards import RewardPool

log = logging.getLogger("learner")


class FpEvaluator:
    """Greedy accuracy (avg@k with k=1) of the learner's weights, loaded into an unsharded copy of the model."""

    def __init__(self, cfg: Any, eval_set: EvalSet) -> None:
        path = get(cfg, "model.path")
        self.eval_set = eval_set
        self.model = load_hf(path, torch.device("cpu"))
        self.model.config.use_cache = True
        tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        try:
            gen_eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:
            gen_eos = None
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        self.eos_ids = sorted(eos)
        self.max_new_tokens = get(cfg, "rollout.sampling.max_new_tokens")
        self.pool = RewardPool(get(cfg, "reward.name"), workers=1, timeout_s=get(cfg, "reward.timeout_s"))

    @classmethod
    def from_config(cls, cfg: Any) -> Optional["FpEvaluator"]:
        """None when the config names no eval files."""
        tokenizer = AutoTokenizer.from_pretrained(get(cfg, "model.path"))
        eval_set = load_eval_set(cfg, tokenizer)
        return cls(cfg, eval_set) if eval_set is not None else None

    def accuracy(self, state: dict[str, torch.Tensor]) -> float:
        """Load `state` (the gathered full weights) and score greedy responses on the eval set."""
        self.model.load_state_dict(state, strict=False)
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        responses = hf_greedy(self.model, self.eval_set.prompt_ids, self.pad_id, self.eos_ids, self.max_new_tokens)
        texts = [[self.tokenizer.decode(r, skip_special_tokens=True)] for r in responses]
        return avg_at_k(self.pool, texts, self.eval_set.answers)

    def close(self) -> None:
        self.pool.close()
