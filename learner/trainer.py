"""The learner's loop (design.md §3): next batch -> policy step -> publish -> log -> checkpoint. Read `Learner.run`
top to bottom; each stage is a component that owns it:

    learner/hub.py           rank 0's sockets and the batch broadcast to every rank
    learner/policy_step.py   micro-batches, advantages, loss, optimizer, learning rate
    learner/weight_sync/     the weight push: what the engine loads, quantized on the device, whole or as a delta,
                             through one transport; the version the servers are to hold; resends to laggards
    learner/control_plane.py the rollout servers: hello / heartbeat / bye, grants, eval routing
    learner/evaluation.py    eval/acc_fp here, eval/acc_quant from a server
    learner/checkpointer.py  checkpoints, resume, the books ledger, hf/, summary.json

Every rank runs the same sequence of collectives; rank 0 alone owns the sockets and the metrics files.
"""

from __future__ import annotations

import logging
import math
import resource
import signal
import time
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from learner import checkpoint, core_lending, weight_sync
from learner.checkpointer import Checkpointer, TrainState
from learner.errors import BadRewards, MismatchStop, StartError, all_started, first_line
from learner.evaluation import Evaluation, FpEvaluator, acc_fp_mode
from learner.hub import Hub
from learner.mismatch_alarm import MismatchAlarm
from learner.model import build_policy, decoder_layers, invariant_scaling
from learner.policy_step import DistEnv, PolicyStep
from learner.reward_health import RewardHealth
from learner.weight_sync.tensors import gather_engine_tensors
from qurl.config import rollout_dtype, run_dir, to_yaml
from qurl.data import DatasetError
from qurl.outputs.metrics import MetricsLogger
from qurl.quant import scheme_for
from qurl.supervisor import run_folder

log = logging.getLogger("learner")


