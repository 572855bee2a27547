"""Shared fixtures: the prepared CPU demo and the real track, built once and cached across test sessions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# overrides that put a config on SGLang replicas of an 8-GPU node: 4 learner ranks, 4 rollout GPUs, FP8
GPU_SGLANG = [
    "rollout.engine=sglang",
    "rollout.dtype=bfloat16",
    "cluster.learner_ranks=4",
    "cluster.learner_gpus=[4,5,6,7]",
    "cluster.rollout_gpus=[0,1,2,3]",
    "cluster.rollout_servers=4",
    "rollout.quant=fp8",
]
STEP = 3e-5  # trajectory's per-version weight move: a few percent of int8 codes change, as after a real optimizer step

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


@pytest.fixture(scope="session")
def model_dir(demo_dir) -> str:
    return str(Path(demo_dir) / "model")


def engine_state(model_dir: str) -> dict[str, torch.Tensor]:
    """The demo checkpoint's tensors that the engine loads (a tied lm_head left out), as fresh copies."""
    from transformers import AutoModelForCausalLM

    from rollout_server.engines import load_engine

    names = set(load_engine(model_dir, quant="int8", max_batch=1, max_seq_len=16).weights)
    return {
        k: v.detach().clone()
        for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()
        if k in names
    }


@pytest.fixture(scope="session")
def trajectory(model_dir):
    """scheme -> quantized engine tensors of versions 0..6, the weights moving by STEP per version."""
    from qurl.quant import quantize_state_dict

    state = engine_state(model_dir)
    gen = torch.Generator().manual_seed(0)
    states = []
    for _ in range(7):
        states.append({k: v.clone() for k, v in state.items()})
        for v in state.values():
            v.add_(STEP * torch.randn(v.shape, generator=gen))
    return {scheme: [quantize_state_dict(s, scheme) for s in states] for scheme in ("int8", "fp8-block")}


@pytest.fixture(scope="session")
def bf16_versions(model_dir):
    """int8 engine tensors of versions 0..6 as the learner builds them for a bf16 engine, weights moving by 1e-6
    per version with Adam's step shape (every element, by about the learning rate)."""
    from learner.weight_sync.tensors import engine_tensors

    state = engine_state(model_dir)
    gen = torch.Generator().manual_seed(1)
    versions = []
    for _ in range(7):
        versions.append(engine_tensors(dict(state), "int8", 8, torch.bfloat16, tied=False))
        for v in state.values():
            v.sub_(1e-6 * torch.sign(torch.randn(v.shape, generator=gen)))
    return versions


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
    """The learner's real weight sync (zmq transport on PUB) and real control plane (ROUTER) on loopback, HMAC key
    b"k": .sync, .plane, .pub (the PUB Sender, for other transports), .servers, .endpoint (PUB), .router, .ctx."""
    from types import SimpleNamespace

    import zmq

    from learner.budget import Budget
    from learner.control_plane import ControlPlane
    from learner.servers import ServerRegistry
    from learner.weight_sync import WeightSync, ZmqTransport
    from qurl.wire import transport

    ctx = zmq.Context()
    pub_sock = transport.bind(ctx, zmq.PUB, "tcp://127.0.0.1:*", secret=b"k", max_bytes=1 << 20, hwm=4)
    router = transport.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", secret=b"k", max_bytes=1 << 20)
    pub = transport.Sender(pub_sock, "learner", secret=b"k")
    servers = ServerRegistry()
    sync = WeightSync(ZmqTransport(pub), servers, "fp8-block")
    plane = ControlPlane(
        transport.Receiver(router, secret=b"k", max_bytes=1 << 20, kinds=("status",)),
        transport.Sender(router, "learner", secret=b"k"),
        Budget(0, 1, lambda version: (0, 0, {})),
        servers,
        sync,
    )
    yield SimpleNamespace(
        sync=sync,
        plane=plane,
        pub=pub,
        servers=servers,
        endpoint=pub_sock.getsockopt(zmq.LAST_ENDPOINT).decode(),
        router=router.getsockopt(zmq.LAST_ENDPOINT).decode(),
        ctx=ctx,
    )
    plane.close()
    ctx.destroy(linger=0)
