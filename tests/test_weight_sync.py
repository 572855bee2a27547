"""learner/weight_sync: the push's one owner. Deltas against full_every, resends addressed to the one server that
lags (never to one that evaluates, after a grace scaled by the push's size), the transports' refs, the choice of
transport, and the engine's tensors gathered and quantized per parameter."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import zmq
from conftest import GPU_SGLANG
from test_delta import nbytes

from learner.servers import ServerInfo, ServerRegistry
from learner.weight_sync import IpcTransport, NcclTransport, WeightSync, ZmqTransport, build
from learner.weight_sync.sync import RESEND_BYTES_PER_S
from qurl.config import load_config
from qurl.wire import transport
from qurl.wire.protocol import Status, WeightPush, WeightRef

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META = (["a.weight", "a.weight_scale_inv"], ["float8_e4m3fn", "float32"], [[256, 128], [2, 1]])


def cfg(*overrides):
    return load_config(None, list(overrides), check_paths=False)


class Server:
    """A rollout server's control end, as a test drives it: a DEALER with a routing id, sending statuses and reading
    what the learner sends back to it alone (replies, eval requests, resent weights)."""

    def __init__(self, hub, sid: str) -> None:
        self.sock = transport.connect(hub.ctx, zmq.DEALER, hub.router, max_bytes=1 << 30)
        self.sock.disconnect(hub.router)
        self.sock.setsockopt(zmq.ROUTING_ID, sid.encode())
        self.sock.connect(hub.router)
        self.sid = sid
        self.tx = transport.Sender(self.sock, sid, secret=b"k")
        self.rx = transport.Receiver(
            self.sock, secret=b"k", max_bytes=1 << 30, kinds=("status", "weight_push", "weight_ref")
        )

    def say(self, kind: str, version: int, **counters) -> list:
        """Send one status, and return everything the learner sent back until its reply (and a moment after)."""
        self.tx.send(Status(type=kind, server_id=self.sid, version=version, counters=counters))
        got, deadline = [], time.monotonic() + 5
        while time.monotonic() < deadline and not any(isinstance(m, Status) and m.type == "reply" for m in got):
            msg = self.rx.recv(timeout_ms=100)
            got += [msg] if msg is not None else []
        time.sleep(0.1)
        while (msg := self.rx.recv(timeout_ms=0)) is not None:
            got.append(msg)
        return got


def weights_in(messages: list) -> list:
    return [m for m in messages if isinstance(m, (WeightPush, WeightRef))]


def test_deltas_follow_full_every_and_a_resend_is_the_whole_current_version(trajectory, weight_hub):
    versions = trajectory["int8"]

    def sync(full_every: int, scheme: str = "int8") -> WeightSync:
        return WeightSync(ZmqTransport(weight_hub.pub), ServerRegistry(), scheme, full_every=full_every)

    s = sync(3)
    modes = []
    for v in range(1, 7):
        modes.append(s._messages(v, versions[v])[0].mode)
        s.push(v, versions[v])
    assert modes == ["full", "delta", "full", "delta", "delta", "full"]  # v1: nothing to build on
    metrics = s.push(7, versions[0])
    current = s._current  # what a lagging server gets: the whole version 7
    assert current.mode == "full" and current.version == 7 and metrics["sync/delta"] == 1
    assert metrics["sync/bytes"] < metrics["sync/full_bytes"] == nbytes(current)
    s = sync(1)
    assert [s.push(v, versions[v])["sync/delta"] for v in (1, 2, 3)] == [0, 0, 0]
    s = sync(3)
    s.push(1, versions[1])
    assert s.push(5, versions[2])["sync/delta"] == 0  # not built on the version before: whole
    plain = {k: v for k, v in versions[1].items() if v.is_floating_point() and not k.endswith("_scale")}
    s = sync(10, "none")
    assert [s.push(v, plain)["sync/delta"] for v in (1, 2)] == [0, 0]  # no codes: nothing to delta


def test_a_heartbeat_lagging_just_after_a_push_gets_no_resend_but_a_request_does(trajectory, weight_hub):
    versions = trajectory["int8"]
    hub = weight_hub
    hub.sync.scheme = "int8"
    hub.plane.start()
    srv = Server(hub, "srv")
    hub.sync.push(1, versions[1])
    hub.sync.push(2, versions[2])
    assert not weights_in(srv.say("heartbeat", 1))  # the delta may still be on its way
    assert hub.sync.resends == 0
    resent = weights_in(srv.say("resend_weights", 1))
    assert [(m.version, m.mode) for m in resent] == [(2, "full")] and hub.sync.resends == 1


def test_a_server_evaluating_for_several_grace_periods_gets_no_resend_and_one_lagging_after_gets_one(
    trajectory,
    weight_hub,
):
    """The repush storm: a heartbeat that lagged 5 s after a push brought the whole push to every subscriber every 2 s,
    also while the server evaluated (it takes no weights then) and while it applied a big push. Now a server that
    says it evaluates gets nothing, the grace grows with the push's size, and a resend goes to that server alone."""
    versions = trajectory["int8"]
    hub = weight_hub
    hub.sync.scheme, hub.sync.grace_s = "int8", 0.3  # a short base grace, so that the test sees several
    hub.plane.start()
    evaluating, current = Server(hub, "rollout-0-1"), Server(hub, "rollout-1-2")
    sub = transport.connect(hub.ctx, zmq.SUB, hub.endpoint, max_bytes=1 << 30)
    sub_rx = transport.Receiver(sub, secret=b"k", max_bytes=1 << 30, kinds=("weight_push", "weight_ref"))
    time.sleep(0.3)  # PUB/SUB slow joiner
    evaluating.say("hello", 0)
    current.say("hello", 0)
    hub.sync.push(1, versions[1])
    assert sub_rx.recv(timeout_ms=5000).version == 1  # the push itself goes to every subscriber
    grace = hub.sync.grace_s + hub.sync._current_bytes / RESEND_BYTES_PER_S
    started, heard = time.monotonic(), []
    while time.monotonic() - started < 4 * grace + 1:  # several grace periods of heartbeats, evaluating
        heard += weights_in(evaluating.say("heartbeat", 0, evaluating=1))
        heard += weights_in(current.say("heartbeat", 1))
    assert heard == [] and hub.sync.resends == 0 and hub.sync.resend_bytes == 0
    resent = weights_in(evaluating.say("heartbeat", 0, evaluating=0))  # done evaluating, still behind
    assert [(m.version, m.mode) for m in resent] == [(1, "full")]
    assert not weights_in(current.say("heartbeat", 1)) and sub_rx.recv(timeout_ms=300) is None  # it alone
    assert hub.sync.resends == 1 and hub.sync.resend_bytes == nbytes(resent[0]) > 0
    metrics = hub.sync.metrics()
    assert metrics["sync/repushes"] == 1 and metrics["sync/repush_bytes"] == nbytes(resent[0])
    assert not weights_in(evaluating.say("heartbeat", 0))  # not again before another grace period
    print(f"grace {grace:.2f} s; resent {hub.sync.resend_bytes} bytes to one server, 0 while it evaluated")


