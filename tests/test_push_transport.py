"""sync.transport (zmq | cuda-ipc | nccl): config rules, the WeightRef message, the learner's choice of transport,
and the launcher's process layout on an 8-GPU node. Runs on CPU without sglang; the SGLang ends are in
tests/test_sglang.py (CPU, real sglang) and benchmarks/gpu_check_sglang.sh (GPU)."""

import os
import time

import numpy as np
import pytest
import torch
import zmq

from learner import push_transport
from learner.control_plane import SERVER_GONE_S, ServerInfo
from qurl import protocol, transport
from qurl.config import ConfigError, load_config
from qurl.frames import BadAuth, BadField, BadFrame
from qurl.layout import plan
from qurl.protocol import Status, WeightRef

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSCALER = os.path.join(ROOT, "configs", "deepscaler-1.5b-int8.yaml")
DAPO = os.path.join(ROOT, "configs", "dapo-7b-fp8.yaml")
GPU_SGLANG = [
    "rollout.engine=sglang",
    "rollout.dtype=bfloat16",
    "cluster.learner_ranks=4",
    "cluster.learner_gpus=[4,5,6,7]",
    "cluster.rollout_gpus=[0,1,2,3]",
    "cluster.rollout_servers=4",
    "rollout.quant=fp8",
]


def cfg(*overrides, path=None):
    return load_config(path, list(overrides), check_paths=False)


def error(*overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        cfg(*overrides, path=path)
    assert "\n" not in str(info.value)
    return str(info.value)


# -- config -------------------------------------------------------------------------------------------


def test_zmq_is_the_default_and_the_only_transport_on_cpu():
    assert cfg().sync.transport == "zmq"
    for kind in ("cuda-ipc", "nccl"):
        assert "needs rollout.engine=sglang" in error(f"sync.transport={kind}")
        assert "on CPU use sync.transport=zmq" in error(
            f"sync.transport={kind}", "rollout.engine=sglang", "rollout.dtype=bfloat16"
        )
    assert "choose one of: zmq, cuda-ipc, nccl" in error("sync.transport=gloo")


def test_nccl_refuses_int8_and_cuda_ipc_stays_on_this_node():
    assert "cannot refit rollout.quant=int8" in error("sync.transport=nccl", *GPU_SGLANG, "rollout.quant=int8")
    assert cfg("sync.transport=nccl", *GPU_SGLANG).sync.transport == "nccl"
    assert cfg("sync.transport=cuda-ipc", *GPU_SGLANG, "rollout.quant=int8").rollout.quant == "int8"
    msg = error("sync.transport=cuda-ipc", *GPU_SGLANG, "transport.weights=tcp://10.0.0.2:5555", "transport.secret=k")
    assert "must be loopback or ipc://" in msg
    assert "sync.group_endpoint" in error("sync.group_endpoint=ipc:///tmp/x")
    assert "rollout.mem_fraction" in error("rollout.mem_fraction=1.5")


# -- the WeightRef message ---------------------------------------------------------------------------

META = (["a.weight", "a.weight_scale_inv"], ["float8_e4m3fn", "float32"], [[256, 128], [2, 1]])


def test_weight_ref_round_trips_with_hmac_and_strict_decoding():
    ref = WeightRef(
        version=7,
        scheme="fp8-block",
        transport="cuda-ipc",
        buckets=[META, (["b"], ["bfloat16"], [[3]])],
        payloads=[[b"rank0-b0", b"rank1-b0"], [b"rank0-b1", b"rank1-b1"]],
    )
    frames = protocol.encode(ref, sender="learner", session="s", seq=1, secret=b"key")
    got = protocol.decode(frames, secret=b"key", max_bytes=1 << 20, kinds=("weight_push", "weight_ref"))
    assert isinstance(got, WeightRef) and got.version == 7 and got.ranks == 2
    assert got.buckets[0] == (META[0], META[1], META[2]) and got.payloads[1] == [b"rank0-b1", b"rank1-b1"]
    tampered = list(frames)
    tampered[2] = bytes(b"x" * len(bytes(tampered[2])))
    with pytest.raises(BadAuth):
        protocol.decode(tampered, secret=b"key", max_bytes=1 << 20)
    unsigned = protocol.encode(ref, sender="learner", session="s", seq=1)
    with pytest.raises(BadFrame):  # a payload frame left out
        protocol.decode(unsigned[:-1], secret=None, max_bytes=1 << 20)
    nccl = WeightRef(version=1, scheme="none", transport="nccl", buckets=[(["w"], ["bfloat16"], [(4, 4)])])
    back = protocol.decode(protocol.encode(nccl, sender="l", session="s", seq=0), secret=None, max_bytes=1 << 20)
    assert back.transport == "nccl" and back.payloads == [] and back.buckets[0][2] == [[4, 4]]


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(transport="rdma"), "transport"),
        (dict(buckets=[]), "at least one bucket"),
        (dict(buckets=[(["w"], ["float64"], [[2]])]), "dtype"),
        (dict(buckets=[(["w"], ["float32"], [[-1]])]), "shape"),
        (dict(buckets=[(["w", "w"], ["float32"] * 2, [[1], [1]])]), "twice"),
        (dict(buckets=[(["w"], ["float32", "int8"], [[1]])]), "equal"),
        (dict(transport="nccl", payloads=[[b"x"]]), "nccl reference carries none"),
        (dict(payloads=[]), "one list per bucket"),
        (dict(payloads=[[b""]]), "bytes"),
    ],
)
def test_weight_ref_refuses_bad_fields(kwargs, fragment):
    fields = dict(
        version=1, scheme="none", transport="cuda-ipc", buckets=[(["w"], ["float32"], [[2]])], payloads=[[b"p"]]
    )
    fields.update(kwargs)
    with pytest.raises(BadField, match=fragment):
        WeightRef(**fields)


