"""The learner as real processes on real sockets: FSDP2 on 2 gloo ranks trains on the demo model's own
generations, pushes int8 weights (late joiners included), equals a 1-rank step, resumes exactly, exports hf/.

The test plays the rollout server's part with real sockets: it generates groups with the embedded engine,
PUSHes them, SUBscribes to the weights and says hello on the control channel.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import yaml
import zmq
from safetensors.torch import load_file

from qurl.data import PromptDataset
from qurl.outputs.metrics import CONTRACT_KEYS
from qurl.quant import dequantize_state_dict
from qurl.wire import delta, transport
from qurl.wire.protocol import Sample, Status, TrajectoryGroup, WeightPush

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS, N = 4, 4  # groups per batch, samples per group
SERVER_ID = "test-server"
TIMEOUT_S = 120


def digit_reward(text: str, answer: str) -> float:
    """Share of answer digits the response gets right in place: graded, so groups of a weak model still differ."""
    text = text.strip()
    return sum(a == b for a, b in zip(text, answer)) / max(len(answer), len(text), 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def batches(demo_dir) -> list[list[TrajectoryGroup]]:
    """Two batches of groups the int8 engine sampled from the demo model, the first two of each with reward variance."""
    from transformers import AutoTokenizer

    from rollout_server.engines import GenRequest, load_engine

    model = os.path.join(demo_dir, "model")
    tok = AutoTokenizer.from_pretrained(model)
    examples = PromptDataset(os.path.join(demo_dir, "train.jsonl"), tok, seed=0).take(12)
    engine = load_engine(model, quant="int8", max_batch=64, max_seq_len=64)
    results = engine.generate(
        [
            GenRequest(
                prompt_ids=e.prompt_ids,
                n=N,
                max_new_tokens=8,
                temperature=1.0,
                stop_token_ids=[tok.eos_token_id],
                seed=i,
            )
            for i, e in enumerate(examples)
        ]
    )
    groups = []
    for i, (e, r) in enumerate(zip(examples, results)):
        texts = tok.batch_decode([s.token_ids for s in r.samples], skip_special_tokens=True)
        samples = tuple(
            Sample(
                token_ids=s.token_ids,
                logprobs=s.logprobs,
                versions=s.versions,
                reward=digit_reward(t, e.answer),
                finish_reason=s.finish_reason,
            )
            for s, t in zip(r.samples, texts)
        )
        groups.append(
            TrajectoryGroup(
                prompt_id=e.id,
                group_id=f"g{i}",
                server_id=SERVER_ID,
                prompt_ids=np.asarray(e.prompt_ids, dtype=np.int32),
                samples=samples,
            )
        )
    mixed = [g for g in groups if len({s.reward for s in g.samples}) > 1]
    rest = [g for g in groups if g not in mixed]
    assert len(mixed) >= 4, "sampled responses should differ in how many digits they get right"
    return [mixed[:2] + (mixed[4:] + rest)[:2], mixed[2:4] + (mixed[4:] + rest)[2:4]]


class Peer:
    """The rollout server's three sockets, driven by the test."""

    def __init__(self, endpoints: dict[str, str], server_id: str = SERVER_ID) -> None:
        self.ctx = zmq.Context()
        self.push = transport.Sender(
            transport.connect(self.ctx, zmq.PUSH, endpoints["trajectories"], max_bytes=1 << 20), server_id
        )
        self.sub = transport.Receiver(
            transport.connect(self.ctx, zmq.SUB, endpoints["weights"], max_bytes=1 << 30),
            secret=None,
            max_bytes=1 << 30,
            kinds=("weight_push",),
        )
        dealer = transport.connect(self.ctx, zmq.DEALER, endpoints["control"], max_bytes=1 << 30)
        self.control = transport.Sender(dealer, server_id)
        # replies, and the weights the learner resends to this server alone (a late joiner's, a lagging one's)
        self.replies = transport.Receiver(dealer, secret=None, max_bytes=1 << 30, kinds=("status", "weight_push"))
        self.addressed: list[WeightPush] = []
        self.server_id = server_id

    def hello(self, version: int = 0, kind: str = "hello") -> None:
        self.control.send(Status(type=kind, server_id=self.server_id, version=version, engine="torch", quant="int8"))

    def reply(self, proc: subprocess.Popen) -> Status:
        """Say hello until the learner answers (it may still be starting)."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the learner exited early"
            self.hello()
            msg = self._control(timeout_ms=500)
            if msg is not None:
                return msg
        raise AssertionError("no reply on the control channel")

    def _control(self, timeout_ms: int) -> Status | None:
        """The next status on the control channel; weights that come there are kept for weights()."""
        msg = self.replies.recv(timeout_ms=timeout_ms)
        while isinstance(msg, WeightPush):
            self.addressed.append(msg)
            msg = self.replies.recv(timeout_ms=0)
        return msg

    def send(self, groups: list[TrajectoryGroup]) -> None:
        for g in groups:
            self.push.send(g)

    def weights(self, version: int, proc: subprocess.Popen, say_hello: bool = False) -> WeightPush:
        """The first push of at least `version` (with say_hello: keep reporting version 0 as a late joiner does)."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:  # a push sent just before exit may still be on its way
                deadline = min(deadline, time.monotonic() + 3)
            if say_hello:
                self.hello()
            self._control(timeout_ms=0)
            msg = self.addressed.pop(0) if self.addressed else self.sub.recv(timeout_ms=500)
            if msg is not None and msg.version >= version:
                return msg
        raise AssertionError(f"no weight push of version {version}")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def write_config(tmp: str, demo_dir: str, name: str, **extra) -> tuple[str, dict[str, str]]:
    endpoints = {k: f"tcp://127.0.0.1:{free_port()}" for k in ("trajectories", "weights", "control")}
    cfg = {
        "run": {"name": name, "dir": os.path.join(tmp, name)},
        "model": {"path": os.path.join(demo_dir, "model")},
        "data": {"train_files": [os.path.join(demo_dir, "train.jsonl")]},
        "rollout": {"quant": "int8", "n_samples": N, "sampling": {"temperature": 1.0, "max_new_tokens": 8}},
        "algo": {"loss": "acr", "kl_coef": 0.01},
        "quant": {"invariant_scaling": {"s": 1.5, "targets": ["qkv"]}},
        "train": {"lr": 1e-4, "batch_prompts": PROMPTS, "mini_batches": 2, "steps": 2, "grad_clip": 1.0},
        "async": {"max_staleness": 2},
        "transport": endpoints,
        "checkpoint": {"every": 1, "keep": 3},
        "log": {"interval_s": 2.0},
    }
    for key, value in extra.items():
        group, field = key.split("__")
        cfg.setdefault(group, {})[field] = value
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path, endpoints


