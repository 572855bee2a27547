"""The real rollout server process on the demo model, against a test-side learner on real sockets.

The test binds what the learner's rank 0 binds (PULL trajectories, PUB weights, ROUTER control),
starts `qurl-rollout-server` as a subprocess and checks, end to end: behaviour logprobs equal a
teacher-forced forward of the same tokens, a weight push shows up in the per-token versions,
admission stops exactly at the staleness budget while the learner is away and resumes when it
returns, garbage on the weights and control paths is counted and survived, and SIGTERM exits
with code 0 leaving no child process behind. The int8 run signs every message (transport.secret).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from qurl.quant import quantize_state_dict
from qurl.rewards import arith_reward
from qurl.wire import transport
from qurl.wire.frames import from_torch, to_torch
from qurl.wire.protocol import Sample as ProtoSample
from qurl.wire.protocol import Status, TrajectoryGroup, WeightPush, encode
from rollout_server.engines import load_engine
from rollout_server.loop import HEARTBEAT_S, Outbox

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(Path(sys.executable).parent / "qurl-rollout-server")
STALENESS, BATCH, N, MAX_NEW, TEMP = 1, 2, 4, 6, 0.7
START_TIMEOUT_S = 90  # imports, engine load and the reward pool's forkserver on a busy 2-core machine
WAIT_S = 30


class FakeLearner:
    """Binds like the learner's rank 0; replies to heartbeats with its version and counters."""

    def __init__(self, secret: str = "") -> None:
        self.secret = secret
        key = secret.encode() or None
        self.ctx = zmq.Context()
        self.pull = transport.bind(self.ctx, zmq.PULL, "tcp://127.0.0.1:*", secret=key, max_bytes=1 << 26)
        self.pub = transport.bind(self.ctx, zmq.PUB, "tcp://127.0.0.1:*", secret=key, max_bytes=1 << 30)
        self.router = transport.bind(self.ctx, zmq.ROUTER, "tcp://127.0.0.1:*", secret=key, max_bytes=1 << 20)
        self.groups_rx = transport.Receiver(self.pull, secret=key, max_bytes=1 << 26, kinds=("trajectory_group",))
        self.control_rx = transport.Receiver(self.router, secret=key, max_bytes=1 << 20, kinds=("status",))
        self.pub_tx = transport.Sender(self.pub, "learner", secret=key)
        self.control_tx = transport.Sender(self.router, "learner", secret=key)
        self.version = 0
        self.groups = []
        self.statuses: list[Status] = []
        self.identity = None
        self.proc: subprocess.Popen | None = None  # the server, so a crash fails at once

    def overrides(self) -> list[str]:
        names = ("trajectories", "weights", "control")
        socks = (self.pull, self.pub, self.router)
        secret = [f"transport.secret={self.secret}"] if self.secret else []
        return [f"transport.{n}={s.last_endpoint.decode()}" for n, s in zip(names, socks)] + secret

    @property
    def counters(self) -> dict:
        return dict(self.statuses[-1].counters) if self.statuses else {}

    def reply(self) -> None:
        """What the learner answers its only server: its version and the grant (learner/budget.py) that fills the
        bound, A + (grant - received) = (S + V + 1) * B, with every received group accepted (A = received)."""
        self.control_tx.send(
            Status(
                type="reply", server_id="learner", version=self.version, budget=(STALENESS + self.version + 1) * BATCH
            ),
            to=self.identity,
        )

    def pump(self, until, timeout_s: float = WAIT_S, pull: bool = True, reply: bool = True) -> None:
        """Serve the sockets until `until()` holds; fail after timeout_s."""
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        if pull:
            poller.register(self.pull, zmq.POLLIN)
        while not until():
            assert time.monotonic() < deadline, f"timed out; last counters {self.counters}"
            assert self.proc is None or self.proc.poll() in (None, 0), f"server exited with {self.proc.returncode}"
            poller.poll(50)
            while pull and self.pull.poll(0):
                g = self.groups_rx.recv(timeout_ms=0)
                assert g is not None, self.groups_rx.counts()
                self.groups.append(g)
            while self.router.poll(0):
                got = self.control_rx.recv_routed(timeout_ms=0)
                assert got is not None, self.control_rx.counts()
                self.identity, status = got
                self.statuses.append(status)
                if reply and status.type != "bye":
                    self.reply()

    def heartbeats(self, k: int, **kw) -> None:
        """Serve until k more statuses arrived (about k seconds)."""
        target = len(self.statuses) + k
        self.pump(lambda: len(self.statuses) >= target, **kw)

    def push_weights(self, push: WeightPush) -> None:
        """Publish until the server reports the new version (a SUB may miss what came before it joined)."""
        last = 0.0
        while not (self.statuses and self.statuses[-1].version == push.version):
            if time.monotonic() - last > 1.0:
                self.pub_tx.send(push)
                last = time.monotonic()
            self.heartbeats(1)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def learner(request):
    fake = FakeLearner(getattr(request, "param", ""))
    yield fake
    fake.close()


