"""SGLang `--custom-weight-loader` for FP8 block refits: SGLang's own load, after a check of the scale layout.

A block-FP8 refit writes `X.weight` (e4m3) and `X.weight_scale_inv` (fp32, one per 128 x 128 block) through
`model.load_weights`, which is only sound while SGLang keeps that layout after its start-up post-processing.
It does on Hopper (SM90) without DeepGEMM's UE8M0 path; on Blackwell DeepGEMM requantizes the scales and on
SM80-89 Marlin repacks the weight and deletes `weight_scale_inv`, so a refit would load wrong values silently.
The adapter refuses those GPUs before start (sglang_args.fp8_refit_problem); this loader checks every layer
on every load, so a layout SGLang changed anyway stops the refit instead of corrupting it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from qurl.quant import FP8_BLOCK

LOADER_PATH = "rollout_server.engines.sglang_fp8_loader.load_fp8_weights"
SCALE = "weight" + FP8_BLOCK.scale_suffix  # SGLang's block-scale attribute, named as the pushes name it


def load_fp8_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Entry point: check every block-FP8 layer's storage, then SGLang's own model.load_weights."""
    problem = scale_layout_problem(model)
    if problem:
        raise RuntimeError(f"FP8 block refit refused: {problem}")
    model.load_weights(list(named_tensors))


def scale_layout_problem(model: torch.nn.Module) -> str | None:
    """The first block-FP8 layer whose weight is not e4m3 [N, K] or whose scale is not fp32 [ceil(N/bn), ceil(K/bk)]."""
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ != "Fp8LinearMethod" or not getattr(method, "block_quant", False):
            continue
        bn, bk = method.quant_config.weight_block_size
        weight, scale = module.weight, getattr(module, SCALE, None)
        if weight.dtype != FP8_BLOCK.code_dtype or weight.dim() != 2:
            return f"{name}.weight is {weight.dtype} {tuple(weight.shape)}, not {FP8_BLOCK.code_dtype} [N, K]"
        n, k = weight.shape
        want = (-(-n // bn), -(-k // bk))
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != want:
            got = "absent" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
            return (
                f"{name}.{SCALE} is {got} after SGLang's post-processing, not torch.float32 {want} "
                "(a DeepGEMM UE8M0 or Marlin repack)"
            )
    return None
