"""Held-out evaluation (rank 0): when to evaluate, `eval/acc_fp` of the full-precision weights here, and
`eval/acc_quant`, measured by a rollout server with its own engine on request over the control channel
(ControlPlane.request_eval); both use qurl.evaluate.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from learner.control_plane import ControlPlane
from learner.model import load_hf
from qurl.evaluate import EvalSet, avg_at_k, hf_greedy, load_eval_set
from qurl.metrics import MetricsLogger
from qurl.rewards import RewardPool

log = logging.getLogger("learner")

FINAL_EVAL_WAIT_S = 300.0  # how long the last step waits for a rollout server's quantized evaluation


class FpEvaluator:
    """Greedy accuracy (avg@k with k=1) of the learner's weights, loaded into an unsharded copy of the model."""

    def __init__(self, cfg: Any, eval_set: EvalSet) -> None:
        path = cfg.model.path
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
        self.max_new_tokens = cfg.rollout.sampling.max_new_tokens
        self.pool = RewardPool(cfg.reward.name, workers=1, timeout_s=cfg.reward.timeout_s)

    @classmethod
    def from_config(cls, cfg: Any) -> FpEvaluator | None:
        """None when the config names no eval files."""
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
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


class Evaluation:
    """eval/acc_fp on rank 0 at the start, every eval.every steps and after the last (unless eval.final is off);
    eval/acc_quant as it arrives."""

    def __init__(
        self,
        evaluator: FpEvaluator | None,
        plane: ControlPlane | None,
        scheme: str,
        every: int,
        steps: int,
        final: bool = True,
    ) -> None:
        self.evaluator, self.plane, self.scheme, self.every, self.steps = evaluator, plane, scheme, every, steps
        self.final = final
        self.resumed_at: int | None = None  # a resumed run's first step: its weights were evaluated before, if due
        self.pending: int | None = None  # the version of the last eval/acc_quant asked for and not yet logged

    def due(self, step: int) -> bool:
        """At the start, every eval.every steps, and after the last step (never without eval files); not again on
        the weights a resumed run starts from."""
        if self.evaluator is None or step == self.resumed_at:
            return False
        return step == 0 or (self.final and step >= self.steps) or bool(self.every and step % self.every == 0)

    def run(self, state: dict[str, torch.Tensor], step: int, version: int, metrics: MetricsLogger) -> None:
        """eval/acc_fp now, on these weights; eval/acc_quant later, from a server's engine at this version."""
        started = time.perf_counter()
        acc = self.evaluator.accuracy(state)
        metrics.log(step, {"eval/acc_fp": acc, "eval/version": version})
        self.plane.request_eval(version)
        self.pending = version
        log.info(
            "eval of version %d (full precision): %.4f on %d prompts in %.1f s",
            version,
            acc,
            len(self.evaluator.eval_set),
            time.perf_counter() - started,
        )

    def log_quant(self, step: int, metrics: MetricsLogger) -> list[int]:
        """Log the rollout servers' evaluations that arrived; return their versions."""
        versions = []
        for version, counters in self.plane.take_eval_results():
            metrics.log(step, {"eval/acc_quant": counters.get("acc"), "eval/version": version})
            log.info("eval of version %d (rollout engine, %s): %.4f", version, self.scheme, counters.get("acc", 0.0))
            versions.append(version)
            if self.pending is not None and version >= self.pending:
                self.pending = None
        return versions

    def wait_for_quant(self, step: int, metrics: MetricsLogger) -> None:
        """After the last step: wait (up to FINAL_EVAL_WAIT_S) until a server has evaluated the last version asked."""
        version, deadline = self.pending, time.monotonic() + FINAL_EVAL_WAIT_S
        while self.pending is not None and time.monotonic() < deadline:
            self.log_quant(step, metrics)
            time.sleep(0.2)
        if self.pending is not None:
            log.warning("no rollout server evaluated version %d within %.0f s", version, FINAL_EVAL_WAIT_S)

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