def start_server(demo_dir: Path, learner: FakeLearner, run_dir: Path, quant: str):
    overrides = [
        f"model.path={demo_dir / 'model'}",
        f"data.train_files=[{demo_dir / 'train.jsonl'}]",
        "data.eval_files=[]",
        f"run.dir={run_dir}",
        f"rollout.quant={quant}",
        f"train.batch_prompts={BATCH}",
        f"async.max_staleness={STALENESS}",
        f"rollout.n_samples={N}",
        "rollout.max_batch=16",
        f"rollout.sampling.max_new_tokens={MAX_NEW}",
        f"rollout.sampling.temperature={TEMP}",
        "reward.workers=1",
        "log.interval_s=1",
        "run.seed=3",
        *learner.overrides(),
    ]
    log_path = run_dir / "server.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [SERVER, "--config", str(ROOT / "configs/demo-cpu.yaml"), *overrides],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    learner.proc = proc
    return proc, log_path


def descendants(pid: int) -> set[int]:
    """Every live process below pid, from /proc (psutil is not installed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sigterm_and_check(proc: subprocess.Popen) -> float:
    kids = descendants(proc.pid)
    assert kids, "the reward pool should run in child processes"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    took = time.monotonic() - started
    deadline = time.monotonic() + 5
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)], "child processes outlived the server"
    return took


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Teacher-forced transformers logprobs, log_softmax(logits / T) of each given token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / TEMP, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].numpy()


@torch.inference_mode()
def engine_logprobs(engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Teacher-forced engine logprobs: a full-sequence (prefill) forward of every prefix, not the decode path."""
    out = []
    for j, tok in enumerate(tokens):
        seq = prompt + tokens[:j]
        logits = engine.model.prefill_many(torch.tensor([seq]), [len(seq)], engine.k_cache, engine.v_cache, [0])[0]
        out.append(torch.log_softmax(logits / TEMP, -1)[tok].item())
    return np.array(out)


def max_gap(groups, reference) -> float:
    gaps = [
        np.abs(s.logprobs - reference(g.prompt_ids.tolist(), s.token_ids.tolist())).max()
        for g in groups
        for s in g.samples
    ]
    return float(max(gaps))


def perturbed_push(model_dir: Path, scheme: str, names: set[str], version: int):
    """A WeightPush of the demo model plus noise, built as the learner builds it; also that model."""
    torch.manual_seed(version)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    state = {k: v for k, v in model.state_dict().items() if k in names}  # tied lm_head is not sent
    tensors = quantize_state_dict(state, scheme)
    assert set(tensors) == names
    return WeightPush(version=version, scheme=scheme, tensors={k: from_torch(v) for k, v in tensors.items()}), model


