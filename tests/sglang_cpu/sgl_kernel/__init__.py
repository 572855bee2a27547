"""Test support: a CPU stand-in for the `sgl_kernel` package, so the real sglang 0.5.23 engine runs on this CPU.

The registry's sglang-kernel wheel is a CUDA build that fails to load without libcuda. With
SGLANG_USE_CPU_ENGINE=1, SGLang imports these names from `sgl_kernel` at module import; on the dense
Llama / Qwen2 path only `assign_req_to_token_pool_cpu` can be called (mem_cache/allocation.py), and every
other layer takes SGLang's own pure-torch path. Each other name raises if it is ever called, so a path this
stand-in does not cover fails loudly instead of computing something wrong. Never on a product path: it is
put on PYTHONPATH only by `make test-sglang` (tests/sglang_cpu/).
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[r, start_r:end_r] = the next end_r - start_r entries of out_cache_loc, request by request."""
    pos = 0
    for r, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: span {start}:{end} outside a pool row of {pool_len}")
        req_to_token[r, start:end] = out_cache_loc[pos : pos + end - start]
        pos += end - start


def _absent(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in the CPU test stand-in (tests/sglang_cpu); "
            "this SGLang path needs the real CUDA kernels"
        )

    call.__name__ = name
    return call


# imported by SGLang at module import when SGLANG_USE_CPU_ENGINE=1, never called on the dense decoder path
for _name in (
    "copy_all_layer_kv_cache_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
):
    globals()[_name] = _absent(_name)
del _name
