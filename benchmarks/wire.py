"""Wire benchmark: what qurl.wire.protocol costs over raw ZeroMQ on tcp loopback.

Rows: trajectory groups (8 samples x 256 tokens) per second, and weight-push MB/s for a ~156M
parameter Qwen2-shaped int8 state dict (hidden 1024, 8 layers, 16 heads / 4 kv heads,
intermediate 2816, vocab 32000, untied lm_head). Linear weights travel as int8 codes plus fp32
per-output-channel scales; embeddings and lm_head as bf16; norms and q/k/v biases as fp32.
Each protocol row runs encode + send + recv + decode with the receiver in another process; each
raw_zmq row sends the very same frames and only receives them. Medians over repeats.

    python benchmarks/wire.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np
import torch
import zmq
from common import emit, machine_info  # benchmarks/common.py

from qurl.wire import protocol, transport
from qurl.wire.frames import ReplayGuard, from_torch
from qurl.wire.protocol import Sample, TrajectoryGroup, WeightPush, WireTensor

SECRET = b"wire-benchmark-secret"
MAX_BYTES = 1 << 31
TORCH_THREADS = 1


def trajectory_group(rng: np.random.Generator, samples: int, tokens: int) -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_id=12345,
        group_id="server0-000042",
        server_id="server0",
        prompt_ids=rng.integers(0, 32000, 128, dtype=np.int32),
        samples=tuple(
            Sample(
                token_ids=rng.integers(0, 32000, tokens, dtype=np.int32),
                logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
                versions=np.full(tokens, 7, np.int32),
                reward=float(i % 2),
                finish_reason="stop",
                reward_details={"correct": bool(i % 2), "parsed": "42"},
            )
            for i in range(samples)
        ),
    )


def int8_state(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int) -> dict[str, WireTensor]:
    """Qwen2-shaped int8 push: random codes and scales, bf16 embeddings and lm_head."""
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    kv = hidden // heads * kv_heads
    out: dict[str, WireTensor] = {}

    def f32(*shape: int) -> WireTensor:
        return WireTensor(rng.standard_normal(shape, dtype=np.float32), "float32")

    def linear(name: str, n_out: int, n_in: int) -> None:
        out[f"{name}.weight"] = WireTensor(rng.integers(-127, 128, (n_out, n_in), np.int8), "int8")
        out[f"{name}.weight_scale"] = WireTensor(rng.random(n_out, np.float32) / 127, "float32")

    out["model.embed_tokens.weight"] = from_torch(torch.randn(vocab, hidden, generator=g).bfloat16())
    for i in range(layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = f32(hidden)
        for proj, n_out in (("q", hidden), ("k", kv), ("v", kv), ("o", hidden)):
            linear(f"{p}.self_attn.{proj}_proj", n_out, hidden)
            if proj != "o":
                out[f"{p}.self_attn.{proj}_proj.bias"] = f32(n_out)
        out[f"{p}.post_attention_layernorm.weight"] = f32(hidden)
        linear(f"{p}.mlp.gate_proj", inter, hidden)
        linear(f"{p}.mlp.up_proj", inter, hidden)
        linear(f"{p}.mlp.down_proj", hidden, inter)
    out["model.norm.weight"] = f32(hidden)
    out["lm_head.weight"] = from_torch(torch.randn(vocab, hidden, generator=g).bfloat16())
    return out


def _sink(data_ep: str, ctrl_ep: str) -> None:
    """Receiver process: per trial, take n messages (decoded or raw) and report back."""
    ctx = zmq.Context()
    data = transport.connect(ctx, zmq.PULL, data_ep, max_bytes=MAX_BYTES)
    ctrl = ctx.socket(zmq.PAIR)
    ctrl.connect(ctrl_ep)
    ctrl.send_json({"ready": True})
    while (spec := ctrl.recv_json())["mode"] != "stop":
        guard = ReplayGuard()
        secret = SECRET if spec["hmac"] else None
        for _ in range(spec["n"]):
            frames = data.recv_multipart(copy=False)
            if spec["mode"] == "protocol":
                protocol.decode(frames, secret=secret, max_bytes=MAX_BYTES, replay_guard=guard)
        ctrl.send_json({"done": spec["n"]})
    ctx.destroy(linger=0)


class Link:
    """A PUSH socket to a receiver process plus a control pair to time whole trials."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.data = transport.bind(self.ctx, zmq.PUSH, "tcp://127.0.0.1:*", secret=None, max_bytes=MAX_BYTES)
        self.ctrl = self.ctx.socket(zmq.PAIR)
        self.ctrl.setsockopt(zmq.LINGER, 0)
        self.ctrl.bind("tcp://127.0.0.1:*")
        self.proc = mp.get_context("spawn").Process(
            target=_sink,
            args=(self.data.last_endpoint.decode(), self.ctrl.last_endpoint.decode()),
            daemon=True,
        )
        self.proc.start()
        self.ctrl.recv_json()
        self.sender = transport.Sender(self.data, "bench")

    def trial(self, mode: str, msg: protocol.Message, n: int, hmac: bool) -> float:
        """Seconds to deliver n copies of msg: encoded afresh each time, or pre-encoded raw."""
        self.ctrl.send_json({"mode": mode, "n": n, "hmac": hmac})
        self.sender.secret = SECRET if hmac else None
        if mode == "raw_zmq":
            raw = protocol.encode(msg, sender="bench", session="raw", seq=0, secret=None)
        t0 = time.perf_counter()
        for _ in range(n):
            if mode == "protocol":
                self.sender.send(msg)
            else:
                self.data.send_multipart(raw, copy=False)
        self.ctrl.recv_json()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.ctrl.send_json({"mode": "stop"})
        self.proc.join(10)
        self.ctx.destroy(linger=0)


