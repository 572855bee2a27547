"""The learner's policy: a Hugging Face causal LM in fp32, invariant-scaled once, sharded with FSDP2."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

from learner import attention, linear
from learner.fused import fuse
from qurl.hardware import native_bf16
from qurl.quant.invariant_scaling import apply_invariant_scaling

if TYPE_CHECKING:  # annotations only: the GPU check imports this without omegaconf
    from omegaconf import DictConfig

log = logging.getLogger("learner")


def invariant_scaling(cfg: DictConfig) -> tuple[float, tuple[str, ...]] | None:
    """(s, targets) when the rollout is quantized and s != 1, else None (scaling only helps the grid)."""
    s = float(cfg.quant.invariant_scaling.s)
    if cfg.rollout.quant == "none" or s == 1.0:
        return None
    return s, tuple(cfg.quant.invariant_scaling.targets)


def load_hf(path: str, device: torch.device) -> nn.Module:
    """The checkpoint at `path` in fp32 on `device`, without a KV cache (training never decodes). Without hub
    kernels: with the `kernels` package present transformers would kernelize at every train() / eval(), putting back
    each module's own forward over learner/fused.py's."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_kernels=False)
    model.config.use_cache = False
    return model.to(device)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """model.model.layers of a Llama / Qwen2 / Qwen3-style causal LM."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"model.path: {type(model).__name__} has no decoder layers at model.model.layers")
    return layers


def bf16_training(precision: str, device: torch.device) -> bool:
    """train.precision resolved: auto is bf16 exactly where bf16 is native, fp32 elsewhere."""
    if precision == "auto":
        return native_bf16(device)
    if precision == "bf16" and not native_bf16(device):
        log.warning("train.precision=bf16 on a CPU without native bf16 (AVX512-BF16 or AMX): ~8x slower than fp32")
    return precision == "bf16"


def shard(model: nn.Module, bf16: bool) -> nn.Module:
    """FSDP2: one unit per decoder layer, the root holding embeddings, final norm and lm_head. One rank keeps each
    layer's unsharded (bf16) parameters from forward to backward: resharding there frees nothing and costs a second
    unshard and cast per layer (SmolLM2 on one AMX Xeon thread: a 940-token step 4.0 s against 4.4-4.7 s)."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    reshard = not dist.is_initialized() or dist.get_world_size() > 1
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
    return model


def defer_gradient_sync(model: nn.Module, last: bool) -> bool:
    """Before a micro-batch's backward: on one rank, every micro-batch but a mini-batch's last keeps its layers'
    unsharded (bf16) parameters and adds its gradients, in fp32, to the unsharded ones, so that the next forward
    casts no weights again and only the last copies gradients out (SmolLM2 bucketed, 2 micro-batches, one thread:
    FSDP's copies 836 -> 443 ms, the step 1.023x). Several ranks reduce every micro-batch: unsharded gradients would
    cost a whole fp32 model each. True when this backward leaves gradients unsynced."""
    if not isinstance(model, FSDPModule) or dist.get_world_size() > 1:
        return False
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)
    return not last


def build_policy(cfg: DictConfig, device: torch.device, trainable: bool = True) -> nn.Module:
    """The trained policy (or, with trainable=False, the frozen KL reference): same scaling, same sharding."""
    model = load_hf(cfg.model.path, device)
    scaling = invariant_scaling(cfg)
    if scaling is not None:
        apply_invariant_scaling(model, *scaling)
    log.debug("fused CPU operators in %d modules", fuse(model))
    log.debug("compiled attention backward: %s", attention.install(model))
    log.debug("weight gradients laid out in %d linears", linear.install(model))
    if trainable and cfg.model.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return shard(model, bf16=bf16_training(cfg.train.precision, device))
