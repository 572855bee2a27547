"""learner/control_plane.py: hellos, heartbeats and byes over real sockets; evaluation routing."""

import time

import zmq

from qurl.wire import transport
from qurl.wire.protocol import Status


def test_an_eval_request_lost_with_a_killed_server_goes_to_its_replacement(weight_hub):
    """The end-of-run quantized eval must not wait for a server that was killed holding the request."""
    plane, router, ctx = weight_hub.plane, weight_hub.router, weight_hub.ctx
    plane.start()

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


def test_servers_are_not_idle_while_an_evaluation_is_asked_or_unanswered(weight_hub):
    """The learner lends itself the servers' cores only while they have nothing to do, evaluations included."""
    from learner.budget import Budget

    plane, router, ctx = weight_hub.plane, weight_hub.router, weight_hub.ctx
    plane.budget = Budget(0, 1, lambda version: (1, 0, {}))  # one group accepted of L = 1: no room
    plane.start()
    assert plane.servers_idle()
    plane.request_eval(3)
    assert not plane.servers_idle()  # asked, no server has taken it yet
    sock = transport.connect(ctx, zmq.DEALER, router, max_bytes=1 << 20)
    tx = transport.Sender(sock, "rollout-0-7", secret=b"k")
    rx = transport.Receiver(sock, secret=b"k", max_bytes=1 << 20)
    tx.send(Status(type="heartbeat", server_id=tx.sender, version=0, counters={}))
    got, deadline = [], time.monotonic() + 5
    while time.monotonic() < deadline and not any(m.type == "eval_request" for m in got):
        msg = rx.recv(timeout_ms=200)
        got += [msg] if msg is not None else []
    assert [m.version for m in got if m.type == "eval_request"] == [3]
    assert not plane.servers_idle()  # handed out, not answered: the server is evaluating
    tx.send(Status(type="eval_result", server_id=tx.sender, version=3, counters={"acc": 0.5}))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not plane.servers_idle():
        time.sleep(0.05)
    assert plane.servers_idle() and plane.take_eval_results() == [(3, {"acc": 0.5})]