def _codec_us(msg: protocol.Message, hmac: bool, reps: int) -> tuple[float, float]:
    """Median in-process encode and decode microseconds, without sockets."""
    secret = SECRET if hmac else None
    enc, dec = [], []
    guard = ReplayGuard()
    for i in range(reps):
        t0 = time.perf_counter()
        frames = protocol.encode(msg, sender="b", session="s", seq=i, secret=secret)
        t1 = time.perf_counter()
        protocol.decode(frames, secret=secret, max_bytes=MAX_BYTES, replay_guard=guard)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return statistics.median(enc) * 1e6, statistics.median(dec) * 1e6


def message_bytes(msg: protocol.Message, hmac: bool) -> int:
    secret = SECRET if hmac else None
    frames = protocol.encode(msg, sender="bench", session="s", seq=0, secret=secret)
    return sum(memoryview(f).nbytes for f in frames)


def run(quick: bool) -> dict:
    torch.set_num_threads(TORCH_THREADS)
    rng = np.random.default_rng(0)
    if quick:
        n_msgs, traj_reps, push_reps = 50, 2, 2
        shape = dict(hidden=128, layers=2, heads=4, kv_heads=2, inter=352, vocab=1000)
    else:
        n_msgs, traj_reps, push_reps = 2000, 5, 5
        shape = dict(hidden=1024, layers=8, heads=16, kv_heads=4, inter=2816, vocab=32000)
    group = trajectory_group(rng, samples=8, tokens=256)
    state = int8_state(**shape)
    params = sum(t.data.size for t in state.values())
    push = WeightPush(version=1, scheme="int8", tensors=state)
    push_buckets = len(protocol.encode(push, sender="b", session="s", seq=0)) - 1
    rows = []
    link = Link()
    try:
        for mode, hmac in (("raw_zmq", False), ("protocol", False), ("protocol", True)):
            secs = [link.trial(mode, group, n_msgs, hmac) for _ in range(traj_reps)]
            nbytes = message_bytes(group, hmac)
            sec = statistics.median(secs)
            row = {
                "case": "trajectory",
                "path": mode,
                "hmac": hmac,
                "samples": 8,
                "tokens": 256,
                "bytes_per_msg": nbytes,
                "messages": n_msgs,
                "repeats": traj_reps,
                "seconds": sec,
                "msgs_per_s": n_msgs / sec,
                "mb_per_s": n_msgs * nbytes / sec / 1e6,
            }
            if mode == "protocol":
                row["encode_us"], row["decode_us"] = _codec_us(group, hmac, 200)
            rows.append(row)
        for mode, hmac in (("raw_zmq", False), ("protocol", False), ("protocol", True)):
            secs = [link.trial(mode, push, 1, hmac) for _ in range(push_reps)]
            nbytes = message_bytes(push, hmac)
            sec = statistics.median(secs)
            rows.append(
                {
                    "case": "weight_push",
                    "path": mode,
                    "hmac": hmac,
                    "model_params": params,
                    "embed_dtype": "bfloat16",
                    "linear_dtype": "int8",
                    "tensors": len(state),
                    "buckets": push_buckets,
                    "bytes": nbytes,
                    "repeats": push_reps,
                    "seconds": sec,
                    "mb_per_s": nbytes / sec / 1e6,
                }
            )
    finally:
        link.close()

    def pick(case: str, path: str, hmac: bool) -> dict:
        return next(r for r in rows if (r["case"], r["path"], r["hmac"]) == (case, path, hmac))

    ratios = {}
    for case, key in (("trajectory", "msgs_per_s"), ("weight_push", "mb_per_s")):
        raw = pick(case, "raw_zmq", False)[key]
        ratios[f"{case}_protocol_vs_raw"] = pick(case, "protocol", False)[key] / raw
        ratios[f"{case}_protocol_hmac_vs_raw"] = pick(case, "protocol", True)[key] / raw
    return {
        "benchmark": "wire",
        "machine": machine_info(pyzmq=zmq.__version__),
        "quick": quick,
        "rows": rows,
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for tests")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    result = run(args.quick)
    emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
