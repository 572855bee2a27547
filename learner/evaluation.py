"""Held-out evaluation (rank 0): when to evaluate, `eval/acc_fp` of the full-precision weights here, and
`eval/acc_quant`, measured by a rollout server with its own engine on request over the control channel
(ControlPlane.request_eval); both use qurl.evaluate.

eval/acc_fp (config `eval.acc_fp`) generates greedily on the learner's own device (rank 0's GPU in bf16, or the CPU
in fp32) in a thread of its own, never inside a collective: `inline` holds training until it is done, the other
ranks waiting in short collectives (`hold`); `background` lets training go on and logs the accuracy when it
arrives (the default on GPUs, where a 1.5B model's 8k-token AIME answers take minutes); `none` measures only
eval/acc_quant. Answers are capped at `eval.max_new_tokens`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from learner.control_plane import ControlPlane
from qurl.config import get
from qurl.evaluate import EvalSet, avg_at_k, eval_max_new_tokens, hf_greedy, load_eval_set
from qurl.outputs.metrics import MetricsLogger
from qurl.rewards import RewardPool

log = logging.getLogger("learner")

FINAL_EVAL_WAIT_S = 300.0  # how long the last step waits for a rollout server's quantized evaluation
HOLD_TICK_S = 0.5  # inline: the ranks meet this often while rank 0 evaluates (no long collective)


def acc_fp_mode(cfg: Any, device: torch.device) -> str:
    """eval.acc_fp resolved: auto is background on a GPU learner and inline on the CPU."""
    mode = get(cfg, "eval.acc_fp")
    return ("background" if device.type == "cuda" else "inline") if mode == "auto" else mode


class FpEvaluator:
    """Greedy accuracy (avg@k with k=1) of the learner's weights, in an unsharded copy of the model on `device`
    (fp32 on the CPU, bf16 on a GPU, where the copy stays on the CPU between evaluations)."""

    def __init__(self, cfg: Any, eval_set: EvalSet, device: torch.device) -> None:
        path = cfg.model.path
        self.eval_set, self.device = eval_set, device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
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
        self.max_new_tokens = eval_max_new_tokens(cfg)
        self.pool = RewardPool(cfg.reward.name, workers=1, timeout_s=cfg.reward.timeout_s)

    @classmethod
    def from_config(cls, cfg: Any, device: torch.device) -> FpEvaluator | None:
        """None when the config names no eval files or sets eval.acc_fp=none."""
        if get(cfg, "eval.acc_fp") == "none":
            return None
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        eval_set = load_eval_set(cfg, tokenizer)
        return cls(cfg, eval_set, device) if eval_set is not None else None

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Copy `state` (the gathered full weights) into the evaluator's own model; the caller may reuse it after."""
        self.model.load_state_dict(state, strict=False)
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()

    def accuracy(self) -> float:
        """Score greedy responses of the loaded weights on the eval set (thread-safe against training: own model)."""
        if self.device.type == "cuda":
            self.model.to(self.device)
        try:
            cuda = self.device.type == "cuda"  # its own stream: the training thread's kernels keep running
            with torch.cuda.stream(torch.cuda.Stream(self.device)) if cuda else contextlib.nullcontext():
                prompts = self.eval_set.prompt_ids
                responses = hf_greedy(self.model, prompts, self.pad_id, self.eos_ids, self.max_new_tokens)
        finally:
            if self.device.type == "cuda":
                self.model.to("cpu")
        texts = [[self.tokenizer.decode(r, skip_special_tokens=True)] for r in responses]
        return avg_at_k(self.pool, texts, self.eval_set.answers)

    def close(self) -> None:
        self.pool.close()


