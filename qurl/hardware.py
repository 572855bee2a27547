"""What the device under a process runs natively; torch only, so that the GPU check imports it without the config."""

from __future__ import annotations

import torch


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run in hardware here: on AVX2-only CPUs they are emulated, ~8x slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
