"""sync.transport=zmq (any engine, CPU or GPU): each version's tensors, whole or as a delta, in one WeightPush on the
PUB socket every server subscribes to."""

from __future__ import annotations

from qurl.wire.protocol import WeightPush
from qurl.wire.transport import Sender


class ZmqTransport:
    """WeightPush messages over PUB; the servers call engine.update_weights / apply_delta."""

    deltas = True  # a version may go as a delta of the one before
    resendable = True  # the current version can go again, whole, to one server

    def __init__(self, pub: Sender) -> None:
        self.pub = pub

    def send(self, push: WeightPush) -> None:
        self.pub.send(push)
