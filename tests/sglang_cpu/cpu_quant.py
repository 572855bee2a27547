"""Test support: CPU stand-ins for the post-load step and the matmul of SGLang's INT8 and FP8 linear methods.

On a CPU without AMX, sglang 0.5.23's `W8A8Int8LinearMethod` and `Fp8LinearMethod` assert in their CPU
branches. To run our INT8 loader and the FP8 block refit through the real scheduler, only two methods are
replaced, when their module is first imported:
- `process_weights_after_loading`: exactly the CUDA branch's layout (INT8: the weight becomes
  `Parameter(weight.t())`, a [K, N] view of the [N, K] storage; FP8 block on Hopper without DeepGEMM:
  `weight` and `weight_scale_inv` keep their Parameters and storage), so our loader meets the storage it meets
  on a GPU;
- `apply`: dequantize the layer's own stored codes and scales and do a plain matmul in the activation dtype
  (weight-only: the activations are not quantized, unlike the GPU kernels).
Weight creation, checkpoint loading, the weight-update sessions and our in-place writes stay SGLang's and ours.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import torch

INT8_MODULE = "sglang.srt.layers.quantization.w8a8_int8"
FP8_MODULE = "sglang.srt.layers.quantization.fp8"


def int8_post_load(self, layer: torch.nn.Module) -> None:
    """The CUDA branch of W8A8Int8LinearMethod.process_weights_after_loading."""
    layer.weight = torch.nn.Parameter(layer.weight.t(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(layer.weight_scale.data, requires_grad=False)


def int8_apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (codes [K, N] * per-output-channel scale), from the layer's stored buffers."""
    w = layer.weight.to(torch.float32) * layer.weight_scale.to(torch.float32).view(1, -1)
    out = x.to(torch.float32) @ w
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def fp8_block_post_load(self, layer: torch.nn.Module) -> None:
    """The CUDA (SM90, no DeepGEMM) branch for block FP8: Parameters and storage are kept as loaded."""
    layer.weight.requires_grad_(False)
    layer.weight_scale_inv.requires_grad_(False)


def fp8_apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(codes [N, K], block scales [ceil(N/bn), ceil(K/bk)]).T, from the layer's stored buffers."""
    bn, bk = self.quant_config.weight_block_size
    n, k = layer.weight.shape
    scale = layer.weight_scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]
    w = layer.weight.to(torch.float32) * scale
    out = x.to(torch.float32) @ w.t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def patch_int8(module) -> None:
    method = module.W8A8Int8LinearMethod
    method.process_weights_after_loading, method.apply = int8_post_load, int8_apply


def patch_fp8(module) -> None:
    method = module.Fp8LinearMethod
    method.process_weights_after_loading_block_quant, method.apply = fp8_block_post_load, fp8_apply


PATCHES = {INT8_MODULE: patch_int8, FP8_MODULE: patch_fp8}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            spec.loader = _PatchingLoader(spec.loader, PATCHES[fullname])
        return spec


def install() -> None:
    """Patch the two modules when they are imported (or now, if they already are)."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def record_storage(model: torch.nn.Module, named_tensors) -> None:
    """A `--custom-weight-loader` for tests: write {buffer: data_ptr} of every quantized layer to a JSON file.

    Called with no tensors inside a weight-update session, it lets a test see from outside the scheduler that
    the refits wrote into the storage SGLang allocated at start.
    """
    import json
    import os

    out = {}
    for name, module in model.named_modules():
        if type(getattr(module, "quant_method", None)).__name__ in ("W8A8Int8LinearMethod", "Fp8LinearMethod"):
            for attr in ("weight", "weight_scale", "weight_scale_inv"):
                if hasattr(module, attr):
                    out[f"{name}.{attr}"] = getattr(module, attr).data_ptr()
    with open(os.environ["QURL_TEST_STORAGE_FILE"], "w") as f:
        json.dump(out, f)