class Evaluation:
    """eval/acc_fp on rank 0 at the start, every eval.every steps and after the last (unless eval.final is off);
    eval/acc_quant as it arrives. `enabled`: there are eval files (eval/acc_quant is asked for even with
    eval.acc_fp=none)."""

    def __init__(
        self,
        evaluator: FpEvaluator | None,
        plane: ControlPlane | None,
        scheme: str,
        every: int,
        steps: int,
        final: bool = True,
        mode: str = "inline",
        enabled: bool | None = None,
    ) -> None:
        self.evaluator, self.plane, self.scheme, self.every, self.steps = evaluator, plane, scheme, every, steps
        self.final, self.mode = final, mode
        self.enabled = evaluator is not None if enabled is None else enabled
        self.resumed_at: int | None = None  # a resumed run's first step: its weights were evaluated before, if due
        self.pending: int | None = None  # the version of the last eval/acc_quant asked for and not yet logged
        self._thread: threading.Thread | None = None
        self._running: tuple[int, float] | None = None  # (version, start time) of the acc_fp in flight
        self._result: tuple[int, float | BaseException, float] | None = None  # (version, acc or error, seconds)

    def due(self, step: int) -> bool:
        """At the start, every eval.every steps, and after the last step (never without eval files); not again on
        the weights a resumed run starts from."""
        if not self.enabled or step == self.resumed_at:
            return False
        return step == 0 or (self.final and step >= self.steps) or bool(self.every and step % self.every == 0)

    def start(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Rank 0: ask a server for eval/acc_quant of `version`, and start eval/acc_fp of `state` (unless one is
        still running: then this version has no acc_fp)."""
        if self.plane is not None:
            self.plane.request_eval(version)
            self.pending = version
        if self.evaluator is None:
            return
        if self._thread is not None and self._thread.is_alive():
            log.warning(
                "eval of version %d (full precision) skipped: the evaluation of version %d is still running",
                version,
                self._running[0],
            )
            return
        self.evaluator.load(state)
        self._running = (version, time.perf_counter())
        self._thread = threading.Thread(target=self._evaluate, args=(version,), name="qurl-eval-fp", daemon=True)
        self._thread.start()

    def _evaluate(self, version: int) -> None:
        started = time.perf_counter()
        try:
            acc: float | BaseException = self.evaluator.accuracy()
        except Exception as exc:  # noqa: BLE001  (reported on the main thread, which stops the run)
            acc = exc
        self._result = (version, acc, time.perf_counter() - started)

    def busy(self) -> bool:
        """An eval/acc_fp is generating (rank 0)."""
        return self._thread is not None and self._thread.is_alive()

    def hold(self, step: int, metrics: MetricsLogger | None, final: bool = False) -> float:
        """Collective: inline (or `final`, before the run ends), wait until rank 0's eval/acc_fp is done, every rank
        meeting each HOLD_TICK_S, so that no rank sits in one collective for the evaluation's length; the seconds
        held (time/eval_s: a step's evaluation is on its time/step_s, and throughput figures leave it out)."""
        if self.mode != "inline" and not final:
            self.log_fp(step, metrics)
            return 0.0
        started = time.perf_counter()
        is_main = dist.get_rank() == 0
        while True:
            busy = torch.tensor([int(is_main and self.busy())])
            if dist.get_world_size() > 1:
                dist.all_reduce(busy, op=dist.ReduceOp.MAX)
            if not busy.item():
                break
            if is_main:
                self._thread.join(HOLD_TICK_S)
        self.log_fp(step, metrics)
        return time.perf_counter() - started

    def log_fp(self, step: int, metrics: MetricsLogger | None) -> None:
        """Rank 0: log an eval/acc_fp that finished; raise what its thread raised."""
        if self._result is None or metrics is None:
            return
        version, acc, seconds = self._result
        self._result = self._running = None
        if isinstance(acc, BaseException):
            raise acc
        metrics.log(step, {"eval/acc_fp": acc, "eval/version": version})
        log.info(
            "eval of version %d (full precision, %s): %.4f on %d prompts in %.1f s",
            version,
            self.mode,
            acc,
            len(self.evaluator.eval_set),
            seconds,
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
        if self._thread is not None:
            self._thread.join()
        if self.evaluator is not None:
            self.evaluator.close()