@pytest.fixture
def hub(weight_hub):
    """weight_hub (conftest) plus a server-side SUB receiver of its pushes."""
    sender, endpoint, ctx = weight_hub
    sub = transport.connect(ctx, zmq.SUB, endpoint, max_bytes=1 << 30)
    time.sleep(0.3)  # PUB/SUB slow joiner
    return sender, transport.Receiver(sub, secret=b"k", max_bytes=1 << 30, kinds=("weight_push", "weight_ref"))


def test_announced_refs_reach_a_server_and_nccl_refs_are_never_repushed(hub):
    sender, rx = hub
    tensors = {"a.weight": torch.zeros(256, 128, dtype=torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(2, 1)}
    ref = WeightRef(version=1, scheme="fp8-block", transport="nccl", buckets=[META])
    stats = sender.announce(1, ref, tensors, repush=False)
    got = rx.recv(timeout_ms=5000)
    assert isinstance(got, WeightRef) and got.version == 1 and got.buckets[0][0] == META[0]
    assert stats.bytes == 256 * 128 + 2 * 4 and sender.plane.version == 1 and sender.plane._full is None
    ipc = WeightRef(version=2, scheme="fp8-block", transport="cuda-ipc", buckets=[META], payloads=[[b"h0", b"h1"]])
    sender.announce(2, ipc, tensors, repush=True)
    assert rx.recv(timeout_ms=5000).payloads == [[b"h0", b"h1"]] and sender.plane._full is ipc


def test_wait_applied_returns_the_live_servers_still_behind(hub):
    sender, _ = hub
    now = time.monotonic()
    plane = sender.plane
    plane.servers = {
        "r0": ServerInfo(3, 0, 0, now),
        "r1": ServerInfo(2, 0, 0, now),
        "gone": ServerInfo(0, 0, 0, now - SERVER_GONE_S - 1),
    }
    started = time.monotonic()
    assert plane.wait_applied(3, timeout_s=0.3) == ["r1"]
    assert time.monotonic() - started >= 0.3
    plane.servers["r1"].version = 3
    assert plane.wait_applied(3, timeout_s=60) == []


# -- the learner's choice of transport ---------------------------------------------------------------


def test_learner_builds_the_configured_transport(hub):
    sender, rx = hub
    zmq_push = push_transport.build(cfg(), sender, "int8", torch.device("cpu"))
    assert isinstance(zmq_push, push_transport.ZmqPush)
    codes = {"w": torch.ones(4, 4, dtype=torch.int8), "w_scale": torch.ones(4, 1)}
    zmq_push.publish(1, codes)
    got = rx.recv(timeout_ms=5000)
    assert isinstance(got, protocol.WeightPush) and got.version == 1
    assert np.array_equal(got.tensors["w"].data, np.ones((4, 4), np.int8))
    for tp, ranks in ((1, 4), (2, 4)):
        ipc = push_transport.build(
            cfg("sync.transport=cuda-ipc", *GPU_SGLANG, f"rollout.tp_size={tp}", f"cluster.rollout_servers={4 // tp}"),
            sender,
            "fp8-block",
            torch.device("cpu"),
        )
        assert isinstance(ipc, push_transport.IpcPush) and ipc.ranks == ranks
    nccl = push_transport.NcclPush(
        sender, "fp8-block", torch.device("cpu"), "tcp://127.0.0.1:29999", replicas=2, tp_size=2
    )
    assert nccl.world == 5 and nccl.address == ("127.0.0.1", 29999)
    with pytest.raises(ValueError, match="sync.group_endpoint=auto"):
        push_transport.NcclPush(sender, "none", torch.device("cpu"), "auto", 1, 1)


# -- the launcher's layout ---------------------------------------------------------------------------


def test_deepscaler_layout_is_four_replicas_and_a_four_rank_learner():
    learner, *servers = plan(cfg(path=DEEPSCALER), available_gpus=8)
    assert (learner.program, learner.gpus, learner.env) == (
        "qurl-learner",
        [4, 5, 6, 7],
        {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
    )
    assert [(s.name, s.gpus, s.env) for s in servers] == [
        (f"rollout-{i}", [i], {"QURL_SERVER_INDEX": str(i)}) for i in range(4)
    ]  # SGLang places by base_gpu_id


def test_dapo_layout_is_two_tp2_replicas_and_visible_devices_map_through():
    learner, *servers = plan(cfg(path=DAPO), available_gpus=8)
    assert [s.gpus for s in servers] == [[0, 1], [2, 3]] and learner.gpus == [4, 5, 6, 7]
    learner, *_ = plan(cfg(path=DAPO), visible=["7", "6", "5", "4", "3", "2", "1", "0"])
    assert learner.env["CUDA_VISIBLE_DEVICES"] == "3,2,1,0"


def test_cpu_layout_is_unchanged():
    learner, *servers = plan(cfg("cluster.rollout_servers=2", "cluster.learner_ranks=2"))
    assert learner.env == {} and [s.env for s in servers] == [{"QURL_SERVER_INDEX": "0"}, {"QURL_SERVER_INDEX": "1"}]


@pytest.mark.parametrize(
    "overrides,available,fragment",
    [
        ([], 4, "names GPU 4, but this node has 4 GPUs"),
        (["cluster.rollout_gpus=[0,1,2]"], 8, "not a multiple of rollout.tp_size=2"),
        (["cluster.rollout_servers=4"], 8, "one server per replica"),
        (["cluster.rollout_gpus=[0,1,4,5]"], 8, "share GPUs [4, 5]"),
        (["cluster.rollout_gpus=[0,0,1,2]"], 8, "lists GPU 0 twice"),
        (["cluster.learner_gpus=[4,5,6]"], 8, "one GPU per rank"),
        (["cluster.rollout_gpus=[]"], 8, "needs cluster.rollout_gpus"),
        (["sync.transport=cuda-ipc", "cluster.rollout_gpus=[4,5,6,7]"], 8, "set rollout.mem_fraction"),
    ],
)
def test_bad_layouts_are_refused_with_one_line(overrides, available, fragment):
    with pytest.raises(ConfigError) as info:
        plan(cfg(*overrides, path=DAPO), available_gpus=available)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_colocated_layout_shares_gpus_with_cuda_ipc():
    c = cfg("sync.transport=cuda-ipc", "cluster.rollout_gpus=[4,5,6,7]", "rollout.mem_fraction=0.4", path=DAPO)
    learner, *servers = plan(c, available_gpus=8)
    assert learner.gpus == [4, 5, 6, 7] and [s.gpus for s in servers] == [[4, 5], [6, 7]]


@pytest.mark.parametrize("user", [{}, {"NCCL_CUMEM_ENABLE": "1"}])
def test_nccl_runs_give_the_learner_and_every_server_one_nccl_setting(monkeypatch, user):
    """SGLang sets NCCL_CUMEM_ENABLE=0 and NCCL_NVLS_ENABLE=0 in its processes where they are unset; the learner kept
    NCCL's default, and broadcasts between the two then fail. Now every child gets the same values (the user's wins)."""
    from qurl.launcher import build_children

    for key in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in user.items():
        monkeypatch.setenv(key, value)
    learner, servers = build_children(cfg("sync.transport=nccl", path=DAPO), "c.yaml", "out", available_gpus=8)
    want = {"NCCL_CUMEM_ENABLE": user.get("NCCL_CUMEM_ENABLE", "0"), "NCCL_NVLS_ENABLE": "0"}
    for child in (learner, *servers):
        assert {k: child.env.get(k) for k in want} == want, child.name
    learner, servers = build_children(cfg(path=DAPO), "c.yaml", "out", available_gpus=8)  # zmq: left alone
    assert "NCCL_NVLS_ENABLE" not in learner.env


def test_torch_engine_refuses_tensor_parallelism():
    with pytest.raises(ConfigError, match="rollout.tp_size=2 needs rollout.engine=sglang"):
        plan(cfg("rollout.tp_size=2"))


def test_an_eval_request_lost_with_a_killed_server_goes_to_its_replacement(weight_hub):
    """The end-of-run quantized eval must not wait for a server that was killed holding the request."""
    sender, _, ctx = weight_hub
    plane = sender.plane
    plane.start()
    router = plane.control.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def server(sid: str):
        sock = transport.connect(ctx, zmq.DEALER, router, max_bytes=1 << 20)
        return sock, transport.Sender(sock, sid, secret=b"k"), transport.Receiver(sock, secret=b"k", max_bytes=1 << 20)

    def say(who, kind: str, **counters) -> list[Status]:
        sock, tx, rx = who
        tx.send(Status(type=kind, server_id=tx.sender, version=0, counters=counters))
        got, deadline = [], time.monotonic() + 5
        while time.monotonic() < deadline and not any(m.type == "reply" for m in got):
            msg = rx.recv(timeout_ms=200)
            got += [msg] if msg is not None else []
        time.sleep(0.2)
        while (msg := rx.recv(timeout_ms=0)) is not None:
            got.append(msg)
        return got

    old = server("rollout-0-111")
    say(old, "hello")
    plane.request_eval(6)
    assert [m.version for m in say(old, "heartbeat") if m.type == "eval_request"] == [6]
    assert not [m for m in say(old, "heartbeat") if m.type == "eval_request"]  # asked once
    new = server("rollout-0-222")  # qurl-async restarted it: its hello names the dead pid
    assert [m.version for m in say(new, "hello", replaces_pid=111) if m.type == "eval_request"] == [6]
    plane.close()
