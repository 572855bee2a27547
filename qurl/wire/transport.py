"""ZeroMQ for qurl.wire.protocol: safe defaults, stamped sends, a receiver that survives bad input."""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from typing import Any

import zmq

from qurl.config import is_loopback_host
from qurl.wire.frames import ProtocolError, ReplayGuard
from qurl.wire.protocol import Message, decode, encode

log = logging.getLogger(__name__)


def is_loopback(endpoint: str) -> bool:
    """ipc:// and inproc:// never leave the machine; tcp:// must name a loopback host."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    return is_loopback_host(rest.rsplit(":", 1)[0])


def _socket(ctx: zmq.Context, kind: int, max_bytes: int, hwm: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # libzmq drops a peer sending a bigger frame
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


def bind(
    ctx: zmq.Context,
    kind: int,
    endpoint: str,
    *,
    secret: bytes | None,
    max_bytes: int,
    hwm: int = 1000,
) -> zmq.Socket:
    """Bind; a non-loopback endpoint needs a secret, so nothing is exposed unauthenticated."""
    if secret is None and not is_loopback(endpoint):
        raise ValueError(f"refusing to bind {endpoint} without transport.secret: set a secret or use 127.0.0.1")
    sock = _socket(ctx, kind, max_bytes, hwm)
    sock.bind(endpoint)
    return sock


def connect(ctx: zmq.Context, kind: int, endpoint: str, *, max_bytes: int, hwm: int = 1000) -> zmq.Socket:
    """Connect a socket with the same options as bind."""
    sock = _socket(ctx, kind, max_bytes, hwm)
    sock.connect(endpoint)
    return sock


class Sender:
    """Stamps messages with this socket's sender id, a fresh session nonce and a rising seq."""

    def __init__(self, sock: zmq.Socket, sender: str, *, secret: bytes | None = None) -> None:
        self.sock = sock
        self.sender = sender
        self.secret = secret
        self.session = secrets.token_hex(8)
        self.seq = 0

    def send(self, msg: Message, *, to: bytes | None = None, flags: int = 0) -> None:
        """Send without copying big frames; `to` is the peer identity on a ROUTER socket."""
        frames = encode(msg, sender=self.sender, session=self.session, seq=self.seq, secret=self.secret)
        if to is not None:
            frames.insert(0, to)
        self.sock.send_multipart(frames, flags=flags, copy=False)
        self.seq += 1


class Receiver:
    """Receives and decodes; a bad message is logged (rate-limited), counted and dropped."""

    def __init__(
        self,
        sock: zmq.Socket,
        *,
        secret: bytes | None,
        max_bytes: int,
        kinds: tuple[str, ...] | None = None,
        log_every_s: float = 1.0,
    ) -> None:
        self.sock = sock
        self.secret = secret
        self.max_bytes = max_bytes
        self.kinds = kinds
        self.guard = ReplayGuard()
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self.log_every_s = log_every_s
        self._logged_at = -float("inf")
        self._unlogged = 0

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """Next valid message, or None on timeout or when the message was rejected."""
        got = self._recv(timeout_ms, routed=False)
        return None if got is None else got[1]

    def recv_routed(self, timeout_ms: int | None = None) -> tuple[bytes, Message] | None:
        """For ROUTER sockets: (peer identity, message), or None."""
        return self._recv(timeout_ms, routed=True)

    def counts(self) -> dict[str, Any]:
        """Accepted and rejected totals, for status lines and heartbeats."""
        return {"accepted": self.accepted, "rejected": dict(self.rejected)}

    def _recv(self, timeout_ms: int | None, routed: bool) -> tuple[bytes, Message] | None:
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        ident = frames.pop(0).bytes if routed else b""
        try:
            msg = decode(
                frames,
                secret=self.secret,
                max_bytes=self.max_bytes,
                replay_guard=self.guard,
                kinds=self.kinds,
            )
        except ProtocolError as err:
            self._reject(err, frames[0] if frames else None)
            return None
        self.accepted += 1
        return ident, msg

    def _reject(self, err: ProtocolError, first: Any) -> None:
        name = type(err).__name__
        self.rejected[name] += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at < self.log_every_s:
            return
        try:
            peer = first.get("Peer-Address")
        except (AttributeError, zmq.ZMQError):
            peer = "?"
        text = " ".join(str(err).split())[:300]  # attacker-chosen text: one bounded line
        log.warning(
            "dropped a bad message from %s: %s: %s (%d dropped since the last line, %d in all)",
            peer,
            name,
            text,
            self._unlogged,
            sum(self.rejected.values()),
        )
        self._logged_at = now
        self._unlogged = 0