@pytest.fixture(scope="module")
def gold(demo_dir) -> dict[str, str]:
    """Gold answer per prompt id ("file:LINE", as qurl.data names rows)."""
    path = Path(demo_dir) / "train.jsonl"
    with open(path) as f:
        return {f"{path}:{i}": json.loads(line)["answer"] for i, line in enumerate(f, start=1)}


def eos_ids(model_dir: Path, tokenizer) -> set[int]:
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    return {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}


def check_group(group, server_id: str, tokenizer, stop_ids: set[int], gold: dict[str, str]) -> None:
    """Shape, finish reasons against the stop ids, and each reward recomputed from the decoded text."""
    assert group.server_id == server_id and len(group.samples) == N
    for s in group.samples:
        if s.finish_reason == "stop":
            assert s.token_ids[-1] in stop_ids and len(s.token_ids) <= MAX_NEW
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == MAX_NEW
        text = tokenizer.decode(s.token_ids.tolist(), skip_special_tokens=True)
        assert s.reward == arith_reward(text, gold[group.prompt_id]) and s.reward_details == {"status": "ok"}


def test_outbox_keeps_groups_while_the_queue_is_full():
    """PUSH at its high-water mark: groups wait in the outbox (counted retries) and leave in order later."""
    ctx = zmq.Context()
    try:
        pull = transport.bind(ctx, zmq.PULL, "inproc://trajectories", secret=None, max_bytes=1 << 20, hwm=1)
        push = transport.connect(ctx, zmq.PUSH, "inproc://trajectories", max_bytes=1 << 20, hwm=1)
        counters = {"sent": 0, "send_retries": 0}
        outbox = Outbox(transport.Sender(push, "srv"), counters)
        sample = ProtoSample([4, 5], [-0.5, -1.0], [0, 0], 1.0, "stop")
        outbox.pending.extend(
            TrajectoryGroup(prompt_id=i, group_id=f"g{i}", server_id="srv", prompt_ids=[1, 2], samples=(sample,))
            for i in range(8)
        )
        outbox.flush()
        assert counters["send_retries"] == 1 and counters["sent"] + len(outbox.pending) == 8 and outbox.pending
        rx = transport.Receiver(pull, secret=None, max_bytes=1 << 20)
        got = []
        while len(got) < 8:
            outbox.flush()
            if pull.poll(100):
                got.append(rx.recv(timeout_ms=0).group_id)
        assert got == [f"g{i}" for i in range(8)] and counters["sent"] == 8 and counters["send_retries"] > 1
    finally:
        ctx.destroy(linger=0)