def test_the_grace_before_a_resend_grows_with_the_push(trajectory, weight_hub):
    """An 8.7 GB push (7B FP8) may take a server well over the 5 s base grace to receive and apply."""
    hub = weight_hub
    hub.sync.push(1, trajectory["fp8-block"][1])
    sent: list = []
    info = ServerInfo(0, 0, 0, time.monotonic())
    hub.sync._current_bytes = int(8.7e9)
    pushed = hub.sync._pushed_at
    hub.sync.on_status("heartbeat", info, pushed + 60, lambda m: sent.append(m) or True)
    assert sent == []  # 60 s after an 8.7 GB push: still within 5 + 87 s
    hub.sync.on_status("heartbeat", info, pushed + 93, lambda m: sent.append(m) or True)
    assert len(sent) == 1


def test_refs_reach_the_servers_and_only_cuda_ipc_refs_are_resent(weight_hub):
    hub = weight_hub
    sub = transport.connect(hub.ctx, zmq.SUB, hub.endpoint, max_bytes=1 << 30)
    rx = transport.Receiver(sub, secret=b"k", max_bytes=1 << 30, kinds=("weight_push", "weight_ref"))
    time.sleep(0.3)
    tensors = {"a.weight": torch.zeros(256, 128, dtype=torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(2, 1)}

    class Refs:  # the transports' contract, without CUDA or a process group: send a ref, return it
        deltas = False

        def __init__(self, ref: WeightRef, resendable: bool) -> None:
            self.ref, self.resendable = ref, resendable

        def send(self, version: int, tensors: dict) -> WeightRef:
            hub.pub.send(self.ref)
            return self.ref

    nccl = WeightRef(version=1, scheme="fp8-block", transport="nccl", buckets=[META])
    sync = WeightSync(Refs(nccl, resendable=False), hub.servers, "fp8-block")
    metrics = sync.push(1, tensors)
    got = rx.recv(timeout_ms=5000)
    assert isinstance(got, WeightRef) and got.version == 1 and got.buckets[0][0] == META[0]
    assert metrics["sync/bytes"] == 256 * 128 + 2 * 4 and sync.version == 1 and sync._current is None
    ipc = WeightRef(version=2, scheme="fp8-block", transport="cuda-ipc", buckets=[META], payloads=[[b"h0", b"h1"]])
    sync = WeightSync(Refs(ipc, resendable=True), hub.servers, "fp8-block")
    sync.push(2, tensors)
    assert rx.recv(timeout_ms=5000).payloads == [[b"h0", b"h1"]] and sync._current is ipc


def test_the_learner_builds_the_configured_transport(weight_hub):
    hub = weight_hub
    sub = transport.connect(hub.ctx, zmq.SUB, hub.endpoint, max_bytes=1 << 30)
    rx = transport.Receiver(sub, secret=b"k", max_bytes=1 << 30, kinds=("weight_push", "weight_ref"))
    time.sleep(0.3)
    sync = build(cfg(), hub.pub, hub.servers, "int8", torch.device("cpu"))
    assert isinstance(sync.transport, ZmqTransport)
    codes = {"w": torch.ones(4, 4, dtype=torch.int8), "w_scale": torch.ones(4, 1)}
    sync.push(1, codes)
    got = rx.recv(timeout_ms=5000)
    assert isinstance(got, WeightPush) and got.version == 1
    assert np.array_equal(got.tensors["w"].data, np.ones((4, 4), np.int8))
    for tp, ranks in ((1, 4), (2, 4)):
        ipc = build(
            cfg("sync.transport=cuda-ipc", *GPU_SGLANG, f"rollout.tp_size={tp}", f"cluster.rollout_servers={4 // tp}"),
            hub.pub,
            hub.servers,
            "fp8-block",
            torch.device("cpu"),
        )
        assert isinstance(ipc.transport, IpcTransport) and ipc.transport.ranks == ranks
    nccl = NcclTransport(hub.pub, "fp8-block", torch.device("cpu"), "tcp://127.0.0.1:29999", replicas=2, tp_size=2)
    assert nccl.world == 5 and nccl.address == ("127.0.0.1", 29999) and nccl.in_flight == 2
    with pytest.raises(ValueError, match="sync.group_endpoint=auto"):
        NcclTransport(hub.pub, "none", torch.device("cpu"), "auto", 1, 1)


def test_the_engine_tensors_gathered_per_parameter_equal_those_of_the_full_state(demo_dir):
    """Quantized on the device one parameter at a time (the push no longer gathers a full fp32 copy to rank 0's
    host first): bit for bit what quantizing the gathered state gives, on an FSDP2 model of one gloo rank."""
    import socket

    import torch.distributed as dist

    from learner import checkpoint
    from learner.model import build_policy
    from learner.weight_sync.tensors import engine_tensors, gather_engine_tensors

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        c = load_config(
            os.path.join(ROOT, "configs", "demo-cpu.yaml"),
            [f"model.path={demo_dir}/model", f"data.train_files=[{demo_dir}/train.jsonl]"],
        )
        model = build_policy(c, torch.device("cpu"))
        for scheme, dtype in (("int8", torch.float32), ("fp8-block", torch.bfloat16), ("none", torch.bfloat16)):
            gathered = gather_engine_tensors(model, scheme, 8, dtype, tied=True, is_main=True)
            full = engine_tensors(checkpoint.full_state_dict(model), scheme, 8, dtype, tied=True)
            assert gathered.keys() == full.keys() and "lm_head.weight" not in gathered
            for k in full:
                assert gathered[k].dtype == full[k].dtype and gathered[k].device.type == "cpu"
                assert torch.equal(gathered[k].view(torch.uint8), full[k].view(torch.uint8)), k
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 ranks x 4 cases of process starts, ~25 s: the default suite stays under 10 minutes
def test_the_push_cost_benchmark_runs_at_tiny_shapes(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "push.json"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "push_cost.py"), "--shapes", "tiny", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    result = json.loads(out.read_text())
    measured = [r for r in result["rows"] if not r.get("extrapolated")]
    assert {(r["path"], r["layers"]) for r in measured} == {(p, n) for p in ("before", "device") for n in (1, 2)}
    pushes = {r["push_bytes"] for r in measured if r["layers"] == 2}
    assert len(pushes) == 1  # the same tensors either way
    assert {r["path"] for r in result["rows"] if r.get("extrapolated")} == {"before", "device"}
