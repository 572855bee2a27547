"""The wire format stays byte-identical: one instance of every message kind against digests of its frames.

The digests were taken from the encoder as it stood before the protocol was restructured (issue 19); a change
here is a change of the wire format and needs SCHEMA_VERSION and design.md section 5 to say so.
"""

import hashlib
import struct

import numpy as np
import pytest

from qurl.protocol import Sample, Status, TrajectoryGroup, WeightPush, WeightRef, WireTensor, decode, encode

SECRET = b"golden-secret"


def _group() -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_id="p-17",
        group_id="srv-a-3",
        server_id="srv-a",
        prompt_ids=np.arange(5, 11, dtype=np.int64),
        samples=(
            Sample(
                token_ids=np.array([3, 1, 4, 1]),
                logprobs=np.array([-0.25, -1.5, 0.0, -3.0]),
                versions=np.array([2, 2, 3, 3]),
                reward=1.0,
                finish_reason="stop",
                reward_details={"correct": True, "parsed": ["4", 2], "err": None},
            ),
            Sample(token_ids=[9], logprobs=[-0.125], versions=[3], reward=0, finish_reason="length"),
        ),
    )


def _full_push() -> WeightPush:
    return WeightPush(
        version=4,
        scheme="int8",
        bucket_bytes=96,
        checksum="crc32:0badf00d",
        tensors={
            "embed.weight": WireTensor(np.arange(12, dtype=np.uint16).reshape(3, 4) * 257, "bfloat16"),
            "q.weight": WireTensor(np.arange(-8, 8, dtype=np.int8).reshape(4, 4), "int8"),
            "q.weight_scale": WireTensor(np.linspace(0.5, 2.0, 4, dtype=np.float32).reshape(4, 1), "float32"),
            "fp8.weight": WireTensor(np.arange(200, dtype=np.uint8).reshape(10, 20), "float8_e4m3fn"),
            "half": WireTensor(np.array([1.5, -2.0, 0.25], dtype=np.float16), "float16"),
            "count": WireTensor(np.array(7, dtype=np.int32), "int32"),
            "big": WireTensor(np.arange(5, dtype=np.int64), "int64"),
            "empty": WireTensor(np.zeros((0, 4), dtype=np.float32), "float32"),
        },
    )


def _delta_push() -> WeightPush:
    return WeightPush(
        version=5,
        scheme="fp8-block",
        mode="delta",
        checksum="crc32:12345678",
        tensors={
            "norm.weight": WireTensor(np.ones(4, dtype=np.float32), "float32"),
            "a.weight@idx": WireTensor(np.array([0, 3, 9], dtype=np.int32), "int32"),
            "a.weight@val": WireTensor(np.array([1, 2, 3], dtype=np.uint8), "float8_e4m3fn"),
            "a.weight_scale_inv@mask": WireTensor(np.array([0b101, 0b1], dtype=np.uint8), "uint8"),
            "a.weight_scale_inv@val": WireTensor(np.array([0.5, 0.75, 1.0], dtype=np.float32), "float32"),
        },
    )


def _status(kind: str) -> Status:
    return Status(
        type=kind,
        server_id="srv-a",
        version=6,
        engine="torch",
        quant="int8",
        running=2,
        queued=5,
        counters={"sent": 10, "tokens_per_s": 123.5},
        budget=8 if kind == "reply" else None,
    )


def _ipc_ref() -> WeightRef:
    meta = (["a.weight", "a.weight_scale_inv"], ["float8_e4m3fn", "float32"], [[256, 128], [2, 1]])
    return WeightRef(
        version=7,
        scheme="fp8-block",
        transport="cuda-ipc",
        buckets=[meta, (["b"], ["bfloat16"], [(3,)])],
        payloads=[[b"rank0-b0", b"rank1-b0"], [b"rank0-b1", b"rank1-b1!"]],
    )


def _nccl_ref() -> WeightRef:
    return WeightRef(version=8, scheme="none", transport="nccl", buckets=[(["w"], ["bfloat16"], [(4, 4)])])


