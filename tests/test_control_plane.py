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
