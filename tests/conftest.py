"""Shared fixtures: the prepared CPU demo and the real track, built once and cached across test sessions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The default demo folder (same place as `qurl-prepare-demo`), prepared on first use."""
    from qurl.demo.prepare import Recipe, prepare

    root = Path(os.environ.get("QURL_DEMO_DIR") or REPO / ".cache" / "qurl-demo")
    prepare(root, Recipe(), progress=False)
    return root


@pytest.fixture(scope="session")
def real_dir() -> Path:
    """The real-track folder (same place as `qurl-prepare-real`), prepared on first use (~30 s; `make test` installs
    its packages); skipped with the reason only where those packages are missing."""
    from qurl.real.gsm import MissingPackageError
    from qurl.real.prepare import default_root, prepare

    root = REPO / default_root()  # $QURL_REAL_DIR when set (an absolute path wins the join)
    try:
        prepare(root, progress=False)
    except MissingPackageError as e:
        pytest.skip(f"real track not prepared: {e}")
    return root


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tests run tiny ops: a second OpenMP thread in the test process only waits on a shared 2-core machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def weight_hub():
    """The learner's real WeightSender over its real ControlPlane (PUB + ROUTER on loopback, HMAC key b"k"), its PUB
    endpoint and zmq context."""
    import zmq

    from learner.budget import Budget
    from learner.control_plane import ControlPlane
    from learner.weight_sender import WeightSender
    from qurl import transport

    ctx = zmq.Context()
    pub = transport.bind(ctx, zmq.PUB, "tcp://127.0.0.1:*", secret=b"k", max_bytes=1 << 20, hwm=4)
    router = transport.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", secret=b"k", max_bytes=1 << 20)
    plane = ControlPlane(
        transport.Sender(pub, "learner", secret=b"k"),
        transport.Receiver(router, secret=b"k", max_bytes=1 << 20, kinds=("status",)),
        transport.Sender(router, "learner", secret=b"k"),
        budget=Budget(0, 1, lambda: (0, {})),
    )
    sender = WeightSender(plane, "fp8-block")
    yield sender, pub.getsockopt(zmq.LAST_ENDPOINT).decode(), ctx
    ctx.destroy(linger=0)
