"""The generation loop: admit groups, step the engine, score, send; take weight pushes between steps."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import zmq

from qurl.config import get, run_dir
from qurl.data import Example, PromptDataset
from qurl.evaluate import EvalSet, eval_max_new_tokens
from qurl.outputs import books
from qurl.rewards import RewardPool, RewardResult
from qurl.supervisor.layout import HEARTBEAT_ENV
from qurl.wire import protocol
from qurl.wire.frames import ProtocolError
from qurl.wire.protocol import Status, TrajectoryGroup, WeightPush, WeightRef
from qurl.wire.transport import Receiver, Sender
from rollout_server.admission import Admission
from rollout_server.engines import Completion, GenRequest
from rollout_server.scorer import Scorer
from rollout_server.weight_receiver import WeightReceiver

log = logging.getLogger("rollout_server")

HEARTBEAT_S = 1.0
ASK_S = 0.1  # the heartbeat's period while a free slot waits for grant: room the learner frees reaches us at once
IDLE_WAIT_MS = 20
COUNTERS = (
    "admitted",
    "generated",
    "scored",
    "sent",
    "send_retries",
    "tokens",
    "bad_messages",
    "bad_groups",
    "reward_timeouts",
    "reward_errors",
    "reward_nan",
    "engine_ms",  # wall milliseconds inside engine.step(): the server's own generation time
)


@dataclass
class Sockets:
    ctx: zmq.Context
    push: zmq.Socket  # trajectories
    sub: zmq.Socket  # weights
    dealer: zmq.Socket  # control

    def close(self, linger_ms: int = 500) -> None:
        """Close all three; the PUSH and DEALER get linger_ms to deliver what is queued."""
        for sock in (self.push, self.dealer):
            sock.setsockopt(zmq.LINGER, linger_ms)
        for sock in (self.push, self.sub, self.dealer):
            sock.close()
        self.ctx.term()


@dataclass
class Group:
    """One admitted prompt and its samples as they finish (in sample order)."""

    group_id: str
    example: Example
    samples: list[Completion | None]
    left: int


@dataclass
class EvalRun:
    """A held-out evaluation in flight: greedy (or avg@k) responses of one weight version."""

    version: int
    texts: list[list[str]]
    left: int


class EvalPrompt(NamedTuple):
    """Engine request id of held-out prompt `index` of an EvalRun; a training group's request id is its draw index."""

    index: int


def stop_token_ids(tokenizer: Any, model_path: str) -> list[int]:
    """The tokenizer's eos id plus every eos id of the model's generation_config.json."""
    from transformers import GenerationConfig

    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    if not ids:
        raise ValueError(f"{model_path}: neither the tokenizer nor generation_config.json names an eos token")
    return sorted(ids)


class Outbox:
    """Groups waiting for the PUSH socket; a full queue (HWM) keeps them for the next try, never drops."""

    def __init__(self, sender: Sender, counters: dict[str, int]) -> None:
        self.sender = sender
        self.counters = counters
        self.pending: deque[TrajectoryGroup] = deque()

    def flush(self) -> None:
        while self.pending:
            try:
                self.sender.send(self.pending[0], flags=zmq.NOBLOCK)
            except zmq.Again:
                self.counters["send_retries"] += 1
                return
            self.pending.popleft()
            self.counters["sent"] += 1


