"""rollout_server/weight_receiver.py: the server's one owner of weight apply. Pushes in version order (a delta only on
its base, the newest full push over anything older), the engine after N deltas equal to one full push in the same
buffers, a bf16 engine through every delta, and end to end a real server process that detects a corrupted delta and
a missed version, asks, and is healed by a full push sent to it alone. The nccl refs' order runs with SGLang's own
receiver in tests/test_sglang.py."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from test_delta import delta_of, full_of, nbytes, same, wire

from learner.budget import Budget
from learner.control_plane import ControlPlane
from learner.servers import ServerRegistry
from learner.weight_sync import WeightSync, ZmqTransport
from qurl.wire import delta, transport
from rollout_server.engines import GenRequest, load_engine
from rollout_server.weight_receiver import WeightReceiver

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(Path(sys.executable).parent / "qurl-rollout-server")


def _bf16_engine(model_dir, versions):
    engine = load_engine(model_dir, quant="int8", dtype="bfloat16", max_batch=2, max_seq_len=32)
    engine.update_weights({k: v.clone() for k, v in versions[1].items()}, 1)
    return engine


def test_engine_after_deltas_equals_engine_after_a_full_push(model_dir, trajectory):
    versions = trajectory["int8"]
    a = load_engine(model_dir, quant="int8", max_batch=2, max_seq_len=32)
    b = load_engine(model_dir, quant="int8", max_batch=2, max_seq_len=32)
    ptrs = {k: v.data_ptr() for k, v in a.weights.items()}
    requests = []
    receiver = WeightReceiver(a, "int8", lambda: requests.append(a.version))
    receiver.apply([wire(full_of(versions[1], 1))])
    # out of order and with a repeat: the receiver sorts and applies each version once
    receiver.apply([wire(delta_of(versions[v - 1], versions[v], v)) for v in (3, 2, 4, 2)])
    assert a.version == 4 and receiver.counters["weight_deltas_applied"] == 3 and not requests
    b.update_weights({k: v.clone() for k, v in versions[4].items()}, 4)
    assert same(a.weights, b.weights) and same(a.weights, versions[4])
    assert ptrs == {k: v.data_ptr() for k, v in a.weights.items()}, "a delta must write into the existing buffers"
    req = [GenRequest([3, 5, 7, 11], n=1, max_new_tokens=6, temperature=0)]
    assert a.generate(req)[0].samples[0].logprobs == b.generate(req)[0].samples[0].logprobs  # derived copies too

    # a missed version: the delta for 6 does not apply on 4; the receiver asks for a full push, changes nothing
    receiver.apply([wire(delta_of(versions[5], versions[6], 6))])
    assert a.version == 4 and same(a.weights, versions[4]) and requests == [4] and receiver.need_full
    assert receiver.counters["weight_deltas_without_base"] == 1
    receiver.apply([wire(full_of(versions[6], 6))])
    assert a.version == 6 and same(a.weights, versions[6]) and not receiver.need_full


def test_bf16_engine_takes_small_exact_deltas_of_every_tensor(model_dir, bf16_versions):
    versions = bf16_versions
    engine = _bf16_engine(model_dir, versions)
    ptrs = {k: v.data_ptr() for k, v in engine.weights.items()}
    receiver = WeightReceiver(engine, "int8", lambda: pytest.fail("no full push should be needed"))
    counters = receiver.counters
    embed = "model.embed_tokens.weight"
    for v in range(2, 7):
        push = wire(delta_of(versions[v - 1], versions[v], v))
        bf16 = {k for k, t in versions[v].items() if t.dtype == torch.bfloat16}
        assert not bf16 & set(push.tensors), "no unquantized bf16 tensor travels whole at this learning rate"
        _, deltas = delta.split_push(push)
        assert embed in deltas and deltas[embed].indices.numel() < 0.05 * versions[v][embed].numel()
        assert nbytes(push) <= 0.10 * nbytes(full_of(versions[v], v)), (nbytes(push), nbytes(full_of(versions[v], v)))
        receiver.apply([push])
        assert engine.version == v and same(engine.weights, versions[v]), f"version {v} not bit-equal"
    assert counters["weight_deltas_applied"] == 5 and counters["weight_pushes_rejected"] == 0
    assert ptrs == {k: t.data_ptr() for k, t in engine.weights.items()}


# -- end to end: a real server process, the learner's real weight sync and control plane ----------------------------


@pytest.mark.slow  # 30-60 s each on an AVX2-only EPYC; the default suite keeps under 10 minutes there (README)
def test_corrupted_delta_and_missed_version_heal_through_a_full_push(demo_dir, trajectory, tmp_path):
    versions = trajectory["int8"]
    ctx = zmq.Context()
    pull = transport.bind(ctx, zmq.PULL, "tcp://127.0.0.1:*", secret=None, max_bytes=1 << 26)
    pub = transport.bind(ctx, zmq.PUB, "tcp://127.0.0.1:*", secret=None, max_bytes=1 << 20, hwm=4)
    router = transport.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", secret=None, max_bytes=1 << 20)
    servers = ServerRegistry()
    sync = WeightSync(ZmqTransport(transport.Sender(pub, "learner")), servers, "int8", full_every=100)
    plane = ControlPlane(
        transport.Receiver(router, secret=None, max_bytes=1 << 20),
        transport.Sender(router, "learner"),
        Budget(0, 1, lambda version: (0, 0, {})),
        servers,
        sync,
    )
    plane.start()
    endpoints = [
        f"transport.{n}={s.last_endpoint.decode()}"
        for n, s in (("trajectories", pull), ("weights", pub), ("control", router))
    ]
    demo = Path(demo_dir)
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                SERVER,
                "--config",
                str(ROOT / "configs/demo-cpu.yaml"),
                f"model.path={demo / 'model'}",
                f"data.train_files=[{demo / 'train.jsonl'}]",
                "data.eval_files=[]",
                f"run.dir={tmp_path / 'run'}",
                "rollout.quant=int8",
                "train.batch_prompts=1",
                "async.max_staleness=0",
                "rollout.n_samples=2",
                "rollout.sampling.max_new_tokens=4",
                "reward.workers=1",
                "log.interval_s=1",
                *endpoints,
            ],
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def wait(what: str, until, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"server exited with {proc.returncode}"
            server = next(iter(servers.values()), None)
            if server is not None and until(server):
                return server.counters
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last counters {server and server.counters}")

    try:
        wait("hello", lambda s: True, timeout_s=90)
        for v in (1, 2, 3):
            sync.push(v, versions[v])
            wait(f"version {v}", lambda s, v=v: s.version == v)
        c = wait("counters of version 3", lambda s: s.counters.get("weight_deltas_applied") == 2)
        assert c["weight_checksum_mismatches"] == 0 and c["weight_pushes_applied"] == 3

        # the learner holds the true version 4; the server gets a corrupt delta of it (a transport that flips a code)
        sent = []
        sync.transport = type("Recording", (), {"deltas": True, "resendable": True, "send": staticmethod(sent.append)})
        sync.push(4, versions[4])
        sync.transport = ZmqTransport(transport.Sender(pub, "learner"))
        push = sent[0]
        whole, deltas = delta.split_push(push)
        name = next(iter(deltas))
        values = deltas[name].values.clone()
        values[0] = 127 if values[0] != 127 else -127
        sync.transport.send(
            delta.delta_push(
                4, "int8", whole, {**deltas, name: delta.Delta(deltas[name].indices, values)}, push.checksum
            )
        )
        c = wait("the full push after a checksum mismatch", lambda s: s.version == 4)
        assert c["weight_checksum_mismatches"] == 1 and c["weight_full_requests"] >= 1
        assert c["weight_deltas_applied"] == 2 and c["weight_pushes_applied"] == 4

        sync.transport = type("Lost", (), {"deltas": True, "resendable": True, "send": staticmethod(sent.append)})
        sync.push(5, versions[5])  # lost on the way: the server misses version 5
        sync.transport = ZmqTransport(transport.Sender(pub, "learner"))
        sync.push(6, versions[6])
        c = wait("the full push after a missed version", lambda s: s.version == 6)
        assert c["weight_deltas_without_base"] == 1 and c["weight_checksum_mismatches"] == 1
        sync.push(7, versions[0])  # and the healed base carries deltas again
        c = wait("a delta on the healed base", lambda s: s.counters.get("weight_deltas_applied") == 3)
        assert c["weight_checksum_mismatches"] == 1 and c["weight_pushes_rejected"] == 1
        assert sync.resends >= 2  # each full push the server asked for went to it alone, over the control channel
        print(f"server counters: {c}; resends {sync.resends} ({sync.resend_bytes} bytes)")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        plane.close()
        ctx.destroy(linger=0)
        print(log_path.read_text()[-3000:])
