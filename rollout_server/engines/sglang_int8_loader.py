"""SGLang `--custom-weight-loader` for in-place INT8 (w8a8_int8) refits. Supports sglang 0.5.23 only (CUDA).

Why it exists: after w8a8_int8's first load SGLang replaces each linear's int8 weight by a transposed Parameter
([K, N] view of the [N, K] storage) without a weight_loader, so `model.load_weights` cannot refit it, and
`end_weight_update` re-runs `process_weights_after_loading`, which transposes it back. This loader
  1. pins that post-processing: a layer already in the [K, N] kernel layout is left as it is, so the re-run
     inside end_weight_update changes nothing (storage, layout and CUDA-graph addresses stay);
  2. writes HF-named int8 codes and `X.weight_scale` (or bf16/fp32 weights, quantized here with
     qurl.quant.quantize_int8 over the full row before TP sharding) into the existing storage, through the
     layer's own SGLang weight_loader applied to an [N, K] view, which does the q/k/v and gate/up fusion and the
     TP slicing exactly as a checkpoint load would;
  3. hands every other tensor (embeddings, norms, biases, lm_head) to `model.load_weights`.
SGLang calls it as `loader(model, named_tensors)` from update_weights_from_tensor when load_format is this
function's dotted path and the engine was started with --custom-weight-loader naming it. The distributed
(NCCL) update path of 0.5.23 never calls a custom loader: INT8 refits must use update_weights_from_tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from qurl.quant import INT8, is_quantized_linear, quantize_int8

SUPPORTED_SGLANG = "0.5.23"
LOADER_PATH = "rollout_server.engines.sglang_int8_loader.load_int8_weights"
SCALE = INT8.scale_suffix
# HF projection -> (SGLang's fused module, shard id), as SGLang's Llama / Qwen2 / Qwen3 models name them
FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_int8_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Entry point: write INT8 linears in place, pass everything else to model.load_weights."""
    _check_version()
    pin_kernel_layout(model)
    linears, rest = split(named_tensors)
    for name, (codes, scale) in linears.items():
        module, shard = target(model, name)
        write_linear(module, shard, codes, scale)
    if rest:
        model.load_weights(rest)


def _check_version() -> None:
    import sglang

    if sglang.__version__ != SUPPORTED_SGLANG:
        raise RuntimeError(f"{LOADER_PATH} supports sglang {SUPPORTED_SGLANG} only, found {sglang.__version__}")


def split(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """({hf weight name: (int8 codes [N, K], fp32 scale [N, 1])}, the other tensors); bf16 weights quantized here."""
    named = list(named_tensors)
    by_name = dict(named)
    linears: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    rest: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        if name.endswith(SCALE) and is_quantized_linear(name[: -len(SCALE)]):
            if name[: -len(SCALE)] not in by_name:
                raise ValueError(f"{name}: scale without its weight in the same update call")
            continue
        if not is_quantized_linear(name):
            rest.append((name, t))
            continue
        scale = by_name.get(name + SCALE)
        if t.dtype == INT8.code_dtype:
            if scale is None:
                raise ValueError(f"{name}: int8 codes need {name + SCALE} in the same update call")
            if scale.shape != (t.shape[0], 1):
                raise ValueError(f"{name + SCALE}: need shape {(t.shape[0], 1)}, got {tuple(scale.shape)}")
            linears[name] = (t, scale.float())
        elif t.is_floating_point():
            if scale is not None:
                raise ValueError(f"{name}: a {t.dtype} weight comes without a scale; {name + SCALE} is computed here")
            linears[name] = quantize_int8(t, dim=-1)
        else:
            raise ValueError(f"{name}: need int8 codes or a floating-point weight, got {t.dtype}")
    return linears, rest


def target(model: torch.nn.Module, hf_name: str) -> tuple[torch.nn.Module, str | int | None]:
    """The SGLang module holding HF weight `hf_name` and its shard id in a fused layer (None when not fused)."""
    path = hf_name[: -len(".weight")]
    parent, _, proj = path.rpartition(".")
    if proj in FUSED:
        fused, shard = FUSED[proj]
        try:
            return model.get_submodule(f"{parent}.{fused}"), shard
        except AttributeError:
            pass
    try:
        return model.get_submodule(path), None
    except AttributeError:
        raise ValueError(f"{hf_name}: the model has no module {path!r} (nor a fused one)") from None


def is_kernel_layout(layer: torch.nn.Module) -> bool:
    """True when the int8 weight is w8a8_int8's CUDA layout: a [K, N] column-major view of [N, K] storage."""
    w, n = layer.weight, layer.weight_scale.shape[0]
    return w.dim() == 2 and w.shape[1] == n and w.stride() == (1, w.shape[0])


def pin_kernel_layout(model: torch.nn.Module) -> int:
    """Make every w8a8_int8 layer's post-processing a no-op once its weight is in kernel layout; return how many."""
    pinned = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ != "W8A8Int8LinearMethod" or getattr(method, "_qurl_pinned", False):
            continue
        original = method.process_weights_after_loading

        def process(layer: torch.nn.Module, _original=original) -> None:
            if not is_kernel_layout(layer):
                _original(layer)

        method.process_weights_after_loading = process
        method._qurl_pinned = True
        pinned += 1
    return pinned


def write_linear(module: torch.nn.Module, shard: str | int | None, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Copy full (unsharded) codes [N, K] and scales [N, 1] into this rank's slice of the layer's existing storage."""
    if type(getattr(module, "quant_method", None)).__name__ != "W8A8Int8LinearMethod":
        raise ValueError(f"{type(module).__name__} is not a w8a8_int8 layer; start SGLang with quantization=w8a8_int8")
    if not is_kernel_layout(module):
        raise RuntimeError(
            f"int8 weight {tuple(module.weight.shape)} stride {module.weight.stride()} is not "
            f"w8a8_int8's CUDA layout; this loader supports sglang {SUPPORTED_SGLANG} on CUDA"
        )
    storage = module.weight.data_ptr(), module.weight_scale.data_ptr()
    weight = torch.nn.Parameter(module.weight.t(), requires_grad=False)  # [N, K] view of the same storage
    weight.output_dim, weight.input_dim = 0, 1
    weight_scale = torch.nn.Parameter(module.weight_scale.data, requires_grad=False)
    weight_scale.output_dim = 0
    with torch.no_grad():
        for param, value in ((weight, codes), (weight_scale, scale)):
            if shard is None:
                module.weight_loader(param, value)
            else:
                module.weight_loader(param, value, shard)
    if (module.weight.data_ptr(), module.weight_scale.data_ptr()) != storage:
        raise RuntimeError("int8 refit moved the layer's storage; refusing to continue")
