"""What an sglang.Engine is started with: this replica's GPUs, SGLang's server arguments for a scheme and dtype,
and the checks that refuse a combination SGLang would run wrongly (design.md section 4, docs/sglang.md)."""

from __future__ import annotations

import json
import os
from typing import Any

from qurl.quant import FP8_BLOCK, INT8
from qurl.wire import sglang_payload as payload
from rollout_server.engines.sglang_fp8_loader import LOADER_PATH as FP8_LOADER_PATH
from rollout_server.engines.sglang_int8_loader import LOADER_PATH

FP8_BLOCK_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [FP8_BLOCK.block, FP8_BLOCK.block],
}
DTYPES = ("float32", "bfloat16")
# SGLang's CPU engine: max_total_tokens sizes the KV cache, this only bounds it. SGLang refuses to start when the
# host's free memory falls by more than (1 - fraction) while the weights load, which other processes on a shared
# machine can cause (0.05 failed one CI start that way), so leave it wide.
CPU_MEM_FRACTION = 0.8


def replica_gpus(rollout_gpus: list[int], tp_size: int, replica: int) -> list[int]:
    """GPUs of rollout replica `replica`: the replica-th group of tp_size from cluster.rollout_gpus."""
    group = list(rollout_gpus)[replica * tp_size : (replica + 1) * tp_size]
    if replica < 0 or len(group) != tp_size:
        raise ValueError(
            f"cluster.rollout_gpus={list(rollout_gpus)} has no {tp_size} GPUs for rollout replica {replica} "
            f"(rollout.tp_size={tp_size})"
        )
    return group


def placement(cfg: Any, replica: int) -> dict[str, Any]:
    """load_engine's SGLang keywords for replica `replica`: its rollout.tp_size GPUs of cluster.rollout_gpus."""
    from qurl.config import get

    tp, gpus = get(cfg, "rollout.tp_size"), list(get(cfg, "cluster.rollout_gpus"))
    return {
        "tp_size": tp,
        "gpus": replica_gpus(gpus, tp, replica) if gpus else None,
        "mem_fraction": get(cfg, "rollout.mem_fraction"),
        "seed": get(cfg, "run.seed"),
        "server_args": dict(get(cfg, "rollout.server_args")),
    }


def engine_args(
    model_path: str,
    *,
    scheme: str,
    dtype: str,
    tp_size: int,
    gpus: list[int] | None,
    max_batch: int,
    max_seq_len: int,
    seed: int = 0,
    mem_fraction: float | None = None,
    server_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """sglang.Engine / ServerArgs keyword arguments for one replica: dp 1, token ids in and out, version "0".

    gpus None: SGLang's CPU engine (tests and CPU rehearsals; needs SGLANG_USE_CPU_ENGINE=1), torch-native
    attention, no CUDA graphs, a KV cache of max_batch * max_seq_len tokens.
    """
    payload.check_scheme(scheme)
    if dtype not in DTYPES:
        raise ValueError(f"rollout.dtype={dtype!r} is not allowed; choose one of: {', '.join(DTYPES)}")
    if scheme != "none" and dtype != "bfloat16":
        raise ValueError(
            f"rollout.dtype={dtype} with a {scheme} SGLang engine: SGLang's quantized linear methods "
            "take bfloat16 activations only; set rollout.dtype=bfloat16"
        )
    server_args = dict(server_args or {})
    check_server_args(server_args)
    args: dict[str, Any] = dict(
        model_path=model_path,
        tp_size=tp_size,
        dp_size=1,
        skip_tokenizer_init=True,
        dtype=dtype,
        context_length=max_seq_len,
        max_running_requests=max_batch,
        random_seed=seed,
        weight_version="0",
        log_level="error",
    )
    if gpus is None:
        if tp_size != 1:
            raise ValueError(f"rollout.tp_size={tp_size}: SGLang's CPU engine runs one rank here; use tp_size 1")
        args.update(
            device="cpu",
            attention_backend="torch_native",
            disable_cuda_graph=True,
            max_total_tokens=max_batch * max_seq_len,
            mem_fraction_static=CPU_MEM_FRACTION,
        )
    else:
        if len(gpus) != tp_size:
            raise ValueError(f"need {tp_size} GPUs for tp_size={tp_size}, got {gpus}")
        step = gpus[1] - gpus[0] if len(gpus) > 1 else 1
        if step < 1 or list(gpus) != [gpus[0] + i * step for i in range(len(gpus))]:
            raise ValueError(
                "a replica's GPUs must be evenly spaced and increasing (SGLang's base_gpu_id + "
                f"gpu_id_step), got {gpus}"
            )
        args.update(base_gpu_id=gpus[0], gpu_id_step=step, device="cuda")
    overrides = json.loads(server_args.pop("json_model_override_args", None) or "{}")
    loaders = list(server_args.pop("custom_weight_loader", None) or [])  # merged: ours come first
    if scheme == INT8.name:
        args.update(quantization="w8a8_int8", load_format="dummy")
        loaders.insert(0, LOADER_PATH)
    elif scheme == FP8_BLOCK.name:
        args.update(quantization="fp8", load_format="dummy")
        loaders.insert(0, FP8_LOADER_PATH)
        overrides["quantization_config"] = FP8_BLOCK_CONFIG  # merged: a user's other overrides stay
    if loaders:
        args["custom_weight_loader"] = loaders
    if overrides:
        args["json_model_override_args"] = json.dumps(overrides)
    if mem_fraction is not None:
        args["mem_fraction_static"] = mem_fraction
    args.update(server_args)  # any other ServerArgs field, e.g. cuda_graph_max_bs_decode
    return args


def check_server_args(server_args: dict[str, Any]) -> None:
    """Refuse settings under which SGLang's logprobs stop being log_softmax(logits / T), the learner's definition."""
    if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
        raise ValueError(
            "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return T=1 logprobs while the learner "
            "uses log_softmax(logits / T); unset it"
        )
    if server_args.get("rl_on_policy_target"):
        raise ValueError(
            "server_args rl_on_policy_target switches SGLang's logprobs to T=1 while the "
            "learner uses log_softmax(logits / T); remove it"
        )
    if server_args.get("json_model_override_args") is not None:
        try:
            parsed = json.loads(server_args["json_model_override_args"])
        except (TypeError, ValueError):
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError(
                "server_args json_model_override_args must be a JSON object, got "
                f"{server_args['json_model_override_args']!r}"
            )


def fp8_refit_problem(capability: tuple[int, int]) -> str | None:
    """Why FP8 block refits are unsound on a GPU of this compute capability, or None on Hopper (SM90)."""
    if capability[0] == 9:
        return None
    how = (
        "DeepGEMM requantizes the block scales to UE8M0"
        if capability[0] >= 10
        else "Marlin repacks the FP8 weight and deletes weight_scale_inv"
    )
    return (
        f"rollout.quant=fp8 with rollout.engine=sglang needs a Hopper (SM90) GPU, found SM{capability[0]}"
        f"{capability[1]}: {how} at start, so an in-place refit would load wrong values; use rollout.quant=int8"
    )