class RolloutLoop:
    """Single-threaded driver of one engine: every socket and engine call happens here, between decode steps.

    Status fields: running = groups in the engine (decoding or waiting for a slot); queued = finished
    groups waiting to be scored or sent.
    """

    def __init__(
        self,
        cfg: Any,
        *,
        server_id: str,
        engine: Any,
        scheme: str,
        tokenizer: Any,
        dataset: PromptDataset,
        pool: RewardPool,
        sockets: Sockets,
        secret: bytes | None,
        admission: Admission,
        stop_ids: list[int],
        eval_set: EvalSet | None = None,
        replica: int = 0,
        replaces_pid: int = 0,
    ) -> None:
        self.server_id, self.engine, self.scheme = server_id, engine, scheme
        self.replaces_pid = replaces_pid  # the dead server of this replica that this one replaces (0: none)
        self.tokenizer, self.dataset, self.admission, self.stop_ids = tokenizer, dataset, admission, stop_ids
        self.sockets = sockets
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.scorer = Scorer(pool)
        self.outbox = Outbox(Sender(sockets.push, server_id, secret=secret), self.counters)
        self.control = Sender(sockets.dealer, server_id, secret=secret)
        self.control_rx = Receiver(  # replies, eval requests, and weights addressed to this server alone
            sockets.dealer,
            secret=secret,
            max_bytes=sockets.dealer.getsockopt(zmq.MAXMSGSIZE),
            kinds=("status", "weight_push", "weight_ref"),
        )
        self.weights_rx = Receiver(
            sockets.sub,
            secret=secret,
            max_bytes=sockets.sub.getsockopt(zmq.MAXMSGSIZE),
            kinds=("weight_push", "weight_ref"),
        )
        self.running: dict[int, Group] = {}  # engine request id (draw index) -> group
        self.scoring = 0  # generated groups at the scorer
        self.run_dir = run_dir(cfg)
        self.weights = WeightReceiver(engine, scheme, lambda: self._status("resend_weights"), replica)
        self.addressed: list[WeightPush | WeightRef] = []  # weights sent to this server alone, for the next poll
        self.n = get(cfg, "rollout.n_samples")
        self.max_batch = get(cfg, "rollout.max_batch")
        self.seed = get(cfg, "run.seed")
        self.sampling = {
            k: get(cfg, f"rollout.sampling.{k}") for k in ("max_new_tokens", "temperature", "top_p", "top_k")
        }
        self.engine_name = get(cfg, "rollout.engine")
        self.draws = 0
        self.eval_set = eval_set
        self.eval_sampling = dict(
            self.sampling,
            temperature=get(cfg, "eval.temperature"),
            max_new_tokens=eval_max_new_tokens(cfg),
        )
        self.eval_k = get(cfg, "eval.n_samples")
        self.eval_wanted: int | None = None  # version the learner asked to evaluate
        self.eval_run: EvalRun | None = None  # generating; weight pushes wait until it is done
        self._last_heartbeat = 0.0
        self._beat_failed = False
        self._log_interval = get(cfg, "log.interval_s")
        self._last_log = time.monotonic()
        self._logged = dict(self.counters)

    # -- the loop -----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Run until stop is set."""
        self._status("hello")
        while not stop.is_set():
            self._poll_control()
            self._poll_weights()
            self._start_eval()
            self._admit()
            if self.engine.has_work():
                started = time.perf_counter()
                finished = self.engine.step()
                self.counters["engine_ms"] += round(1000 * (time.perf_counter() - started))
                self._finish(finished)
            for group, rewards in self.scorer.collect():
                self._enqueue(group, rewards)
            self.outbox.flush()
            self._tick()
            if not self.engine.has_work():
                self._wait_idle()

    def close(self) -> None:
        """Stop scoring, hand what is ready to the PUSH socket and say bye; the sockets' linger delivers them."""
        if not self.scorer.close(timeout_s=2.0):
            log.warning("a reward item is still being scored; leaving it to the pool's shutdown")
        for group, rewards in self.scorer.collect():
            self._enqueue(group, rewards)
        self.outbox.flush()
        self._status("bye")
        if os.path.isdir(self.run_dir):  # evidence for the run's books that outlives the learner
            books.write_exit_report(
                os.path.join(self.run_dir, books.EXIT_REPORTS), self.server_id, self.book_counters()
            )

    # -- work ---------------------------------------------------------------------------------

    def _fits(self) -> bool:
        """A free KV-cache slot: queue one more group, so slots freed by a group's early finishers refill at once."""
        return self.engine.num_running + self.engine.num_waiting < self.max_batch

    def _admit(self) -> None:
        while self.admission.room() > 0 and self._fits():
            example = self.dataset.next()
            index = self.draws
            self.draws += 1
            request = GenRequest(
                prompt_ids=example.prompt_ids,
                n=self.n,
                **self.sampling,
                stop_token_ids=self.stop_ids,
                seed=self.seed * 1_000_003 + index,
            )
            self.engine.add_request(request, index)
            self.running[index] = Group(f"{self.server_id}-{index}", example, [None] * self.n, self.n)
            self.admission.admit()
            self.counters["admitted"] += 1

    def _finish(self, finished: list[tuple[int | EvalPrompt, int, Completion]]) -> None:
        for rid, index, sample in finished:
            if isinstance(rid, EvalPrompt):
                self._finish_eval(rid.index, sample)
                continue
            group = self.running[rid]
            group.samples[index] = sample
            group.left -= 1
            self.counters["tokens"] += len(sample.token_ids)
            if group.left:
                continue
            del self.running[rid]
            self.counters["generated"] += 1
            texts = self.tokenizer.batch_decode([s.token_ids for s in group.samples], skip_special_tokens=True)
            self.scorer.submit(group, [(t, group.example.answer) for t in texts])
            self.scoring += 1

    def _enqueue(self, group: Group | EvalRun, rewards: list[RewardResult]) -> None:
        if isinstance(group, EvalRun):
            self._report_eval(group, rewards)
            return
        self.counters["scored"] += 1
        self.scoring -= 1
        for r in rewards:
            key = {"timeout": "reward_timeouts", "error": "reward_errors", "nan": "reward_nan"}.get(r.status)
            if key:
                self.counters[key] += 1
        try:
            message = TrajectoryGroup(
                prompt_id=group.example.id,
                group_id=group.group_id,
                server_id=self.server_id,
                prompt_ids=np.asarray(group.example.prompt_ids, dtype=np.int32),
                samples=tuple(
                    protocol.Sample(
                        token_ids=s.token_ids,
                        logprobs=s.logprobs,
                        versions=s.versions,
                        reward=r.reward,
                        finish_reason=s.finish_reason,
                        reward_details=_details(r),
                    )
                    for s, r in zip(group.samples, rewards)
                ),
            )
        except ProtocolError as exc:  # an engine output the wire refuses (e.g. a NaN logprob)
            self.counters["bad_groups"] += 1
            log.error("dropped group %s: %s", group.group_id, exc)
            return
        self.outbox.pending.append(message)

    # -- weights and control ------------------------------------------------------------------

    def _start_eval(self) -> None:
        """Queue the eval prompts (request ids EvalPrompt(i)) once the engine holds the requested version."""
        if self.eval_wanted is None or self.eval_run is not None or self.engine.version < self.eval_wanted:
            return
        self.eval_wanted = None
        if self.eval_set is None:
            return
        for i, prompt in enumerate(self.eval_set.prompt_ids):
            request = GenRequest(
                prompt_ids=prompt, n=self.eval_k, **self.eval_sampling, stop_token_ids=self.stop_ids, seed=i
            )
            self.engine.add_request(request, EvalPrompt(i))
        self.eval_run = EvalRun(
            self.engine.version, [[] for _ in self.eval_set.prompt_ids], len(self.eval_set) * self.eval_k
        )
        log.info("evaluating version %d on %d held-out prompts", self.engine.version, len(self.eval_set))

    def _finish_eval(self, i: int, sample: Completion) -> None:
        run = self.eval_run
        run.texts[i].append(self.tokenizer.decode(sample.token_ids, skip_special_tokens=True))
        run.left -= 1
        if run.left == 0:  # generation done: weights may move again while the verifier scores
            self.eval_run = None
            answers = self.eval_set.answers
            self.scorer.submit(run, [(t, answers[j]) for j, texts in enumerate(run.texts) for t in texts])

    def _report_eval(self, run: EvalRun, rewards: list[RewardResult]) -> None:
        acc = sum(r.reward for r in rewards) / max(1, len(rewards))
        log.info("eval of version %d: avg@%d %.4f over %d prompts", run.version, self.eval_k, acc, len(run.texts))
        status = Status(
            type="eval_result",
            server_id=self.server_id,
            version=run.version,
            counters={"acc": float(acc), "problems": len(run.texts), "k": self.eval_k},
        )
        try:
            self.control.send(status, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("could not send the eval result of version %d: control queue full", run.version)

    def _poll_weights(self) -> None:
        """Drain the SUB socket and apply what it (and the control channel) brought (rollout_server/weight_receiver.py);
        not while an evaluation generates: every eval token comes from one version."""
        if self.eval_run is not None:
            return
        messages, self.addressed = self.addressed, []
        while self.sockets.sub.poll(0):
            msg = self.weights_rx.recv(timeout_ms=0)
            if msg is not None:
                messages.append(msg)
        self.counters["bad_messages"] = self._rejected()
        if self.weights.apply(messages):  # report the new version at once: the learner grants by it
            self._last_heartbeat = 0.0

    def _poll_control(self) -> None:
        while self.sockets.dealer.poll(0):
            msg = self.control_rx.recv(timeout_ms=0)
            if msg is None:
                continue
            if isinstance(msg, (WeightPush, WeightRef)):
                self.addressed.append(msg)
            elif msg.type == "reply" and msg.budget is not None:
                self.admission.on_reply(msg.budget)
            elif msg.type == "eval_request":
                self.eval_wanted = max(msg.version, self.eval_wanted or 0)
            elif msg.type == "resend_status":
                self._status("heartbeat")
        self.counters["bad_messages"] = self._rejected()

    def _rejected(self) -> int:
        return sum(self.weights_rx.rejected.values()) + sum(self.control_rx.rejected.values())

    def book_counters(self) -> dict[str, int]:
        """The counters with `unsent` = groups at the scorer or in the outbox (the books: qurl.outputs.books)."""
        return dict(
            self.counters,
            **self.weights.counters,
            unsent=self.scoring + len(self.outbox.pending),
            evaluating=int(self.eval_run is not None),  # takes no weights meanwhile: the learner resends nothing
        )

    def _status(self, kind: str) -> None:
        counters = self.book_counters()
        if kind == "hello" and self.replaces_pid:
            counters["replaces_pid"] = self.replaces_pid
        status = Status(
            type=kind,
            server_id=self.server_id,
            version=self.engine.version,
            engine=self.engine_name,
            quant=self.scheme,
            running=len(self.running),
            queued=self.scorer.pending + len(self.outbox.pending),
            counters=counters,
        )
        try:
            self.control.send(status, flags=zmq.NOBLOCK)
        except zmq.Again:  # the learner is away and the queue is full; the next heartbeat says the same
            pass

    def _beat_file(self) -> None:
        """Touch qurl-async's heartbeat file: a loop that stops touching it is killed and restarted (a wedged server
        sends no exit code to notice)."""
        path = os.environ.get(HEARTBEAT_ENV)
        if path:
            try:
                with open(path, "a"):
                    os.utime(path)
            except OSError as exc:  # the watchdog then sees silence; say why once
                if not self._beat_failed:
                    log.warning("cannot touch the heartbeat file %s: %s", path, exc)
                self._beat_failed = True

    def _tick(self) -> None:
        now = time.monotonic()
        period = ASK_S if self.admission.room() == 0 and self._fits() else HEARTBEAT_S
        if now - self._last_heartbeat >= period:
            self._last_heartbeat = now
            self._status("heartbeat")
            self._beat_file()
        if now - self._last_log >= self._log_interval:
            dt, c, old = now - self._last_log, self.counters, self._logged
            log.info(
                "groups/s %.2f tokens/s %.1f version %d running %d queued %d admitted %d of %d granted sent %d",
                (c["generated"] - old["generated"]) / dt,
                (c["tokens"] - old["tokens"]) / dt,
                self.engine.version,
                len(self.running),
                self.scorer.pending + len(self.outbox.pending),
                self.admission.admitted,
                self.admission.grant,
                c["sent"],
            )
            self._last_log, self._logged = now, dict(c)

    def _wait_idle(self) -> None:
        """Nothing to decode: sleep until a socket has input, the outbox can send, or a short timeout."""
        poller = zmq.Poller()
        poller.register(self.sockets.sub, zmq.POLLIN)
        poller.register(self.sockets.dealer, zmq.POLLIN)
        if self.outbox.pending:
            poller.register(self.sockets.push, zmq.POLLOUT)
        poller.poll(IDLE_WAIT_MS)


def _details(r: RewardResult) -> dict[str, str]:
    return {"status": r.status, "detail": r.detail} if r.detail else {"status": r.status}
