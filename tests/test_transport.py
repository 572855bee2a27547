"""qurl.wire.transport on real sockets: loopback by default, a receiver process that outlives garbage."""

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from qurl.wire import transport
from qurl.wire.frames import from_torch, mac, to_torch
from qurl.wire.protocol import Sample, Status, TrajectoryGroup, WeightPush, encode

ROOT = Path(__file__).resolve().parents[1]
SECRET = b"transport-secret"
MAX = 1 << 20
WAIT_MS = 5000


def group() -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_id="p1",
        group_id="g1",
        server_id="srv",
        prompt_ids=[1, 2, 3],
        samples=(Sample([4, 5], [-0.5, -1.0], [0, 0], 1.0, "stop"),),
    )


def status(kind: str = "heartbeat", **kw) -> Status:
    return Status(type=kind, server_id="srv", version=1, **kw)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def pull_push(ctx, secret=SECRET, max_bytes=MAX):
    pull = transport.bind(ctx, zmq.PULL, "tcp://127.0.0.1:*", secret=secret, max_bytes=max_bytes)
    push = transport.connect(ctx, zmq.PUSH, pull.last_endpoint.decode(), max_bytes=max_bytes)
    return pull, push


@pytest.mark.parametrize(
    "endpoint, local",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.2:*", True),
        ("tcp://localhost:1", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/qurl.sock", True),
        ("inproc://x", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.1.2.3:5555", False),
        ("tcp://eth0:5555", False),
        ("udp://127.0.0.1:5555", False),
    ],
)
def test_is_loopback(endpoint, local):
    assert transport.is_loopback(endpoint) is local


def test_bind_refuses_open_address_without_secret(ctx):
    with pytest.raises(ValueError, match="without transport.secret"):
        transport.bind(ctx, zmq.PULL, "tcp://0.0.0.0:*", secret=None, max_bytes=MAX)
    sock = transport.bind(ctx, zmq.PULL, "tcp://0.0.0.0:*", secret=SECRET, max_bytes=MAX)
    assert sock.getsockopt(zmq.LINGER) == 0 and sock.getsockopt(zmq.MAXMSGSIZE) == MAX


def test_push_pull_round_trip_and_counts(ctx, caplog):
    pull, push = pull_push(ctx)
    rx = transport.Receiver(pull, secret=SECRET, max_bytes=MAX, log_every_s=3600)
    tx = transport.Sender(push, "srv", secret=SECRET)
    assert rx.recv(timeout_ms=10) is None  # timeout
    tx.send(group())
    got = rx.recv(timeout_ms=WAIT_MS)
    assert isinstance(got, TrajectoryGroup) and got.prompt_id == "p1"
    np.testing.assert_array_equal(got.samples[0].token_ids, [4, 5])
    with caplog.at_level(logging.WARNING, logger="qurl.wire.transport"):
        push.send_multipart([b"not json"])
        transport.Sender(push, "srv", secret=b"wrong").send(group())
        push.send_multipart(encode(group(), sender="srv", session=tx.session, seq=0, secret=SECRET))  # replay of seq 0
        for _ in range(3):
            assert rx.recv(timeout_ms=WAIT_MS) is None
    assert rx.counts() == {"accepted": 1, "rejected": {"BadAuth": 2, "Replay": 1}}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "BadAuth" in lines[0] and "127.0.0.1" in lines[0]
    tx.send(status())
    assert isinstance(rx.recv(timeout_ms=WAIT_MS), Status)
    assert rx.accepted == 2


def test_receiver_kinds_filter(ctx):
    pull, push = pull_push(ctx, secret=None)
    rx = transport.Receiver(pull, secret=None, max_bytes=MAX, kinds=("trajectory_group",))
    tx = transport.Sender(push, "srv")
    tx.send(status())
    tx.send(group())
    assert rx.recv(timeout_ms=WAIT_MS) is None
    assert isinstance(rx.recv(timeout_ms=WAIT_MS), TrajectoryGroup)
    assert rx.counts() == {"accepted": 1, "rejected": {"BadHeader": 1}}


def test_router_dealer_control(ctx):
    router = transport.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", secret=SECRET, max_bytes=MAX)
    dealer = transport.connect(ctx, zmq.DEALER, router.last_endpoint.decode(), max_bytes=MAX)
    learner_rx = transport.Receiver(router, secret=SECRET, max_bytes=MAX, kinds=("status",))
    learner_tx = transport.Sender(router, "learner", secret=SECRET)
    server_rx = transport.Receiver(dealer, secret=SECRET, max_bytes=MAX, kinds=("status",))
    server_tx = transport.Sender(dealer, "srv", secret=SECRET)

    server_tx.send(status("hello", engine="torch", quant="int8"))
    ident, hello = learner_rx.recv_routed(timeout_ms=WAIT_MS)
    assert hello.type == "hello" and hello.quant == "int8"
    learner_tx.send(Status(type="reply", server_id="srv", version=9, budget=4), to=ident)
    reply = server_rx.recv(timeout_ms=WAIT_MS)
    assert (reply.type, reply.version, reply.budget) == ("reply", 9, 4)
    dealer.send_multipart([b"garbage"])
    assert learner_rx.recv_routed(timeout_ms=WAIT_MS) is None
    assert learner_rx.rejected == {"BadAuth": 1}


def test_pub_sub_weight_push(ctx):
    pub = transport.bind(ctx, zmq.PUB, "tcp://127.0.0.1:*", secret=SECRET, max_bytes=MAX, hwm=4)
    sub = transport.connect(ctx, zmq.SUB, pub.last_endpoint.decode(), max_bytes=MAX, hwm=4)
    rx = transport.Receiver(sub, secret=SECRET, max_bytes=MAX, kinds=("weight_push",))
    tx = transport.Sender(pub, "learner", secret=SECRET)
    w = torch.randn(64, 32).bfloat16()
    push = WeightPush(
        version=2, scheme="bf16", bucket_bytes=2048, tensors={"w": from_torch(w), "b": from_torch(torch.arange(7.0))}
    )
    got = None
    deadline = time.monotonic() + 10
    while got is None and time.monotonic() < deadline:  # slow joiner: resend until subscribed
        tx.send(push)
        got = rx.recv(timeout_ms=100)
    assert got is not None and got.version == 2
    assert torch.equal(to_torch(*got.tensors["w"]), w)
    assert torch.equal(to_torch(*got.tensors["b"]), torch.arange(7.0))
    assert not rx.rejected  # resends carry fresh seqs, so none looks like a replay


CHILD = r"""
import json, sys, zmq
from qurl.wire import transport
secret = bytes.fromhex(sys.argv[1])
ctx = zmq.Context()
sock = transport.bind(ctx, zmq.PULL, "tcp://127.0.0.1:*", secret=secret, max_bytes=1 << 16)
rx = transport.Receiver(sock, secret=secret, max_bytes=1 << 16, log_every_s=0.2)
print(sock.last_endpoint.decode(), flush=True)
while True:
    msg = rx.recv(timeout_ms=100)
    if msg is not None:
        print(json.dumps({"type": msg.type, **rx.counts()}), flush=True)
        if msg.type == "bye":
            break
"""


def _signed(frames_edit, seq):
    """A correctly signed message whose content is broken by frames_edit."""
    frames = [
        bytes(memoryview(f).cast("B")) for f in encode(group(), sender="fuzz", session="f1", seq=seq, secret=SECRET)
    ][:-1]
    frames = frames_edit(frames)
    return [*frames, mac(SECRET, frames)]


def _lie_about_shape(frames):
    h = json.loads(frames[0])
    h["arrays"][0]["shape"] = [1000]
    return [json.dumps(h).encode(), *frames[1:]]


def _positive_logprob(frames):
    return [frames[0], frames[1], frames[2], np.array([0.5, -1], np.float32).tobytes(), frames[4]]


@pytest.mark.timeout(120)
def test_live_receiver_survives_garbage(ctx):
    """A real process counts every bad message, keeps running, then takes valid ones."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, SECRET.hex()],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:"), proc.stderr.read()
        push = transport.connect(ctx, zmq.PUSH, endpoint, max_bytes=1 << 24)
        tx = transport.Sender(push, "srv", secret=SECRET)
        rng = np.random.default_rng(0)
        expected = Counter()

        def send(frames, error):
            push.send_multipart(frames)
            expected[error] += 1

        for _ in range(40):  # random bytes in random frame counts
            send([rng.bytes(int(rng.integers(0, 2000))) for _ in range(rng.integers(1, 5))], "BadAuth")
        send(encode(status(), sender="x", session="s", seq=0, secret=None), "BadAuth")
        send(encode(status(), sender="x", session="s", seq=0, secret=b"guess"), "BadAuth")
        send([b"{}", *[bytes(30_000)] * 3], "TooLarge")  # each frame fits, the sum does not
        send(_signed(lambda f: [b"\x00not json", *f[1:]], seq=1), "BadHeader")
        send(_signed(_lie_about_shape, seq=2), "BadFrame")
        send(_signed(_positive_logprob, seq=3), "BadField")

        tx.send(status())
        first = json.loads(proc.stdout.readline())
        assert first["accepted"] == 1 and first["type"] == "heartbeat"
        assert first["rejected"] == expected

        replayed = encode(status(), sender="srv", session=tx.session, seq=0, secret=SECRET)
        send(replayed, "Replay")
        big = transport.connect(ctx, zmq.PUSH, endpoint, max_bytes=1 << 24)
        big.send_multipart([bytes(1 << 17)])  # over MAXMSGSIZE: libzmq drops this peer
        with socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))) as raw:
            raw.sendall(b"\xff" + bytes(8) + b"\x7f" + rng.bytes(4096))  # ZMTP-ish, then junk
        with socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))) as raw:
            raw.sendall(rng.bytes(10_000))
        time.sleep(0.3)
        assert proc.poll() is None

        tx.send(status())
        second = json.loads(proc.stdout.readline())
        assert second["accepted"] == 2
        rejects = sum(second["rejected"].values())
        # libzmq may parse raw junk as legacy ZMTP frames and deliver it: more BadAuth, no other
        assert second["rejected"].pop("BadAuth") >= expected.pop("BadAuth")
        assert second["rejected"] == expected
        tx.send(status("bye"))
        assert json.loads(proc.stdout.readline())["type"] == "bye"
        assert proc.wait(timeout=10) == 0
        log_lines = proc.stderr.read().splitlines()
        assert any("dropped a bad message" in line for line in log_lines)
        assert len(log_lines) < rejects  # rate-limited, not one line per bad frame
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.mark.timeout(180)
def test_wire_benchmark_quick(tmp_path):
    out = tmp_path / "wire.json"
    res = subprocess.run(
        [sys.executable, "benchmarks/wire.py", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    printed, written = json.loads(res.stdout), json.loads(out.read_text())
    assert printed == written
    assert written["benchmark"] == "wire"
    assert set(written["machine"]) >= {"cpu", "cores", "gpu", "torch", "python"}
    rows = written["rows"]
    assert {(r["case"], r["path"], r["hmac"]) for r in rows} == {
        (c, p, h)
        for c in ("trajectory", "weight_push")
        for p, h in (("raw_zmq", False), ("protocol", False), ("protocol", True))
    }
    for r in rows:
        assert r["repeats"] >= 1 and r["seconds"] > 0 and r["mb_per_s"] > 0
        assert all(not isinstance(v, (dict, list)) for v in r.values())  # flat rows
    traj = [r for r in rows if r["case"] == "trajectory"]
    assert all(r["msgs_per_s"] > 0 and r["samples"] == 8 and r["tokens"] == 256 for r in traj)
    raw = next(r for r in traj if r["path"] == "raw_zmq")
    proto = next(r for r in traj if r["path"] == "protocol" and not r["hmac"])
    assert written["ratios"]["trajectory_protocol_vs_raw"] == pytest.approx(proto["msgs_per_s"] / raw["msgs_per_s"])
    assert set(written["ratios"]) == {
        "trajectory_protocol_vs_raw",
        "trajectory_protocol_hmac_vs_raw",
        "weight_push_protocol_vs_raw",
        "weight_push_protocol_hmac_vs_raw",
    }