def start(config: str, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(config + ".log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "learner.main", "--config", config, *overrides],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def finish(proc: subprocess.Popen, config: str) -> None:
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "timeout"
    with open(config + ".log") as f:
        log = f.read()
    assert code == 0, f"learner exit {code}; log:\n{log[-3000:]}"


def run_learner(tmp: str, demo_dir: str, batches, name: str, ranks: int) -> dict:
    """Feed both batches to a learner that trains 2 steps; capture pushes and a late joiner's view."""
    config, endpoints = write_config(tmp, demo_dir, name, cluster__learner_ranks=ranks)
    proc = start(config)
    peer = Peer(endpoints)
    try:
        first_reply = peer.reply(proc)
        peer.send(batches[0])
        push1 = peer.weights(1, proc)
        late = Peer(endpoints, server_id="late-server")
        late_push = late.weights(1, proc, say_hello=True)
        late.close()
        peer.send(batches[1])
        push2 = peer.weights(2, proc)
        finish(proc, config)
    finally:
        if proc.poll() is None:
            proc.kill()
        peer.close()
    return {
        "dir": os.path.join(tmp, name),
        "first_reply": first_reply,
        "push1": push1,
        "push2": push2,
        "late_push": late_push,
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, demo_dir, batches) -> dict:
    return run_learner(str(tmp_path_factory.mktemp("learner")), demo_dir, batches, "two", ranks=2)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, demo_dir, batches) -> dict:
    return run_learner(str(tmp_path_factory.mktemp("learner")), demo_dir, batches, "one", ranks=1)


def ckpt(run: dict | str, step: int, what: str = "model") -> dict[str, torch.Tensor]:
    folder = run["dir"] if isinstance(run, dict) else run
    return load_file(os.path.join(folder, "checkpoints", f"step_{step}", f"{what}.safetensors"))


def metrics(run: dict) -> list[dict]:
    with open(os.path.join(run["dir"], "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_two_ranks_train_push_and_serve_late_joiners(two_ranks):
    rows = metrics(two_ranks)
    assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [1, 2]
    for row in rows:
        missing = [k for k in CONTRACT_KEYS if k not in row]
        assert not missing, f"metrics.jsonl lacks {missing}"
        assert all(np.isfinite(row[k]) for k in ("loss/policy", "actor/grad_norm", "mismatch/kl_k3", "sync/seconds"))
        assert row["sync/bytes"] > 0 and row["rollout/response_len_mean"] > 0
    assert rows[1]["staleness/max"] == 1 and rows[0]["staleness/max"] == 0
    assert all(0 < r["sync/changed_frac"] <= 1 for r in rows)  # every push moves some int8 codes
    assert rows[1]["buffer/received"] == 2 * PROMPTS
    assert os.listdir(os.path.join(two_ranks["dir"], "tensorboard"))
    with open(os.path.join(two_ranks["dir"], "summary.json")) as f:
        assert json.load(f)["version"] == 2
    assert two_ranks["first_reply"].type == "reply" and two_ranks["first_reply"].version == 0

    # the pushed int8 weights are the learner's scaled fp32 weights within half a quantization step
    push = two_ranks["push2"]
    assert push.version == 2 and push.scheme == "int8"
    assert two_ranks["push1"].mode == "full" and push.mode == "delta"  # sync.full_every=10: a delta of version 1
    named = {k: v.clone() for k, v in delta.split_push(two_ranks["push1"])[0].items()}
    delta.apply(named, *delta.split_push(push), push.checksum)
    assert "lm_head.weight" not in named  # tied embeddings: the engine takes the embedding only
    deq = dequantize_state_dict(named, "int8")
    learner = ckpt(two_ranks, 2)
    assert set(deq) == set(learner)
    for name, w in deq.items():
        if name.endswith("_proj.weight"):
            bound = named[name + "_scale"] / 2 + 1e-7
            assert ((w - learner[name]).abs() <= bound).all(), name
        else:
            assert torch.equal(w, learner[name]), name

    # a server that joins late says hello with version 0 and gets the current weights without a new step
    assert two_ranks["late_push"].version == 1


def scaled_start(demo_dir: str) -> dict[str, torch.Tensor]:
    """The demo model's weights with invariant scaling applied: the learner's version 0."""
    from transformers import AutoModelForCausalLM

    from qurl.quant.invariant_scaling import apply_invariant_scaling

    model = AutoModelForCausalLM.from_pretrained(os.path.join(demo_dir, "model"), dtype=torch.float32)
    return apply_invariant_scaling(model, 1.5, ("qkv",)).state_dict()


def test_one_and_two_ranks_take_the_same_step(one_rank, two_ranks, demo_dir):
    one, two, start = ckpt(one_rank, 1), ckpt(two_ranks, 1), scaled_start(demo_dir)
    assert set(one) == set(two) == set(start) - {"lm_head.weight"}
    moved = max((one[k] - start[k]).abs().max().item() for k in one)
    assert (
        moved > 5e-5
    )  # the step did something (Adam moves weights by about lr = 1e-4), so the comparison means something
    # atol 3e-5 (lr/3): where |g| is near Adam's eps (1e-8) a weight moves by a share of lr that the gradient's last
    # bits set, and the two-rank gradient sums in another order (fused AdamW put one such element 1.3e-5 apart);
    # a missing or doubled reduction flips signs: 2e-4 apart
    for k in one:
        torch.testing.assert_close(one[k], two[k], rtol=0, atol=3e-5, msg=k)
    # Adam and clipping hide a gradient off by the rank count; the logged pre-clip norm and loss do not
    row_one, row_two = metrics(one_rank)[0], metrics(two_ranks)[0]
    # abs 1e-7: the policy loss is a near-zero mean of O(0.1) fp32 terms, and the two-rank sum runs in another
    # order (a fresh demo model gave -2.63409e-3 vs -2.63406e-3); a factor of the rank count is still far outside
    for key in ("actor/grad_norm", "loss/policy", "loss/kl", "mismatch/kl_k3", "actor/clipfrac", "reward/mean"):
        assert row_one[key] == pytest.approx(row_two[key], rel=1e-5, abs=1e-7), key


def test_resume_continues_exactly(tmp_path, demo_dir, batches, one_rank):
    config, endpoints = write_config(str(tmp_path), demo_dir, "resumed", checkpoint__every=0)
    proc = start(config)
    peer = Peer(endpoints)
    try:
        peer.reply(proc)
        peer.send(batches[0])
        peer.weights(1, proc)
        proc.send_signal(signal.SIGTERM)  # stop while waiting for batch 2: final checkpoint, exit 0
        finish(proc, config)
    finally:
        peer.close()
    run_dir = os.path.join(str(tmp_path), "resumed")
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_1"]

    proc = start(config, "run.resume=true")
    peer = Peer(endpoints)
    try:
        assert peer.reply(proc).version == 1
        assert peer.weights(1, proc, say_hello=True).version == 1  # re-pushed at once, before any new step
        peer.send(batches[1])
        finish(proc, config)
    finally:
        if proc.poll() is None:
            proc.kill()
        peer.close()
    for what in ("model", "optim"):
        resumed, straight = ckpt(run_dir, 2, what), ckpt(one_rank, 2, what)
        assert set(resumed) == set(straight)
        for k in straight:
            torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=1e-6, msg=f"{what} {k}")
    with open(os.path.join(run_dir, "checkpoints", "step_2", "state.json")) as f:
        resumed_state = json.load(f)
    with open(os.path.join(one_rank["dir"], "checkpoints", "step_2", "state.json")) as f:
        straight_state = json.load(f)
    # the books differ by design: a resumed learner is a second life, and the test's servers differ between runs
    for state in (resumed_state, straight_state):
        state.pop("reports")
        state["buffer"].pop("wire")
    assert resumed_state["buffer"] == {**straight_state["buffer"], "life": 2, "dropped": {"restart": 0}}
    straight_state["buffer"] = resumed_state["buffer"]
    assert resumed_state == straight_state and resumed_state["version"] == 2
    assert resumed_state["buffer"]["received"] == 2 * PROMPTS
    assert [r["step"] for r in metrics({"dir": run_dir})] == [1, 2]

    # a fresh start into a folder that holds a run would mix two runs: refused with one line
    again = subprocess.run(
        [sys.executable, "-m", "learner.main", "--config", config],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1].endswith(  # EXIT_INPUT: not restarted
        "already holds a run; pass run.resume=true to continue it, or choose another run.dir"
    )


def test_hf_export_is_function_equal_to_the_scaled_learner(two_ranks, demo_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qurl.quant.invariant_scaling import apply_invariant_scaling

    hf = os.path.join(two_ranks["dir"], "hf")
    exported = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(hf).eos_token_id is not None
    learner = AutoModelForCausalLM.from_pretrained(os.path.join(demo_dir, "model"), dtype=torch.float32).eval()
    missing, unexpected = learner.load_state_dict(ckpt(two_ranks, 2), strict=False)  # the scaled weights it trains
    assert missing == ["lm_head.weight"] and not unexpected  # tied: stored once, as the embedding
    gain = "model.layers.0.input_layernorm.weight"
    assert not torch.allclose(exported.state_dict()[gain], learner.state_dict()[gain])  # scaling really differs
    ids = torch.randint(3, exported.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = exported(ids).logits, learner(ids).logits
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5
    unscaled = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    apply_invariant_scaling(unscaled, 1.5, ("qkv",))
    torch.testing.assert_close(unscaled.state_dict()[gain], learner.state_dict()[gain], rtol=1e-6, atol=0)


@pytest.fixture
def in_process(tmp_path, demo_dir):
    """A one-rank process group in the test process, and a factory for Learners on it (sockets closed after)."""
    import torch.distributed as dist

    from learner.policy_step import DistEnv
    from learner.trainer import Learner
    from qurl.config import load_config

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    made = []

    def make(*overrides: str) -> Learner:
        config, _ = write_config(str(tmp_path), demo_dir, f"in-process-{len(made)}")
        cfg = load_config(config, ["algo.kl_coef=0", "log.tensorboard=false", *overrides])
        made.append(Learner(cfg, DistEnv(0, 1, 0, torch.device("cpu"))))
        return made[-1]

    yield make
    for learner in made:
        learner.close()
    dist.destroy_process_group()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def full_weights(learner) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in learner.policy.model.state_dict().items()}


def test_a_nan_loss_skips_the_update_and_the_next_batch_trains(in_process, batches):
    from learner.batch import collate

    learner = in_process("train.mini_batches=1")
    batch = collate(batches[0], learner.policy.pad_id)
    bad = collate(batches[0], learner.policy.pad_id)
    bad.behav_logp[0, int(bad.prompt_len[0])] = float("nan")  # one response token: the protocol would refuse it
    before = full_weights(learner)
    result = learner.policy.step(bad, learner.state.step)
    assert not result.updated and result.skipped == 1 and np.isnan(result.metrics["loss/policy"])
    after = full_weights(learner)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in learner.policy.model.parameters())
    result = learner.policy.step(batch, learner.state.step)
    assert result.updated and np.isfinite(result.metrics["loss/policy"])
    assert any(not torch.equal(before[k], v) for k, v in full_weights(learner).items())


def test_steps_that_update_nothing_in_a_row_stop_the_run_with_one_line(tmp_path):
    """train.max_skipped_steps: the weights stand still while every update is skipped for a non-finite loss, so the
    run stops (learner/main.py maps Diverged to exit 3) naming the steps, the lr and the last good checkpoint."""
    from learner.checkpointer import Checkpointer
    from learner.errors import Diverged

    ckpt = Checkpointer(str(tmp_path), None, "model", 1e18, is_main=True)
    ckpt.saved_step = 4
    for skipped in range(5):
        ckpt.require_progress(skipped, 6 + skipped, limit=5)
    ckpt.require_progress(50, 60, limit=0)  # 0: never
    with pytest.raises(Diverged) as stop:
        ckpt.require_progress(5, 11, limit=5)
    line = str(stop.value)
    assert line.startswith("steps 7-11: every update skipped for a non-finite loss or grad norm, 5 steps in a row")
    assert "train.lr=1e+18" in line and "unchanged since step 6" in line, line
    assert f"last good checkpoint: {tmp_path / 'checkpoints' / 'step_4'}" in line and "\n" not in line
    quiet = Checkpointer(str(tmp_path), None, "model", 1e18, is_main=False)
    with pytest.raises(Diverged, match="^$"):  # off rank 0 the line is left to rank 0
        quiet.require_progress(5, 11, limit=5)


def test_one_mini_batch_reuses_its_forward_as_the_proximal_policy(in_process, batches):
    from learner.batch import collate

    reused, separate = in_process("train.mini_batches=1"), in_process("train.mini_batches=1")
    separate.policy.dropout_free = False  # forces the separate no-grad proximal pass
    assert reused.policy.dropout_free
    batch = collate(batches[0], reused.policy.pad_id)
    m_reused = reused.policy.step(batch, 0).metrics
    m_separate = separate.policy.step(batch, 0).metrics
    for key in ("loss/policy", "actor/grad_norm", "mismatch/kl_k3", "mismatch/rho_max"):
        assert m_reused[key] == pytest.approx(m_separate[key], rel=1e-5, abs=1e-7), key
    a, b = full_weights(reused), full_weights(separate)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


def test_auto_precision_is_bf16_exactly_where_the_cpu_has_native_bf16(caplog):
    """train.precision=auto: bf16 where /proc/cpuinfo names avx512_bf16 or amx_bf16, fp32 elsewhere (emulated bf16
    matmuls are ~8x slower on AVX2-only CPUs); an explicit bf16 there is kept, with a warning."""
    from learner.model import bf16_training, native_bf16

    cpu = torch.device("cpu")
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else None
    if flags is not None:
        assert native_bf16(cpu) == bool(flags & {"avx512_bf16", "amx_bf16"}), sorted(flags & {"avx2", "avx512f"})
    assert bf16_training("auto", cpu) == native_bf16(cpu)
    assert bf16_training("fp32", cpu) is False
    with caplog.at_level("WARNING", logger="learner"):
        assert bf16_training("bf16", cpu) is True
    assert ("without native bf16" in caplog.text) == (not native_bf16(cpu))


def test_bf16_mixed_precision_with_gradient_checkpointing_trains_fp32_masters(in_process, batches):
    from learner.batch import collate

    learner = in_process("train.precision=bf16", "model.gradient_checkpointing=true")
    before = full_weights(learner)
    result = learner.policy.step(collate(batches[0], learner.policy.pad_id), 0)
    updated, m = result.updated, result.metrics
    assert updated and np.isfinite(m["loss/policy"]) and np.isfinite(m["actor/grad_norm"])
    assert m["mismatch/kl_k3"] < 0.05  # bf16 proximal logprobs stay close to the int8 sampler's
    after = full_weights(learner)
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def toy_group(gid: str, rewards: list[float], version: int = 0, token: int = 5) -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_id=gid,
        group_id=gid,
        server_id=SERVER_ID,
        prompt_ids=np.array([1, 2], np.int32),
        samples=tuple(
            Sample(
                token_ids=np.array([token, 6], np.int32),
                logprobs=np.array([-0.5, -0.1], np.float32),
                versions=np.array([version, version], np.int32),
                reward=r,
                finish_reason="stop",
            )
            for r in rewards
        ),
    )


def inproc_buffer(ctx: zmq.Context, *, max_staleness: int, dynamic_sampling: bool) -> tuple:
    """A rank-0 buffer of 2-group batches on an inproc PULL socket, and a server's sender into it."""
    from learner.buffer import TrajectoryBuffer

    pull = transport.bind(ctx, zmq.PULL, "inproc://buffer", secret=None, max_bytes=1 << 20)
    push = transport.Sender(transport.connect(ctx, zmq.PUSH, "inproc://buffer", max_bytes=1 << 20), SERVER_ID)
    receiver = transport.Receiver(pull, secret=None, max_bytes=1 << 20)
    kept = dict(batch_prompts=2, max_staleness=max_staleness, dynamic_sampling=dynamic_sampling, vocab_size=100)
    return TrajectoryBuffer(receiver, **kept), push


def test_buffer_counts_every_group_it_does_not_use():
    from learner.batch import collate

    ctx = zmq.Context()
    try:
        buffer, push = inproc_buffer(ctx, max_staleness=1, dynamic_sampling=True)
        for g in (
            toy_group("old", [0, 1], version=0),
            toy_group("flat", [1, 1], version=2),
            toy_group("alien", [0, 1], version=2, token=100),
            toy_group("a", [0, 1], version=2),
            toy_group("future", [0, 1], version=3),
        ):
            push.send(g)
        push.sock.send_multipart([b"not a message"])
        time.sleep(0.1)
        assert buffer.poll(1000, version=2) == 5
        assert buffer.dropped == {"stale": 1, "filter": 1, "invalid": 2}
        assert sum(buffer.receiver.rejected.values()) == 1
        assert buffer.take(version=2) is None  # one usable group, two needed
        push.send(toy_group("b", [1, 0], version=2))
        buffer.poll(1000, version=2)
        assert buffer.accepted_total == 2
        batch = buffer.take(version=3)  # "a" and "b" were made at version 2: staleness 1 is still allowed
        assert [g.group_id for g in batch] == ["a", "b"] and buffer.used == 2 and buffer.accepted_total == 2
        t = collate(batch, pad_id=0)
        assert t.input_ids.tolist() == [[1, 2, 5, 6]] * 4 and t.group.tolist() == [0, 0, 1, 1]
        assert t.behav_logp[0].tolist() == pytest.approx([0, 0, -0.5, -0.1])
        push.send(toy_group("c", [1, 0], version=2))
        push.send(toy_group("d", [1, 0], version=2))
        buffer.poll(1000, version=3)
        assert buffer.take(version=4) is None and buffer.dropped["stale"] == 3  # now 2 versions old
        assert buffer.received_from == {SERVER_ID: 8} and buffer.received == 8
    finally:
        ctx.destroy(linger=0)


def test_servers_get_room_only_for_work_that_is_fresh_when_taken():
    """While the learner trains on version v's batch, a server at v gets no room at max_staleness 0, and a server a
    version behind gets none at max_staleness 1, or they generate beside the learner, on its cores, what is stale on
    arrival (it happened: 6 of 14 groups dropped in a 4-step sync run of the real workload)."""
    from learner.budget import Budget

    ctx = zmq.Context()
    try:
        buffer, push = inproc_buffer(ctx, max_staleness=0, dynamic_sampling=False)
        budget = Budget(0, 2, buffer.snapshot)
        assert budget.grant(SERVER_ID, 0, 0, {"admitted": 0}, now=0.0) == 2  # room for version 0's batch
        for gid in ("a", "b"):
            push.send(toy_group(gid, [0, 1], version=0))
        time.sleep(0.1)
        assert buffer.poll(1000, version=0) == 2 and len(buffer.take(version=0)) == 2
        assert buffer.snapshot(0) == (2, 0, {SERVER_ID: 2})  # in training: no room for a server at version 0
        assert budget.grant(SERVER_ID, 0, 0, {"admitted": 2}, now=0.5) == 2  # the server waits, idle
        buffer.step_done(1)  # the update made version 1 (recorded before the push)
        assert budget.grant(SERVER_ID, 1, 0, {"admitted": 2}, now=0.6) == 2  # it has not loaded version 1
        assert budget.grant(SERVER_ID, 1, 1, {"admitted": 2}, now=0.7) == 4  # it holds version 1: the next batch
        # a skipped update keeps the version: the step's end alone frees its room
        for gid in ("c", "d"):
            push.send(toy_group(gid, [0, 1], version=1))
        time.sleep(0.1)
        buffer.poll(1000, version=1)
        assert len(buffer.take(version=1)) == 2 and buffer.snapshot(1)[1] == 2
        # max_staleness 1, version 1's batch in training: work started now is taken at version 2 at the earliest,
        # so a server one version behind (within max_staleness) gets nothing, one at version 1 gets one batch
        assert Budget(1, 2, buffer.snapshot).grant("late", 1, 0, {"admitted": 0}, now=0.8) == 0
        assert Budget(1, 2, buffer.snapshot).grant("current", 1, 1, {"admitted": 0}, now=0.8) == 2
        assert budget.grant(SERVER_ID, 1, 1, {"admitted": 4}, now=0.8) == 4
        buffer.step_done(1)
        assert budget.grant(SERVER_ID, 1, 1, {"admitted": 4}, now=0.9) == 6
    finally:
        ctx.destroy(linger=0)


def test_intake_thread_frees_dropped_groups_room_while_the_learner_trains():
    """Groups arrive and are filtered on the buffer's own thread, with no call from the (busy) main thread: a
    unanimous group counts as received at once, so the next grant returns its room during the step; take(wait_ms)
    wakes on arrival; staleness is judged against the version step_done recorded."""
    from learner.budget import Budget

    ctx = zmq.Context()
    try:
        buffer, push = inproc_buffer(ctx, max_staleness=1, dynamic_sampling=True)
        budget = Budget(1, 2, buffer.snapshot)
        assert budget.grant(SERVER_ID, 0, 0, {"admitted": 0}, now=0.0) == 4  # (1 + 0 + 1) * 2 groups
        buffer.start()
        for gid in ("flat1", "flat2", "flat3", "flat4"):  # the whole grant comes back unanimous
            push.send(toy_group(gid, [1, 1], version=0))
        deadline = time.monotonic() + 10
        while buffer.received < 4:
            assert time.monotonic() < deadline, f"the intake thread received {buffer.received} of 4"
            time.sleep(0.01)
        assert buffer.dropped["filter"] == 4 and buffer.accepted_total == 0
        assert budget.grant(SERVER_ID, 0, 0, {"admitted": 4}, now=0.1) == 8  # all 4 returned: room for 4 more
        assert buffer.take(version=0, wait_ms=50) is None  # nothing usable: waits at most 50 ms
        threading.Timer(0.2, lambda: [push.send(toy_group(g, [0, 1], version=0)) for g in ("a", "b")]).start()
        started = time.monotonic()
        batch = buffer.take(version=0, wait_ms=10_000)
        assert [g.group_id for g in batch] == ["a", "b"] and time.monotonic() - started < 9  # woken, not timed out
        buffer.step_done(2)  # the learner moved on: version 0's work is two versions old on arrival
        push.send(toy_group("old", [0, 1], version=0))
        deadline = time.monotonic() + 10
        while buffer.dropped["stale"] < 1:
            assert time.monotonic() < deadline, "the intake thread did not judge staleness by step_done's version"
            time.sleep(0.01)
        assert buffer.counters()["received"] == 7
    finally:
        buffer.close()
        ctx.destroy(linger=0)


def test_resume_skips_corrupt_and_foreign_checkpoints_with_one_line_each(one_rank, tmp_path, demo_dir):
    import shutil

    from transformers import AutoModelForCausalLM

    from learner import checkpoint

    root = tmp_path / "checkpoints"
    good = os.path.join(one_rank["dir"], "checkpoints", "step_1")
    for step in (1, 3, 4, 5):
        shutil.copytree(good, root / f"step_{step}")
    os.remove(root / "step_5" / "manifest.json")  # a crash before the manifest: incomplete
    with open(root / "step_4" / "model.safetensors", "ab") as f:
        f.write(b"junk")  # damaged after writing
    manifest = json.loads((root / "step_3" / "manifest.json").read_text())
    (root / "step_3" / "manifest.json").write_text(json.dumps({**manifest, "fingerprint": "another-model"}))
    (root / "step_9").mkdir()  # some foreign folder
    (root / "step_9" / "manifest.json").write_text("{}")
    model = AutoModelForCausalLM.from_pretrained(os.path.join(demo_dir, "model"))
    assert checkpoint.fingerprint(model) == manifest["fingerprint"]  # rank count does not enter it
    lines = []
    assert checkpoint.find_latest(str(root), manifest["fingerprint"], warn=lines.append) == str(root / "step_1")
    assert len(lines) == 4 and all("\n" not in line for line in lines)
    for line, why in zip(lines, ("not a qurl learner checkpoint", "incomplete", "corrupt", "different model")):
        assert why in line, line


@pytest.mark.slow
def test_learner_step_benchmark_quick(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "learner_step.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=900,
    )
    result = json.loads(out.read_text())
    assert result["benchmark"] == "learner_step" and set(result["machine"]) >= {"cpu", "cores", "torch", "python"}
    rows = result["rows"]
    assert {(r["ranks"], r["quant"]) for r in rows} == {(n, q) for n in (1, 2) for q in ("int8", "fp8", "none")}
    for r in rows:
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["push_bytes"] > 0 and r["repeats"] >= 1
    by_quant = {r["quant"]: r["push_bytes"] for r in rows if r["ranks"] == 1}
    assert by_quant["int8"] < by_quant["none"] and by_quant["fp8"] < by_quant["none"]


def test_eval_schedule_final_switch_and_no_second_eval_of_resumed_weights():
    from learner.evaluation import Evaluation

    def due(evaluation: Evaluation) -> list[int]:
        return [s for s in range(13) if evaluation.due(s)]

    evaluator = object()  # due() only asks whether there is one
    assert due(Evaluation(evaluator, None, "int8", every=4, steps=10)) == [0, 4, 8, 10, 11, 12]
    segmented = Evaluation(evaluator, None, "int8", every=4, steps=10, final=False)
    assert due(segmented) == [0, 4, 8, 12]
    segmented.resumed_at = 8  # a segment that stopped at 8 evaluated those weights before its checkpoint
    assert due(segmented) == [0, 4, 12]
    assert due(Evaluation(None, None, "int8", every=4, steps=10)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_finite_finds_one_bad_element_anywhere(dtype):
    from learner.checkpointer import all_finite

    t = torch.randn(300, 7).to(dtype)
    assert all_finite(t) and all_finite(t[:0])  # an FSDP2 shard may be empty
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in ((0, 0), (150, 3), (299, 6)):
            u = t.clone()
            u[where] = bad
            assert not all_finite(u), (bad, where)


KEEP_FREED = """
import ctypes, sys
from learner.main import keep_freed_memory

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                                                "keepcost").split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
kept = keep_freed_memory() if sys.argv[1] == "call" else None
# 64 MB: over glibc's largest mmap threshold (32 MB), so mmap by default; 3 GB: a heap top over any int threshold
block = libc.malloc(int(sys.argv[2]) << 20)  # untouched: only address space
assert block, "malloc failed"
libc.free(block)
print(kept, libc.mallinfo2().fordblks >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_cpu_learner_keeps_the_memory_it_frees_unless_glibc_tunables_say_otherwise():
    """keep_freed_memory: a freed 64 MB block stays in the heap for the next step's buffers (no mmap, no trim), where
    glibc unmaps it by default, and so does a freed 3 GB top of the heap (a 7B layer's buffers), which the largest int
    threshold (2^31 - 1) trimmed; with a GLIBC_TUNABLES malloc setting of the user's it leaves the allocator alone."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}

    def run(mode: str, mb: int = 64, tunables: str | None = None) -> tuple[str, int]:
        extra = {"GLIBC_TUNABLES": tunables} if tunables else {}
        out = subprocess.run(
            [sys.executable, "-c", KEEP_FREED, mode, str(mb)],
            env=env | extra,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        kept, free_mb = out.stdout.split()
        return kept, int(free_mb)

    kept, free_mb = run("call")
    assert kept == "True" and free_mb >= 64
    kept, free_mb = run("skip")
    assert kept == "None" and free_mb < 64  # glibc's default: the block was mapped and unmapped
    assert run("call", 3 << 10)[1] >= 3 << 10
    assert run("call", tunables="glibc.malloc.mmap_max=0")[0] == "False"
