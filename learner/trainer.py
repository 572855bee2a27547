"""The learner's loop (design.md §3): wait for a batch, proximal logprobs, advantages, mini-batch updates with
the QuRL objective, weight push, metrics, checkpoints. Read `Learner.run` top to bottom.

Every rank runs the same sequence of collectives. Rank 0 alone owns the sockets (trajectory PULL, weight
PUB, control ROUTER) and the metrics files; it broadcasts each batch as tensors and every rank trains on
its share of the groups. The loss of a mini-batch is normalised by the global token (or sequence) count,
so one rank and N ranks take the same step.
"""
from __future__ import annotations

import logging
import math
import os
import resource
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import zmq
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

from learner import checkpoint, push_transport
from learner.budget import Budget
from learner.buffer import Batch, TrajectoryBuffer, collate, min_version
from learner.evaluation import FpEvaluator
from learner.model import build_policy, invariant_scaling, token_logprobs
from learner.weight_sender import WeightSender
from qurl import books, run_folder, transport
from qurl.algorithms import group_advantages, kl_penalty, overlong_penalty, policy_loss
from qurl.config import get, run_dir, to_yaml
from qurl.data import DatasetError
from qurl.metrics import MetricsLogger
from qurl.protocol import CONTROL_MAX_BYTES, TRAJECTORY_MAX_BYTES
from qurl.quant import quantize_state_dict, scheme_for
from qurl.report import write_summary

log = logging.getLogger("learner")

MICRO_BATCH_TOKENS = 16384  # padded tokens per forward; bounds activation memory, never changes the result
WAIT_TICK_MS = 500  # rank 0 polls the socket this long between the collectives that keep every rank in step
CLOSE_LINGER_MS = 2000  # at exit, give the last weight push and replies this long to leave
WAIT, BATCH = 0, 1
FINAL_EVAL_WAIT_S = 300.0  # how long the last step waits for a rollout server's quantized evaluation
LOSS_METRICS = ("actor/clipfrac", "tis/truncated_frac", "acr/widened_frac", "acr/upper_max", "mismatch/kl_k1",
                "mismatch/kl_k3", "mismatch/rho_max")


class StartError(RuntimeError):
    """The learner cannot start (model.path unusable, an endpoint taken); one line naming the setting."""


class NonFiniteWeights(RuntimeError):
    """The policy's weights hold inf or NaN; one line naming the step and the last good checkpoint (empty off rank 0)."""


@dataclass
class DistEnv:
    """This process's place in the learner job."""

    rank: int
    world: int
    local_rank: int
    device: torch.device


@dataclass
class Progress:
    """What a checkpoint carries besides tensors: the learner's position and its counters (its data cursor)."""

    step: int = 0  # learner steps taken (a step whose every update was skipped still counts)
    version: int = 0  # weight versions published: optimizer-updated learner steps
    skipped_updates: int = 0  # optimizer steps skipped for a NaN / inf loss or grad norm
    buffer: dict = field(default_factory=dict)  # TrajectoryBuffer.counters() on rank 0


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


@dataclass
class MicroBatch:
    """Rows of one forward pass, cut to their own length: tokens [n, T], log-probs over positions start..T-1."""

    input_ids: torch.Tensor
    start: int
    mask: torch.Tensor  # [n, T - start] response tokens
    behav_logp: torch.Tensor  # [n, T - start]
    advantages: torch.Tensor  # [n]

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