def test_auto_endpoint_is_one_clear_error(demo_dir):
    demo_dir = Path(demo_dir)
    out = subprocess.run(
        [
            SERVER,
            "--config",
            str(ROOT / "configs/demo-cpu.yaml"),
            f"model.path={demo_dir / 'model'}",
            f"data.train_files=[{demo_dir / 'train.jsonl'}]",
            "data.eval_files=[]",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "qurl-rollout-server: transport.trajectories=auto: give an endpoint when starting this process by hand"
    )


@pytest.mark.slow  # 30-60 s each on an AVX2-only EPYC; the default suite keeps under 10 minutes there (README)
def test_server_end_to_end_fp32(demo_dir, gold, learner, tmp_path):
    """quant none: exact logprobs, garbage survived, a live weight push, the staleness budget, SIGTERM."""
    demo_dir = Path(demo_dir)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    stop_ids = eos_ids(demo_dir / "model", tokenizer)
    proc, log_path = start_server(demo_dir, learner, tmp_path / "run", "none")
    try:
        # 1. without progress at the learner (V = 0) the server makes exactly (S + 0 + 1) * B groups
        budget0 = (STALENESS + 0 + 1) * BATCH
        learner.pump(lambda: len(learner.groups) >= budget0, timeout_s=START_TIMEOUT_S)
        hello = learner.statuses[0]
        assert hello.type == "hello" and hello.quant == "none" and hello.engine == "torch" and hello.version == 0
        learner.heartbeats(2)
        assert len(learner.groups) == budget0 and learner.counters["admitted"] == budget0
        for g in learner.groups:
            check_group(g, hello.server_id, tokenizer, stop_ids, gold)
            assert all((s.versions == 0).all() for s in g.samples)
        assert any(s.finish_reason == "stop" for g in learner.groups for s in g.samples)
        base = AutoModelForCausalLM.from_pretrained(demo_dir / "model").eval()
        gap0 = max_gap(learner.groups, lambda p, t: hf_logprobs(base, p, t))
        assert gap0 < 1e-4, f"behaviour logprobs differ from teacher-forced transformers by {gap0}"

        # 2. garbage on the weights (PUB) and control (ROUTER) paths: counted, survived
        ident = learner.identity
        good = encode(Status(type="reply", server_id="learner", version=0), sender="fuzz", session="s", seq=0)
        rng = np.random.default_rng(7)
        junk = [
            [b"\x00\xff"],
            [b"{}"],
            [b'{"kind": "weight_push"}', b"x"],
            [good[0] + b"}"],
            [good[0], b"extra frame"],
            *([rng.bytes(int(rng.integers(0, 400))) for _ in range(int(rng.integers(1, 4)))] for _ in range(40)),
        ]
        for frames in junk:
            learner.pub.send_multipart(frames)
            learner.router.send_multipart([ident, *frames])
        learner.router.send_multipart([ident, *good])
        learner.router.send_multipart([ident, *good])  # the same stamp again: a replay
        names = set(load_engine(str(demo_dir / "model"), quant="none", max_batch=1, max_seq_len=64).weights)
        wrong = WeightPush(version=5, scheme="none", tensors={"model.embed_tokens.weight": np.zeros(3, np.float32)})
        learner.pub_tx.send(wrong)  # well formed, but not this engine's tensors
        expected_bad = 2 * len(junk) + 1
        learner.pump(
            lambda: (
                learner.counters.get("bad_messages") == expected_bad
                and learner.counters.get("weight_pushes_rejected") == 1
            )
        )
        assert proc.poll() is None and learner.statuses[-1].version == 0

        # 3. a weight push (version 1) is applied between decode steps; groups started after it carry version 1
        push, model1 = perturbed_push(demo_dir / "model", "none", names, version=1)
        learner.push_weights(push)
        learner.heartbeats(1)
        ignored = learner.counters["weight_pushes_ignored"]
        learner.pub_tx.send(push)  # a re-publish for some lagging server: this one already holds version 1
        learner.pump(lambda: learner.counters["weight_pushes_ignored"] == ignored + 1)
        assert learner.counters["weight_pushes_applied"] == 1 and learner.statuses[-1].version == 1
        learner.version = 1  # the learner's step: one more batch fits the budget
        budget1 = (STALENESS + 1 + 1) * BATCH
        learner.pump(lambda: len(learner.groups) >= budget1)
        new = learner.groups[budget0:]
        for g in new:
            check_group(g, hello.server_id, tokenizer, stop_ids, gold)
            assert all((s.versions == 1).all() for s in g.samples)
        gap1 = max_gap(new, lambda p, t: hf_logprobs(model1, p, t))
        assert gap1 < 1e-4, f"version-1 logprobs differ from the pushed model's by {gap1}"
        assert max_gap(new, lambda p, t: hf_logprobs(base, p, t)) > 1e-2  # the push really changed the policy

        # 4. learner away: it announces V = 3, then neither pulls nor replies; admission stops at the budget
        learner.version = 3
        learner.heartbeats(1)
        budget3 = (STALENESS + 3 + 1) * BATCH
        learner.pump(lambda: learner.counters["sent"] == budget3, pull=False, reply=False)
        learner.heartbeats(3, pull=False, reply=False)
        assert learner.counters["admitted"] == learner.counters["sent"] == budget3
        assert len(learner.groups) == budget1

        # 5. learner back: it takes the queued groups; after its next step, work goes on
        learner.pump(lambda: len(learner.groups) == budget3)
        learner.version = 4
        learner.pump(lambda: len(learner.groups) == budget3 + BATCH)
        assert learner.counters["send_retries"] == 0 and proc.poll() is None

        took = sigterm_and_check(proc)
        learner.pump(lambda: learner.statuses[-1].type == "bye", timeout_s=5)  # delivered within the socket linger
        print(
            f"fp32 server: logprob gap {gap0:.1e} (v0), {gap1:.1e} (v1); stopped {took:.2f} s after SIGTERM; "
            f"counters {learner.statuses[-1].counters}"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        print(log_path.read_text()[-3000:])


@pytest.mark.parametrize("learner", ["int8-test-secret"], indirect=True)  # every message carries an HMAC here
def test_server_int8_logprobs_and_push(demo_dir, gold, learner, tmp_path):
    """quant int8: logprobs equal the same int8 engine's teacher-forced forward, before and after an int8 push."""
    demo_dir = Path(demo_dir)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    stop_ids = eos_ids(demo_dir / "model", tokenizer)
    proc, log_path = start_server(demo_dir, learner, tmp_path / "run", "int8")
    try:
        budget0 = (STALENESS + 1) * BATCH
        learner.pump(lambda: len(learner.groups) >= budget0, timeout_s=START_TIMEOUT_S)
        assert learner.statuses[0].quant == "int8"
        # at its grant with free slots it asks every ASK_S (0.1 s), not every HEARTBEAT_S: freed room comes at once
        asked = time.monotonic()
        learner.heartbeats(6)
        assert time.monotonic() - asked < 6 * HEARTBEAT_S / 2, "an idle server at its grant asks once a second"
        engine = load_engine(str(demo_dir / "model"), quant="int8", max_batch=1, max_seq_len=64)
        gap0 = max_gap(learner.groups, lambda p, t: engine_logprobs(engine, p, t))
        assert gap0 < INT8_TOL, f"int8 behaviour logprobs differ from the int8 engine's teacher-forced ones by {gap0}"

        push, _ = perturbed_push(demo_dir / "model", "int8", set(engine.weights), version=1)
        learner.push_weights(push)
        learner.version = 1
        learner.pump(lambda: len(learner.groups) >= budget0 + BATCH)
        new = learner.groups[budget0:]
        for g in new:
            check_group(g, learner.statuses[0].server_id, tokenizer, stop_ids, gold)
            assert all((s.versions == 1).all() for s in g.samples)
        assert max_gap(new, lambda p, t: engine_logprobs(engine, p, t)) > 1e-2  # not the version-0 policy
        engine.update_weights({k: to_torch(v.data, v.dtype) for k, v in push.tensors.items()}, 1)
        gap1 = max_gap(new, lambda p, t: engine_logprobs(engine, p, t))
        assert gap1 < INT8_TOL, f"version-1 int8 logprobs differ from the pushed weights' by {gap1}"

        learner.version = 1000  # a budget that never binds: SIGTERM lands while the engine is busy
        busy = len(learner.groups) + 20
        learner.pump(lambda: len(learner.groups) >= busy)
        took = sigterm_and_check(proc)
        learner.pump(lambda: learner.statuses[-1].type == "bye", timeout_s=5)
        assert learner.statuses[-1].running > 0  # it left groups in the engine: the signal came mid-generation
        print(f"int8 server: logprob gap {gap0:.1e} (v0), {gap1:.1e} (v1); stopped {took:.2f} s after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
        print(log_path.read_text()[-2000:])


# Decode and prefill quantize each token's activations on their own, so they see the same int8 codes;
# only float summation order differs (SDPA vs explicit attention), which can flip a code that sits on a
# rounding boundary. 1e-3 is the engine's own int8 parity bound (issue 4); measured gaps are reported.
INT8_TOL = 1e-3