MESSAGES = {
    "trajectory_group": _group,
    "weight_push_full": _full_push,
    "weight_push_delta": _delta_push,
    "status_hello": lambda: Status(type="hello", server_id="srv-b", version=0),
    "status_reply": lambda: _status("reply"),
    "status_eval_result": lambda: Status(
        type="eval_result", server_id="srv-a", version=3, counters={"acc": 0.5, "problems": 4, "k": 2}
    ),
    "weight_ref_cuda_ipc": _ipc_ref,
    "weight_ref_nccl": _nccl_ref,
}

# sha256 over every frame as an 8-byte little-endian length and its bytes: (without a secret, with SECRET)
GOLDEN = {
    "trajectory_group": (
        "392b9ba6d3a126855d9c328d4268a0865eb470c9e5e4cec3fc977320500d0ef2",
        "bda6d8439b44a1013b8bbb999c9a204d03d821751cd240c44beec1a4f70a0931",
    ),
    "weight_push_full": (
        "157253e56a8d484ce1b8ada9c8c33d9b2bdeb95247c183654c80fd63f38ad87b",
        "710da3aee102dba4ed4603d1707c48ca330fe06aa21ae7a9579aaf432acaef57",
    ),
    "weight_push_delta": (
        "3f8f40952f84c1a27629fa0827592682d0d8e5dc7e777328e5eeaae7b5aa9f92",
        "987eead94025538668d9c487f69feea3f63ec1bbe561f9e2c522a9ae52a5fa3a",
    ),
    "status_hello": (
        "c9c150c3c1f7826bd1ea84260f2772fef0a78bd3148a700f7fcbbfdb6b2e01bb",
        "c9c7d6fc130eb141f2deab69c0d053340cdbd4895dec931aaf16472952992fbb",
    ),
    "status_reply": (
        "aab37f7411719ce5b0c81a57d61a76bd1920649621112a4d710a85a59d48fecf",
        "d78aed4299c36104a671a221a9a11edb8abbfb2dfa417a2c57e0bf1ff556b632",
    ),
    "status_eval_result": (
        "4585ae594ac3a1e673724a69172500d2847cf9e6fee3e3690777a1a1c03e9a84",
        "8e74f7d1bb8f2ab16fb47fb6365dc262cd60f45b1af36dab8496c3ae02754026",
    ),
    "weight_ref_cuda_ipc": (
        "e03b27fecb0e48cc4720d932319c207490bc58bc3307455a5e904e1333d72a5f",
        "e8dd9663871243c58a051a14a402aa8fe1a6a4e8e5d10e33d5183142cb16ece2",
    ),
    "weight_ref_nccl": (
        "4c1df869a32e540979492ecdb45998207334a5602dd9563c290087934b923abe",
        "ff3d9cfc09914c5270bd698916710ea4fdaa2e961a51731f620c2e2189d03dba",
    ),
}


def _digest(frames: list) -> str:
    h = hashlib.sha256()
    for f in frames:
        b = bytes(memoryview(f).cast("B"))
        h.update(struct.pack("<Q", len(b)) + b)
    return h.hexdigest()


def _frames(name: str, secret: bytes | None) -> list:
    return encode(MESSAGES[name](), sender="golden", session="s-0001", seq=41, secret=secret)


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_encoding_matches_the_golden_bytes(name):
    plain, signed = GOLDEN[name]
    assert _digest(_frames(name, None)) == plain, bytes(_frames(name, None)[0]).decode()
    assert _digest(_frames(name, SECRET)) == signed


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_decoding_the_golden_bytes_encodes_them_again(name):
    for secret in (None, SECRET):
        frames = [bytes(memoryview(f).cast("B")) for f in _frames(name, secret)]
        msg = decode(frames, secret=secret, max_bytes=1 << 20)
        again = encode(msg, sender="golden", session="s-0001", seq=41, secret=secret)
        assert [bytes(memoryview(f).cast("B")) for f in again] == frames
