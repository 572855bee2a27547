"""The publisher (design.md §3, step 4): what the rollout engine loads, quantized on rank 0, pushed over the
transport `sync.transport` names (learner/push_transport.py), with the push's `sync/*` metrics."""

from __future__ import annotations

import time

import torch

from learner.weight_sender import WeightSender
from qurl.quant import quantize_state_dict


def engine_tensors(
    state: dict[str, torch.Tensor], scheme: str, weight_bits: int, engine_dtype: torch.dtype, tied: bool
) -> dict[str, torch.Tensor]:
    """What the rollout engine loads: tied lm_head dropped, linears quantized, the rest in the engine's dtype.

    The engine's dtype is also what a delta push diffs and checksums for the unquantized tensors (qurl/delta.py).
    """
    if tied:
        state.pop("lm_head.weight", None)
    out = quantize_state_dict(state, scheme, weight_bits)
    # passed-through tensors may share storage with the live parameters (one rank): copy them, so that a
    # later re-push of this version sends this version
    return {k: v.to(engine_dtype, copy=True) if v is state.get(k) else v for k, v in out.items()}


class Publisher:
    """Rank 0: turns the gathered full weights into the engine's tensors and pushes them as one version."""

    def __init__(
        self, sender: WeightSender, pusher, scheme: str, weight_bits: int, engine_dtype: torch.dtype, tied: bool
    ) -> None:
        self.sender, self.pusher, self.scheme = sender, pusher, scheme
        self.weight_bits, self.engine_dtype, self.tied = weight_bits, engine_dtype, tied

    def push(self, state: dict[str, torch.Tensor], version: int, publish: bool, gathered_s: float) -> dict:
        """Quantize and publish `state` as `version` (publish=False: only remember the codes); `gathered_s`, the
        time it took to gather the weights, counts towards sync/seconds."""
        started = time.perf_counter() - gathered_s
        tensors = engine_tensors(state, self.scheme, self.weight_bits, self.engine_dtype, self.tied)
        if not publish:
            self.sender.set_baseline(tensors)
            return {}
        stats = self.pusher.publish(version, tensors)
        if stats is None:  # cuda-ipc: a server still reads the buffers this push would overwrite; the next one tries
            return {
                "sync/seconds": time.perf_counter() - started,
                "sync/bytes": 0,
                "sync/changed_frac": 0.0,
                "sync/full_bytes": 0,
                "sync/delta": 0,
                "sync/skipped": 1,
            }
        return {
            "sync/seconds": time.perf_counter() - started,
            "sync/bytes": stats.bytes,
            "sync/changed_frac": stats.changed_frac,
            "sync/full_bytes": stats.full_bytes,
            "sync/delta": int(stats.mode == "delta"),
        }