class StopFlag:
    """SIGTERM / SIGINT ask for a clean stop (finish the step, checkpoint, export, exit 0); a second one kills."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        log.info("got signal %d: stopping after the current step (again to abort)", signum)
        self.requested = True
        signal.signal(signum, signal.SIG_DFL)


class Learner:
    """Builds the components; `run` trains until train.steps or a stop signal."""

    def __init__(self, cfg: DictConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.is_main = env.rank == 0
        self.run_dir = run_dir(cfg)
        self.stop = StopFlag()
        self.started = time.monotonic()
        torch.manual_seed(cfg.run.seed)

        problem = None
        try:
            model = build_policy(cfg, env.device)
            reference = build_policy(cfg, env.device, trainable=False) if cfg.algo.kl_coef > 0 else None
        except (OSError, ValueError) as exc:  # transformers' errors for a folder it cannot load
            problem = StartError(f"model.path={cfg.model.path!r}: {first_line(exc)}")
        all_started(problem, self.is_main)
        self.policy = PolicyStep(model, reference, cfg.train, cfg.algo, cfg.rollout.sampling, env)
        self.scheme = scheme_for(cfg.rollout.quant, cfg.quant.fp8_granularity)
        self.engine_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[rollout_dtype(cfg)]
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.state = TrainState()
        self.drift_checked = False  # the first batch of this learner life is checked against algo.drift_kl_threshold
        self.skipped_in_a_row = 0  # steps since the last one that updated the weights
        self.alarm = MismatchAlarm(cfg.mismatch.max_kl, cfg.mismatch.alarm_steps, cfg.mismatch.smoothing)
        self.ckpt = Checkpointer(self.run_dir, cfg.checkpoint, cfg.model.path, cfg.train.lr, self.is_main)
        rewards = RewardHealth(cfg.reward.max_error_frac, cfg.reward.name)
        self.hub = Hub(env, self.policy.pad_id, cfg.train.batch_prompts, cfg.async_, cfg.log.interval_s, rewards)
        evaluator, self.weight_sync, self.metrics = None, None, None
        problem = None
        if self.is_main:
            try:
                evaluator = FpEvaluator.from_config(cfg, env.device)
                self._open_hub(model)
            except DatasetError as exc:
                problem = StartError(f"data.eval_files: {exc}")
            except StartError as exc:
                problem = exc
        self.evaluation = Evaluation(
            evaluator,
            self.hub.plane,
            self.scheme,
            cfg.eval.every,
            cfg.train.steps,
            cfg.eval.final,
            mode=acc_fp_mode(cfg, env.device),
            enabled=bool(cfg.data.eval_files),
        )
        all_started(problem, self.is_main)
        # one rank beside co-located CPU servers: their cores while they wait (qurl-async sets it up)
        self.lending = core_lending.from_env(self.hub.plane.servers_idle) if self.hub.plane and env.world == 1 else None
        if self.lending is not None:
            self.lending.attach(decoder_layers(model))

    def _open_hub(self, model: torch.nn.Module) -> None:
        """Rank 0: claim the run folder, bind the sockets, build the push transport (nccl: wait for the replicas)."""
        cfg = self.cfg
        if not cfg.run.resume and run_folder.holds_run(self.run_dir):
            raise StartError(
                f"{self.run_dir} already holds a run; pass run.resume=true to continue it, or choose another run.dir"
            )
        try:  # nccl: blocks until every rollout replica has joined the weight-update group
            self.weight_sync = self.hub.open(
                cfg.transport,
                cfg.algo.dynamic_sampling,
                int(model.config.vocab_size),
                lambda pub, servers: weight_sync.build(cfg, pub, servers, self.scheme, self.env.device),
            )
        except (ValueError, RuntimeError) as exc:
            raise StartError(f"sync.transport={cfg.sync.transport}: {first_line(exc)}") from None

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Train until train.steps or a stop signal; checkpoint, export hf/, summarise; return the exit code."""
        self._resume_or_start()
        last_mark = time.monotonic()
        while self.state.step < self.cfg.train.steps:
            batch, info = self.hub.next_batch(self.state.version, lambda: self.stop.requested)
            if batch is None:
                break
            started = time.monotonic()
            result = self.policy.step(batch, self.state.step)
            self.state.step += 1
            self.state.skipped_updates += result.skipped
            self.skipped_in_a_row = 0 if result.updated else self.skipped_in_a_row + 1
            self.ckpt.require_progress(self.skipped_in_a_row, self.state.step, self.cfg.train.max_skipped_steps)
            # every rank: the metric is all-reduced, so all of them fire (and stop) at the same step
            alarm, alarm_line = self.alarm.observe(self.state.step, result.metrics["mismatch/kl_k3"])
            sync = self.weight_sync.metrics() if self.is_main else {}
            self.state.version += int(result.updated)
            self.hub.step_done(self.state.version)  # room for the servers that will hold it: before the push
            if result.updated:
                sync = self._push()
            if self.is_main:
                last_mark = self._log_step(dict(result.metrics, **info, **sync, **alarm), started, last_mark)
            if alarm_line is not None:
                self._mismatch_alarm(alarm_line)
            if self.ckpt.due(self.state.step):
                self._checkpoint()
        if self.state.step != self.ckpt.saved_step:
            self._checkpoint()
        if self.hub.stopped_for_rewards:  # the line names the reward function; resuming before fixing it repeats it
            raise BadRewards(
                f"{self.hub.reward_problem}; stopped at step {self.state.step} (checkpointed)" if self.is_main else ""
            )
        if self.hub.timed_out:
            if self.is_main:
                log.error(
                    "no trajectory group arrived for %.0f s (async.wait_timeout_s); servers: %s; stopping at "
                    "step %d (checkpointed), resume with run.resume=true",
                    self.cfg.async_.wait_timeout_s,
                    self.hub.servers.status_line(),
                    self.state.step,
                )
            return 1
        self.evaluation.hold(self.state.step, self.metrics, final=True)  # a background eval/acc_fp finishes first
        if self.is_main and self.evaluation.enabled and self.state.step >= self.cfg.train.steps:
            self.evaluation.wait_for_quant(self.state.step, self.metrics)
        self.ckpt.export(self.policy.model, invariant_scaling(self.cfg))
        if self.is_main:
            self.ckpt.close_run(self.hub.ledger(), to_yaml(self.cfg), self.started)
            log.info("done: %d steps, version %d, run folder %s", self.state.step, self.state.version, self.run_dir)
        return 0

    def close(self) -> None:
        self.evaluation.close()
        if self.is_main:
            if self.metrics is not None:  # made once the resume point is known
                self.metrics.close()
            self.hub.close()

    def _resume_or_start(self) -> None:
        """run.resume: continue from the newest complete checkpoint and push its weights at once."""
        cfg = self.cfg
        resumed = self.ckpt.resume(self.policy.model, self.policy.optimizer) if cfg.run.resume else None
        if resumed is not None:
            path, self.state, saved = resumed
            self.evaluation.resumed_at = self.state.step
            if self.is_main:
                self.hub.restore(self.state.buffer, saved.get("reports", {}))
                self.hub.step_done(self.state.version)
                log.info("resumed from %s: step %d, version %d", path, self.state.step, self.state.version)
        if self.is_main:
            # a fresh start drops every old row (-1): only a start that failed before its first step leaves any
            self.metrics = MetricsLogger(
                self.run_dir,
                tensorboard=cfg.log.tensorboard,
                wandb_project=cfg.log.wandb_project,
                run_name=cfg.run.name,
                config=OmegaConf.to_container(cfg, resolve=True),
                resume_step=self.state.step if cfg.run.resume else -1,
            )
            self.weight_sync.start(self.state.version)
            self.hub.start()
        self._push(send=self.state.version > 0)

    def _push(self, send: bool = True) -> dict:
        """Collective: the weights as the engine loads them, gathered and quantized on the device, to rank 0, which
        pushes them (send=False: the version the servers start from) and starts their evaluation when due (on the full
        fp32 weights, gathered for it alone); an inline evaluation holds every rank until it is done."""
        started = time.perf_counter()
        model = self.policy.model
        self.ckpt.require_finite(model, self.state.step)
        state = checkpoint.full_state_dict(model) if self.evaluation.due(self.state.step) else {}
        tensors = gather_engine_tensors(
            model, self.scheme, self.cfg.quant.weight_bits, self.engine_dtype, self.tied, self.is_main
        )
        sync = {}
        if self.is_main:
            gathered_s = time.perf_counter() - started
            if state:
                if self.lending is not None:  # the servers evaluate beside it: each side on its own share
                    self.lending.give_back()
                self.evaluation.start(state, self.state.version)  # not part of sync/seconds
            if send:
                sync = self.weight_sync.push(self.state.version, tensors, gathered_s)
            else:
                self.weight_sync.start(self.state.version, tensors)
        held = self.evaluation.hold(self.state.step, self.metrics)
        return dict(sync, **{"time/eval_s": held}) if self.is_main else sync

    def _checkpoint(self) -> None:
        ledger = self.hub.ledger() if self.is_main else None
        self.ckpt.save(self.policy.model, self.policy.optimizer, self.state, ledger)

    # -- metrics (rank 0) -------------------------------------------------------------------------

    def _log_step(self, metrics: dict, started: float, last_mark: float) -> float:
        """One metrics.jsonl row and one log line for the step just taken; returns the new rate mark."""
        now = time.monotonic()
        metrics.update(self.hub.rollout_rates(now - last_mark))
        metrics.update(
            {
                "version": self.state.version,
                "time/step_s": now - started,
                "train/skipped_steps": self.state.skipped_updates,
                **self._memory(),
                **(self.lending.metrics() if self.lending is not None else {}),
            }
        )
        self.metrics.log(self.state.step, metrics)
        self._check_drift(metrics["mismatch/kl_k3"])
        self.evaluation.log_quant(self.state.step, self.metrics)
        log.info(
            "step %d version %d reward %.3f loss %.4g grad_norm %.3g kl_k3 %.2e step %.2fs sync %.2fs",
            self.state.step,
            self.state.version,
            metrics["reward/mean"],
            metrics["loss/policy"],
            metrics["actor/grad_norm"],
            metrics["mismatch/kl_k3"],
            metrics["time/step_s"],
            metrics["sync/seconds"],
        )
        return now

    def _mismatch_alarm(self, line: str) -> None:
        """Warn; with mismatch.stop, checkpoint (the learner's weights are sound) and stop with exit 3."""
        if self.is_main:
            log.warning("MISMATCH: %s", line)
        if self.cfg.mismatch.stop:
            self._checkpoint()
            raise MismatchStop(
                f"{line}; stopped at step {self.state.step} (mismatch.stop=true; checkpointed, resume with "
                "run.resume=true once the push is fixed)"
                if self.is_main
                else ""
            )

    def _check_drift(self, kl_k3: float) -> None:
        """Once per learner life, on its first batch: a behaviour/proximal gap far above quantization noise is a bug."""
        if self.drift_checked or math.isnan(kl_k3):  # a skipped update logs no mismatch: check the next batch
            return
        self.drift_checked = True
        threshold = self.cfg.algo.drift_kl_threshold
        if kl_k3 > threshold:
            log.warning(
                "DRIFT: first batch mismatch/kl_k3 %.3g > algo.drift_kl_threshold %.3g: the rollout server's "
                "policy is not the learner's; check that both load the same model.path and tokenizer and that "
                "weight pushes are applied",
                kl_k3,
                threshold,
            )

    def _memory(self) -> dict:
        """Rank 0's peak host memory (and accelerator memory on GPU)."""
        out = {"perf/peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if self.env.device.type == "cuda":
            out["perf/peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.env.device) / 2**20
        return out