class Learner:
    """Builds the model, optimizer, sockets and metrics; `run` trains until train.steps or a stop signal."""

    def __init__(self, cfg: DictConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.is_main = env.rank == 0
        self.run_dir = run_dir(cfg)
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        self.stop = StopFlag()
        self.started = time.monotonic()
        torch.manual_seed(cfg.run.seed)

        problem = None
        try:
            self.model = build_policy(cfg, env.device)
            self.reference = build_policy(cfg, env.device, trainable=False) if cfg.algo.kl_coef > 0 else None
        except (OSError, ValueError) as exc:  # transformers' errors for a folder it cannot load
            problem = StartError(f"model.path={cfg.model.path!r}: {_first_line(exc)}")
        self._all_started(problem)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        hf_config = self.model.config
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.dropout_free = not getattr(hf_config, "attention_dropout", 0.0) and all(
            m.p == 0 for m in self.model.modules() if isinstance(m, torch.nn.Dropout))
        pad = hf_config.pad_token_id if hf_config.pad_token_id is not None else hf_config.eos_token_id
        self.pad_id = int(pad[0] if isinstance(pad, list) else pad) if pad is not None else 0
        self.temperature = float(cfg.rollout.sampling.temperature)  # 0 (greedy) means unscaled logits
        self.scheme = scheme_for(cfg.rollout.quant, cfg.quant.fp8_granularity)
        self.engine_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.rollout.dtype]
        self.progress = Progress()
        self.saved_step = 0  # nothing to save before the first step
        self.timed_out = False  # no group arrived for async.wait_timeout_s
        self.drift_checked = False  # the first batch of this learner life is checked against algo.drift_kl_threshold
        self.evaluator = None
        problem = None
        if self.is_main:
            try:
                self.evaluator = FpEvaluator.from_config(cfg)
                self._open_hub()
            except DatasetError as exc:
                problem = StartError(f"data.eval_files: {exc}")
            except StartError as exc:
                problem = exc
        self._all_started(problem)

    def _all_started(self, problem: Optional[StartError]) -> None:
        """Collective: when any rank failed to start, every rank raises; one line says why (rank 0's if it has one)."""
        flags = torch.tensor([int(problem is not None and self.is_main), int(problem is not None)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1].item():
            raise problem if problem is not None and (self.is_main or not flags[0].item()) else StartError("")

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Train until train.steps or a stop signal; checkpoint, export hf/, summarise; return the exit code."""
        self._resume_or_start()
        last_mark = time.monotonic()
        while self.progress.step < self.cfg.train.steps:
            batch, info = self._next_batch()
            if batch is None:
                break
            started = time.monotonic()
            updated, metrics = self._train_step(batch)
            self.progress.step += 1
            sync = {"sync/seconds": 0.0, "sync/bytes": 0, "sync/changed_frac": 0.0}
            if updated:
                self.progress.version += 1
                sync = self._push()
            if self.is_main:
                now = time.monotonic()
                metrics.update(info, **sync, **self._rollout_rates(now - last_mark))
                metrics.update({"version": self.progress.version, "time/step_s": now - started,
                                "train/skipped_steps": self.progress.skipped_updates, **self._memory()})
                self.metrics.log(self.progress.step, metrics)
                self._check_drift(metrics["mismatch/kl_k3"])
                self._log_quant_evals()
                last_mark = now
                log.info("step %d version %d reward %.3f loss %.4g grad_norm %.3g kl_k3 %.2e step %.2fs sync %.2fs",
                         self.progress.step, self.progress.version, metrics["reward/mean"], metrics["loss/policy"],
                         metrics["actor/grad_norm"], metrics["mismatch/kl_k3"], metrics["time/step_s"],
                         sync["sync/seconds"])
            every = self.cfg.checkpoint.every
            if every and self.progress.step % every == 0:
                self._checkpoint()
        if self.progress.step != self.saved_step:
            self._checkpoint()
        if self.timed_out:
            if self.is_main:
                log.error("no trajectory group arrived for %.0f s (async.wait_timeout_s); servers: %s; stopping at "
                          "step %d (checkpointed), resume with run.resume=true", get(self.cfg, "async.wait_timeout_s"),
                          self.sender.status_line(), self.progress.step)
            return 1
        if self.is_main and self.evaluator is not None and self.progress.step >= self.cfg.train.steps:
            self._wait_for_quant_eval(self.progress.version)
        self._export()
        if self.is_main:
            books.write_ledger(self.run_dir, self._ledger())
            write_summary(self.run_dir, to_yaml(self.cfg), time.monotonic() - self.started,
                          {"books": books.close_run(self.run_dir, learner_ended_cleanly=True)})
            log.info("done: %d steps, version %d, run folder %s", self.progress.step, self.progress.version, self.run_dir)
        return 0

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        if self.is_main:
            self.sender.close()
            if hasattr(self, "metrics"):  # made once the resume point is known
                self.metrics.close()
            self.ctx.destroy(linger=CLOSE_LINGER_MS)

    # -- start: sockets, resume, the first push ----------------------------------------------------

    def _open_hub(self) -> None:
        """Rank 0 binds PULL (trajectories), PUB (weights) and ROUTER (control); `auto` picks free loopback ports."""
        cfg = self.cfg
        if not cfg.run.resume and run_folder.holds_run(self.run_dir):
            raise StartError(f"{self.run_dir} already holds a run; pass run.resume=true to continue it, "
                             "or choose another run.dir")
        secret = cfg.transport.secret.encode() if cfg.transport.secret else None
        self.ctx = zmq.Context()
        socks = {}
        for name, kind, max_bytes, hwm in (("trajectories", zmq.PULL, TRAJECTORY_MAX_BYTES, 1000),
                                           ("weights", zmq.PUB, CONTROL_MAX_BYTES, 4),
                                           ("control", zmq.ROUTER, CONTROL_MAX_BYTES, 1000)):
            endpoint = cfg.transport[name]
            if endpoint == "auto":
                endpoint = "tcp://127.0.0.1:*"
            try:
                socks[name] = transport.bind(self.ctx, kind, endpoint, secret=secret, max_bytes=max_bytes, hwm=hwm)
            except (zmq.ZMQError, ValueError) as exc:
                raise StartError(f"transport.{name}={cfg.transport[name]!r}: cannot bind: {_first_line(exc)}") from None
            log.info("transport.%s bound at %s", name, socks[name].getsockopt(zmq.LAST_ENDPOINT).decode())
        sender_id = f"learner-{os.getpid()}"
        receiver = transport.Receiver(socks["trajectories"], secret=secret, max_bytes=TRAJECTORY_MAX_BYTES,
                                      kinds=("trajectory_group",))
        self.buffer = TrajectoryBuffer(receiver, batch_prompts=cfg.train.batch_prompts,
                                       max_staleness=get(cfg, "async.max_staleness"),
                                       dynamic_sampling=cfg.algo.dynamic_sampling,
                                       vocab_size=int(self.model.config.vocab_size))
        self.sender = WeightSender(
            transport.Sender(socks["weights"], sender_id, secret=secret),
            transport.Receiver(socks["control"], secret=secret, max_bytes=CONTROL_MAX_BYTES, kinds=("status",)),
            transport.Sender(socks["control"], sender_id, secret=secret),
            self.scheme,
            Budget(get(cfg, "async.max_staleness"), cfg.train.batch_prompts, self.buffer.snapshot),
            full_every=cfg.sync.full_every)
        try:  # nccl: blocks until every rollout replica has joined the weight-update group
            self.pusher = push_transport.build(cfg, self.sender, self.scheme, self.env.device)
        except (ValueError, RuntimeError) as exc:
            raise StartError(f"sync.transport={get(cfg, 'sync.transport')}: {_first_line(exc)}") from None
        self._tokens_mark = 0

    def _resume_or_start(self) -> None:
        """run.resume: continue from the newest complete checkpoint and push its weights at once."""
        step = torch.tensor([-1])
        problem = None
        if self.is_main and self.cfg.run.resume:
            skipped: list[str] = []
            path = checkpoint.find_latest(self.ckpt_root, checkpoint.fingerprint(self.model), warn=skipped.append)
            for line in skipped:
                log.warning("%s", line)
            if path is not None:
                step[0] = int(os.path.basename(path).split("_")[1])
            elif skipped:  # starting over would overwrite them: an operator must look first
                problem = StartError(f"run.resume=true but no checkpoint in {self.ckpt_root} is usable "
                                     f"({'; '.join(skipped)}); nothing was changed")
            else:
                log.warning("run.resume=true but %s holds no checkpoint; starting from model.path", self.ckpt_root)
        self._all_started(problem)
        dist.broadcast(step, src=0)
        if step.item() >= 0:
            path = os.path.join(self.ckpt_root, f"step_{step.item()}")
            state = checkpoint.load(path, self.model, self.optimizer)
            self.progress = Progress(step=state["step"], version=state["version"],
                                     skipped_updates=state["skipped_updates"], buffer=state["buffer"])
            self.saved_step = self.progress.step
            if self.is_main:
                self.buffer.restore(self.progress.buffer)
                self.sender.reports = dict(state.get("reports", {}))
                self.sender.life = self.buffer.life
                self._tokens_mark = self.buffer.response_tokens
                log.info("resumed from %s: step %d, version %d", path, self.progress.step, self.progress.version)
        if self.is_main:
            cfg = self.cfg
            # a fresh start drops every old row (-1): only a start that failed before its first step leaves any
            self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.log.tensorboard, wandb_project=cfg.log.wandb_project,
                                         run_name=cfg.run.name, config=OmegaConf.to_container(cfg, resolve=True),
                                         resume_step=self.progress.step if cfg.run.resume else -1)
            self.sender.version = self.progress.version
            self.sender.start()
        self._push(publish=self.progress.version > 0)

    # -- data -------------------------------------------------------------------------------------

    def _next_batch(self) -> tuple[Optional[Batch], dict]:
        """Collective: the next batch on every rank, or None when a stop was asked for on any rank."""
        waited_from = last_line = time.monotonic()
        timeout = get(self.cfg, "async.wait_timeout_s")
        while True:
            idle = time.monotonic() - max(waited_from, self.buffer.last_arrival) if self.is_main else 0.0
            stop = torch.tensor([int(self.stop.requested), int(bool(timeout) and idle > timeout)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.any():
                self.timed_out = bool(stop[1].item())
                return None, {}
            groups, header = None, torch.zeros(3, dtype=torch.int64)
            if self.is_main:
                self.buffer.poll(WAIT_TICK_MS, self.progress.version)
                groups = self.buffer.take(self.progress.version)
                if groups is not None:
                    batch = collate(groups, self.pad_id)
                    header = torch.tensor([BATCH, *batch.input_ids.shape])
                elif time.monotonic() - last_line >= self.cfg.log.interval_s:
                    last_line = time.monotonic()
                    dropped = self.buffer.dropped
                    log.info("waiting for trajectories (%.0f s): have %d/%d groups, received %d, dropped %d stale, "
                             "%d filtered, %d invalid; servers: %s", last_line - waited_from, len(self.buffer.groups),
                             self.cfg.train.batch_prompts, self.buffer.received, dropped["stale"], dropped["filter"],
                             dropped["invalid"], self.sender.status_line())
            dist.broadcast(header, src=0)
            if header[0].item() == WAIT:
                continue
            n, length = int(header[1]), int(header[2])
            if not self.is_main:
                batch = Batch(torch.empty(n, length, dtype=torch.int64), torch.empty(n, dtype=torch.int64),
                              torch.empty(n, dtype=torch.int64), torch.empty(n, length, dtype=torch.float32),
                              torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int64))
            for t in (batch.input_ids, batch.prompt_len, batch.total_len, batch.behav_logp, batch.rewards, batch.group):
                dist.broadcast(t, src=0)
            info = self._batch_info(groups, time.monotonic() - waited_from) if self.is_main else {}
            return batch, info

    def _batch_info(self, groups: list, waited_s: float) -> dict:
        """Rank 0's view of the batch: rewards, staleness, lengths, reward statuses, buffer and server counters."""
        rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
        stale = torch.tensor([self.progress.version - min_version(g) for g in groups], dtype=torch.float64)
        lengths = torch.tensor([len(s.token_ids) for g in groups for s in g.samples], dtype=torch.float64)
        statuses = Counter(str(s.reward_details.get("status", "ok")) for g in groups for s in g.samples)
        with_signal = sum(len({s.reward for s in g.samples}) > 1 for g in groups)  # all-equal groups: advantage 0
        info = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std(unbiased=False).item(),
                "reward/groups_with_signal": with_signal,
                "staleness/mean": stale.mean().item(), "staleness/max": stale.max().item(),
                "rollout/response_len_mean": lengths.mean().item(), "time/wait_s": waited_s,
                "buffer/size": len(self.buffer.groups), "buffer/received": self.buffer.received,
                "buffer/dropped_stale": self.buffer.dropped["stale"],
                "buffer/dropped_filter": self.buffer.dropped["filter"],
                "buffer/dropped_invalid": self.buffer.dropped["invalid"],
                "buffer/bad_messages": sum(self.buffer.receiver.rejected.values()),
                "sync/repushes": self.sender.repushes, **self.sender.budget.take_window(self.progress.version)}
        info.update({f"reward/status_{k}": v for k, v in statuses.items()})
        server_totals: Counter = Counter()
        for server in list(self.sender.servers.values()):
            server_totals.update({k: v for k, v in server.counters.items() if isinstance(v, (int, float))})
        info.update({f"servers/{k}": v for k, v in server_totals.items()})
        return info

    def _check_drift(self, kl_k3: float) -> None:
        """Once per learner life, on its first batch: a behaviour/proximal gap far above quantization noise is a bug."""
        if self.drift_checked or math.isnan(kl_k3):  # a skipped update logs no mismatch: check the next batch
            return
        self.drift_checked = True
        threshold = self.cfg.algo.drift_kl_threshold
        if kl_k3 > threshold:
            log.warning("DRIFT: first batch mismatch/kl_k3 %.3g > algo.drift_kl_threshold %.3g: the rollout server's "
                        "policy is not the learner's; check that both load the same model.path and tokenizer and that "
                        "weight pushes are applied", kl_k3, threshold)

    def _rollout_rates(self, wall_s: float) -> dict:
        tokens = self.buffer.response_tokens - self._tokens_mark
        self._tokens_mark = self.buffer.response_tokens
        return {"rollout/tokens": tokens, "rollout/tokens_per_s": tokens / max(wall_s, 1e-9)}

    def _memory(self) -> dict:
        """Rank 0's peak host memory (and accelerator memory on GPU)."""
        out = {"perf/peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if self.env.device.type == "cuda":
            out["perf/peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.env.device) / 2**20
        return out

    # -- one learner step -------------------------------------------------------------------------

    def _plan(self, batch: Batch, advantages: torch.Tensor) -> tuple[list[list[MicroBatch]], torch.Tensor]:
        """This rank's micro-batches per mini-batch (groups split into mini-batches, then across ranks), and the
        global [tokens, sequences] of each mini-batch. Every rank gets the same number of micro-batches."""
        world, rank = self.env.world, self.env.rank
        chunks = torch.tensor_split(torch.arange(batch.num_groups), self.cfg.train.mini_batches)
        rows_per_mini = [torch.nonzero(torch.isin(batch.group, torch.tensor_split(c, world)[rank])).flatten()
                         for c in chunks]
        plan = [self._micro_rows(rows, batch) for rows in rows_per_mini]
        counts = torch.tensor([len(p) for p in plan])
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        response_len = batch.total_len - batch.prompt_len
        totals = torch.tensor([[float(response_len[r].sum()), float(len(r))] for r in rows_per_mini], dtype=torch.float64)
        dist.all_reduce(totals)
        micro = [[self._micro(batch, advantages, rows) for rows in p] + [self._micro(batch, advantages, None)] * (int(c) - len(p))
                 for p, c in zip(plan, counts)]
        return micro, totals

    @staticmethod
    def _micro_rows(rows: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
        """Cut rows (in order) into runs whose padded size stays within MICRO_BATCH_TOKENS (at least one row each)."""
        out, current, longest = [], [], 0
        for r in rows.tolist():
            length = int(batch.total_len[r])
            if current and (len(current) + 1) * max(longest, length) > MICRO_BATCH_TOKENS:
                out.append(torch.tensor(current))
                current, longest = [], 0
            current.append(r)
            longest = max(longest, length)
        if current:
            out.append(torch.tensor(current))
        return out

    def _micro(self, batch: Batch, advantages: torch.Tensor, rows: Optional[torch.Tensor]) -> MicroBatch:
        """Device tensors of `rows`; None gives one padding row with no response tokens (keeps FSDP's collectives in step)."""
        dev = self.env.device
        if rows is None:
            return MicroBatch(torch.full((1, 2), self.pad_id, device=dev), 1, torch.zeros(1, 1, dtype=torch.bool, device=dev),
                              torch.zeros(1, 1, device=dev), torch.zeros(1, device=dev))
        end, start = int(batch.total_len[rows].max()), int(batch.prompt_len[rows].min())
        pos = torch.arange(start, end)
        mask = (pos >= batch.prompt_len[rows, None]) & (pos < batch.total_len[rows, None])
        return MicroBatch(batch.input_ids[rows, :end].to(dev), start, mask.to(dev),
                          batch.behav_logp[rows, start:end].to(dev), advantages[rows].to(dev))

    def _advantages(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """GRPO-style group advantages, with DAPO's overlong penalty added to the rewards first when enabled."""
        rewards, info = batch.rewards.clone(), {}
        overlong = self.cfg.algo.overlong
        if overlong.enable:
            penalty = overlong_penalty(batch.total_len - batch.prompt_len, self.cfg.rollout.sampling.max_new_tokens,
                                       overlong.buffer, overlong.factor)
            rewards += penalty
            info["reward/overlong_penalty_mean"] = penalty.mean().item()
        return group_advantages(rewards, batch.group, estimator=self.cfg.algo.advantage), info

    def _lr(self, step: int) -> float:
        """Linear warmup over train.warmup_steps learner steps, then constant or cosine to 0 at train.steps."""
        t = self.cfg.train
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        if t.lr_schedule == "cosine":
            progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
            return t.lr * 0.5 * (1 + math.cos(math.pi * progress))
        return t.lr

    def _train_step(self, batch: Batch) -> tuple[bool, dict]:
        """Collective: mini-batch updates on one batch; returns whether any update was applied, and the metrics."""
        cfg, algo = self.cfg, self.cfg.algo
        advantages, metrics = self._advantages(batch)
        plan, totals = self._plan(batch, advantages)
        temp = self.temperature
        # one mini-batch of a dropout-free model: the first update's own forward is the proximal policy
        reuse_prox = len(plan) == 1 and self.dropout_free
        self.model.eval()
        with torch.no_grad():
            prox = None if reuse_prox else [[token_logprobs(self.model, m.input_ids, m.start, temp) for m in mini]
                                            for mini in plan]
            ref = ([[token_logprobs(self.reference, m.input_ids, m.start, temp) for m in mini] for mini in plan]
                   if self.reference is not None else None)
        self.model.train()
        lr = self._lr(self.progress.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        token_mean = algo.loss_agg == "token-mean"
        sums: Counter = Counter()  # loss-metric sums weighted by tokens
        maxes: dict[str, float] = {}
        losses, kls, norms, applied = [], [], [], 0
        for i, mini in enumerate(plan):
            tokens, seqs = totals[i].tolist()
            self.optimizer.zero_grad(set_to_none=True)
            finite, pg_sum, kl_sum = True, 0.0, 0.0
            for j, m in enumerate(mini):
                logp = token_logprobs(self.model, m.input_ids, m.start, temp)
                loss, lm = policy_loss(logp, logp.detach() if reuse_prox else prox[i][j], m.behav_logp, m.advantages, m.mask, mode=algo.loss,
                                       eps_low=algo.eps_low, eps_high=algo.eps_high, tis_cap=algo.tis_cap,
                                       agg=algo.loss_agg, dual_clip=algo.dual_clip)
                local = m.tokens if token_mean else int(m.mask.any(-1).sum())
                pg = loss * (local / (tokens if token_mean else seqs))
                kl = ((kl_penalty(logp, ref[i][j], algo.kl_kind) * m.mask).sum() / tokens if ref is not None
                      else torch.zeros((), device=logp.device))
                total = pg + algo.kl_coef * kl
                check = torch.tensor([pg.item(), kl.item()], dtype=torch.float64)
                dist.all_reduce(check)
                if not torch.isfinite(check).all():
                    finite = False
                    break
                (total * self.env.world).backward()  # FSDP averages gradients over ranks; the loss is already global
                pg_sum, kl_sum = pg_sum + check[0].item(), kl_sum + check[1].item()
                for key, value in lm.items():
                    if key.endswith("_max"):
                        maxes[key] = max(maxes.get(key, 0.0), value)
                    else:
                        sums[key] += value * m.tokens
            if finite:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.grad_clip)
                norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
                norms.append(norm)
                finite = math.isfinite(norm)
            if finite:
                self.optimizer.step()
                applied += 1
                losses.append(pg_sum)
                kls.append(kl_sum)
            else:
                self.optimizer.zero_grad(set_to_none=True)
                self.progress.skipped_updates += 1
                losses.append(float("nan"))
                log.warning("step %d: non-finite loss or grad norm in mini-batch %d; update skipped",
                            self.progress.step + 1, i)
        metrics.update(self._reduce_loss_metrics(sums, maxes, float(totals[:, 0].sum())))
        metrics.update({"loss/policy": _mean(losses), "actor/grad_norm": _mean(norms), "lr": lr,
                        "train/updates": applied, "actor/tokens": float(totals[:, 0].sum())})
        if ref is not None:
            metrics["loss/kl"] = _mean(kls)
        return applied > 0, metrics

    def _reduce_loss_metrics(self, sums: Counter, maxes: dict, tokens: float) -> dict:
        """Token-weighted means and maxima of policy_loss's metrics over every rank and micro-batch."""
        out = dict.fromkeys(LOSS_METRICS, float("nan"))  # a step whose every update was skipped logs null
        keys = sorted(sums)
        if not keys:
            return out
        mean_t = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(mean_t)
        max_keys = sorted(maxes)
        max_t = torch.tensor([maxes[k] for k in max_keys], dtype=torch.float64)
        dist.all_reduce(max_t, op=dist.ReduceOp.MAX)
        out.update({k: v / max(tokens, 1.0) for k, v in zip(keys, mean_t.tolist())})
        out.update(zip(max_keys, max_t.tolist()))
        return out

    # -- weights out ------------------------------------------------------------------------------

    def _engine_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the rollout engine loads: tied lm_head dropped, linears quantized, the rest in the engine's dtype."""
        if self.tied:
            state.pop("lm_head.weight", None)
        out = quantize_state_dict(state, self.scheme, self.cfg.quant.weight_bits)
        # passed-through tensors may share storage with the live parameters (one rank): copy them, so that a
        # later re-push of this version sends this version
        return {k: v.to(self.engine_dtype, copy=True) if v is state.get(k) else v for k, v in out.items()}

    def _push(self, publish: bool = True) -> dict:
        """Collective: gather full weights to rank 0, quantize, publish (publish=False: only remember the codes)."""
        started = time.perf_counter()
        self._require_finite()
        state = checkpoint.full_state_dict(self.model)
        if not self.is_main:
            return {}
        if self._eval_due():
            eval_started = time.perf_counter()
            self._evaluate(state)
            started += time.perf_counter() - eval_started  # sync/seconds counts the push alone
        tensors = self._engine_tensors(state)
        if not publish:
            self.sender.set_baseline(tensors)
            return {}
        stats = self.pusher.publish(self.progress.version, tensors)
        if stats is None:  # cuda-ipc: a server still reads the buffers this push would overwrite; the next one tries
            return {"sync/seconds": time.perf_counter() - started, "sync/bytes": 0, "sync/changed_frac": 0.0,
                    "sync/full_bytes": 0, "sync/delta": 0, "sync/skipped": 1}
        return {"sync/seconds": time.perf_counter() - started, "sync/bytes": stats.bytes,
                "sync/changed_frac": stats.changed_frac, "sync/full_bytes": stats.full_bytes,
                "sync/delta": int(stats.mode == "delta")}

    def _require_finite(self) -> None:
        """Collective: one pass over the local shards, so that inf / NaN weights never reach a push, checkpoint or hf/."""
        bad = torch.tensor([sum(int(not torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())
                                for p in self.model.parameters())])
        dist.all_reduce(bad)
        if not bad.item():
            return
        saved = os.path.join(self.ckpt_root, f"step_{self.saved_step}") if self.saved_step else ""
        if self.progress.step == self.saved_step:  # nothing trained in this life yet: what it loaded is bad
            line = (f"the weights loaded from {saved or 'model.path=' + repr(self.cfg.model.path)} hold inf or NaN "
                    f"({bad.item()} tensors); stopped before pushing them")
        else:
            line = (f"step {self.progress.step}: {bad.item()} weight tensors hold inf or NaN (train.lr="
                    f"{self.cfg.train.lr:g}); stopped before pushing, checkpointing or exporting them; last good "
                    f"checkpoint: {saved or 'none (none was written)'}")
        raise NonFiniteWeights(line if self.is_main else "")

    # -- evaluation (rank 0) --------------------------------------------------------------------------

    def _eval_due(self) -> bool:
        """At the start, every eval.every steps, and after the last step."""
        if self.evaluator is None:
            return False
        step, every = self.progress.step, self.cfg.eval.every
        return step == 0 or step >= self.cfg.train.steps or bool(every and step % every == 0)

    def _evaluate(self, state: dict[str, torch.Tensor]) -> None:
        """eval/acc_fp now, on these weights; eval/acc_quant later, from a server's engine at this version."""
        started = time.perf_counter()
        acc = self.evaluator.accuracy(state)
        self.metrics.log(self.progress.step, {"eval/acc_fp": acc, "eval/version": self.progress.version})
        self.sender.request_eval(self.progress.version)
        log.info("eval of version %d (full precision): %.4f on %d prompts in %.1f s", self.progress.version, acc,
                 len(self.evaluator.eval_set), time.perf_counter() - started)

    def _log_quant_evals(self) -> list[int]:
        """Log the rollout servers' evaluations that arrived; return their versions."""
        versions = []
        for version, counters in self.sender.take_eval_results():
            self.metrics.log(self.progress.step, {"eval/acc_quant": counters.get("acc"), "eval/version": version})
            log.info("eval of version %d (rollout engine, %s): %.4f", version, self.scheme, counters.get("acc", 0.0))
            versions.append(version)
        return versions

    def _wait_for_quant_eval(self, version: int) -> None:
        deadline = time.monotonic() + FINAL_EVAL_WAIT_S
        while time.monotonic() < deadline:
            if any(v >= version for v in self._log_quant_evals()):
                return
            time.sleep(0.2)
        log.warning("no rollout server evaluated version %d within %.0f s", version, FINAL_EVAL_WAIT_S)

    def _checkpoint(self) -> None:
        ledger = self._ledger() if self.is_main else {"buffer": {}, "reports": {}}
        state = {"step": self.progress.step, "version": self.progress.version,
                 "skipped_updates": self.progress.skipped_updates, **ledger}
        path = checkpoint.save(self.ckpt_root, self.progress.step, self.model, self.optimizer, state,
                               keep=self.cfg.checkpoint.keep)
        self.saved_step = self.progress.step
        if self.is_main:
            books.write_ledger(self.run_dir, ledger)  # the books as of this checkpoint, which a resume continues
            log.info("checkpoint %s", path)

    def _ledger(self) -> dict:
        """Rank 0's side of the run's books (qurl.books): buffer and wire counters, the servers' last reports."""
        return {"buffer": self.buffer.counters(), "reports": dict(self.sender.reports)}

    def _export(self) -> None:
        state = checkpoint.full_state_dict(self.model)
        if self.is_main:
            out = checkpoint.export_hf(state, self.cfg.model.path, os.path.join(self.run_dir, "hf"),
                                       invariant_scaling(self.cfg))
            log.info("exported %s", out)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
