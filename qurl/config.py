"""Structured config (design.md §7): one schema, YAML files, `key=value` overrides, strict checks."""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from qurl.corrections.spec import LossSpec
from qurl.rewards import BUILTIN


class ConfigError(ValueError):
    """A config problem, phrased as one line naming the key and what is allowed."""


@dataclass
class RunConfig:
    name: str = "qurl"
    dir: str = ""  # empty: runs/<name>
    resume: bool = False
    max_restarts: int = 3
    # a rollout server alive but silent this long (no heartbeat: stopped, deadlocked in a kernel, stuck in a
    # collective) is killed and restarted as a crashed one is, within run.max_restarts; 0: never
    server_silence_s: float = 300.0
    seed: int = 0


@dataclass
class ModelConfig:
    path: str = ""  # a Hugging Face folder (config.json + safetensors + tokenizer)
    gradient_checkpointing: bool = False


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    max_prompt_len: int = 1024
    instruction: str = ""  # appended to the last user message, e.g. the \boxed{} instruction
    shuffle: bool = True


@dataclass
class RewardConfig:
    name: str = "math"  # a built-in (qurl.rewards.BUILTIN: math, dapo, gsm8k, arith, gym) or package.module:function
    timeout_s: float = 10.0
    workers: int = 2
    # the run stops (exit 2) when more than this share of the last 256 scores failed (the function raised, timed
    # out or returned NaN / a non-number); 1: never
    max_error_frac: float = 0.5


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024


@dataclass
class RolloutConfig:
    engine: str = "torch"  # torch | sglang
    quant: str = "int8"  # none | int8 | fp8
    dtype: str = "float32"  # float32 | bfloat16 for the full-precision parts | auto: bfloat16 where native
    device: str = "cpu"
    max_batch: int = 64
    max_seq_len: int = 2048
    n_samples: int = 8
    tp_size: int = 1
    mem_fraction: float | None = None  # sglang: share of GPU memory for weights + KV cache; null: SGLang's default
    server_args: dict[str, Any] = field(default_factory=dict)  # sglang: any other ServerArgs field
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class OverlongConfig:
    enable: bool = False
    buffer: int = 0  # tokens before max_new_tokens where the linear penalty starts
    factor: float = 1.0


@dataclass
class AlgoConfig:
    # the objective (LossSpec: its defaults, choices and checks; docs/algorithms.md has every piece and preset)
    loss: str = LossSpec.mode  # preset: ppo | decoupled | tis | acr | icepop | geo-rs | seq-mis | gspo | cispo
    weight: str | None = LossSpec.weight  # null: the preset's; a name from qurl/corrections/weights.py
    mask: str | None = LossSpec.mask  # null: the preset's; none | token | sequence | geometric | veto
    clip: str | None = LossSpec.clip  # null: the preset's; ppo | acr
    eps_low: float = LossSpec.eps_low
    eps_high: float = LossSpec.eps_high
    tis_cap: float = LossSpec.tis_cap
    dual_clip: float | None = LossSpec.dual_clip
    loss_agg: str = LossSpec.agg
    token_mask_low: float = LossSpec.token_mask_low
    token_mask_high: float = LossSpec.token_mask_high
    seq_mask_low: float = LossSpec.seq_mask_low
    seq_mask_high: float = LossSpec.seq_mask_high
    geo_mask_low: float = LossSpec.geo_mask_low
    geo_mask_high: float = LossSpec.geo_mask_high
    veto_floor: float = LossSpec.veto_floor
    gspo_eps_low: float = LossSpec.gspo_eps_low
    gspo_eps_high: float = LossSpec.gspo_eps_high
    cispo_max_ratio: float = LossSpec.cispo_max_ratio
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    advantage: str = "grpo"  # grpo | drgrpo | rloo
    dynamic_sampling: bool = False
    drift_kl_threshold: float = 0.05  # first batch's mismatch/kl_k3 above this: warn (wrong model, tokenizer or push)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass
class MismatchConfig:
    # the alarm on the behaviour/proximal gap (learner/mismatch_alarm.py); INT8 W8A8 on SmolLM2-135M runs at ~0.03
    max_kl: float = 0.1  # ceiling on the smoothed mismatch/kl_k3; 0: no alarm
    alarm_steps: int = 3  # steps in a row above it before it fires
    smoothing: float = 0.5  # weight of the newest step in the moving average
    stop: bool = False  # true: checkpoint and stop the run (exit 3) when it fires; false: warn


@dataclass
class InvariantScalingConfig:
    s: float = 1.0  # 1.0 disables it; the paper uses 1.5
    targets: list[str] = field(default_factory=lambda: ["qkv"])


@dataclass
class QuantConfig:
    invariant_scaling: InvariantScalingConfig = field(default_factory=InvariantScalingConfig)
    fp8_granularity: str = "block"  # block (128x128, SGLang's layout) | channel
    weight_bits: int = 8  # experimental: 4..7 puts int8 rollout weights on a coarser grid to stress mismatch
    # logits from an int8 copy of the lm_head; null: on for the torch engine's int8 rollout (RESULTS §13: its added
    # mismatch is within 1.5x of the int8 body's own, and it is most of the decode speed-up over bf16)
    lm_head: bool | None = None


@dataclass
class TrainConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    batch_prompts: int = 32
    mini_batches: int = 1
    steps: int = 100
    grad_clip: float = 1.0
    # steps in a row whose every update is skipped for a non-finite loss or grad norm before the run stops (exit 3,
    # one line naming train.lr): resuming would repeat it. 0: never stop for it
    max_skipped_steps: int = 5
    precision: str = "fp32"  # fp32 | bf16 (FSDP2 mixed precision, fp32 master weights) | auto: bf16 where native
    # bucketed: rows sorted by length, cut to least padding | padded: rows in order | packed: one row per group, its
    # prompt once (learner/packing.py; short answers)
    micro_batches: str = "bucketed"
    # padded tokens per forward (a longer row gets a micro-batch of its own); bounds activation memory, never the
    # result. Per GPU at 7B, 4 FSDP2 ranks, checkpointed layers: 16384 on 80 GB and up, 8192 on 40-48 GB (README)
    micro_batch_tokens: int = 16384


@dataclass
class AsyncConfig:
    max_staleness: int = 1
    wait_timeout_s: float = (
        3600.0  # the learner stops (exit 1, after a checkpoint) when no group arrives this long; 0: wait forever
    )


@dataclass
class TransportConfig:
    trajectories: str = "auto"  # auto: a free loopback port per run
    weights: str = "auto"
    control: str = "auto"
    secret: str = ""  # HMAC-SHA256 key; required when an endpoint is not loopback


@dataclass
class ClusterConfig:
    learner_ranks: int = 1
    learner_gpus: list[int] = field(default_factory=list)  # empty: CPU
    rollout_gpus: list[int] = field(default_factory=list)
    rollout_servers: int = 1
    # async on one CPU machine: the learner (one rank) takes the servers' cores while they wait for weights, and gives
    # them back when they have work (learner/core_lending.py). Off, or OMP_NUM_THREADS set: a fixed split
    lend_idle_cores: bool = True


@dataclass
class SyncConfig:
    full_every: int = 10  # a full weight push every N versions, deltas between
    transport: str = "zmq"  # zmq | cuda-ipc | nccl (the last two: rollout.engine=sglang on GPUs)
    group_endpoint: str = "auto"  # nccl: tcp://HOST:PORT where learner rank 0 and the replicas meet; auto: launcher
    # nccl: how long learner rank 0 waits for every replica to join (and a broadcast for its receivers); longer than
    # the slowest server start: a first FP8 start on SM90 compiles DeepGEMM kernels for 10-20 minutes
    group_timeout_s: float = 3600.0
    buckets_in_flight: int = 2  # nccl: flattened buckets (256 MB each) queued on learner rank 0's GPU at once


@dataclass
class EvalConfig:
    every: int = 0  # learner steps between evaluations; 0: only at start and end
    n_samples: int = 1  # avg@k on eval files; 1 with temperature 0 is greedy accuracy
    temperature: float = 0.0
    max_problems: int = 512
    final: bool = True  # evaluate after the last step too; off: only at the start and every eval.every steps
    # eval/acc_fp on the learner's device (rank 0's GPU in bf16, else the CPU in fp32), in a thread of its own:
    # inline (training waits) | background (training goes on) | none | auto (background on GPUs, inline on the CPU)
    acc_fp: str = "auto"
    max_new_tokens: int = 0  # the longest held-out answer, both engines; 0: rollout.sampling.max_new_tokens


@dataclass
class CheckpointConfig:
    every: int = 0  # learner steps between checkpoints; 0: only at exit
    keep: int = 2


@dataclass
class LogConfig:
    tensorboard: bool = True
    wandb_project: str = ""
    interval_s: float = 10.0
    level: str = "info"


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)  # `async` in YAML and overrides
    transport: TransportConfig = field(default_factory=TransportConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)


# `async` is a Python keyword, so the schema field is `async_`; users only ever see `async`.
_KEYWORD_RENAMES = {"async": "async_"}

CHOICES: dict[str, tuple[str, ...]] = {
    "rollout.engine": ("torch", "sglang"),
    "rollout.quant": ("none", "int8", "fp8"),  # = qurl.quant.QUANT_SETTINGS (no torch here; test_quant checks)
    "rollout.dtype": ("float32", "bfloat16", "auto"),
    "algo.kl_kind": ("k1", "k2", "k3"),
    "algo.advantage": ("grpo", "drgrpo", "rloo"),
    "quant.fp8_granularity": ("block", "channel"),
    "train.lr_schedule": ("constant", "cosine"),
    "train.precision": ("fp32", "bf16", "auto"),
    "train.micro_batches": ("bucketed", "padded", "packed"),  # = learner.policy_step.PLANNERS (test_packing checks)
    "log.level": ("debug", "info", "warning"),
    "sync.transport": ("zmq", "cuda-ipc", "nccl"),
    "eval.acc_fp": ("auto", "inline", "background", "none"),
}

# key -> (lower bound, whether the bound itself is allowed, upper bound or None)
BOUNDS: dict[str, tuple[float, bool, float | None]] = {
    "run.max_restarts": (0, True, None),
    "run.server_silence_s": (0, True, None),
    "data.max_prompt_len": (1, True, None),
    "reward.timeout_s": (0, False, None),
    "reward.workers": (1, True, None),
    "reward.max_error_frac": (0, True, 1.0),
    "rollout.max_batch": (1, True, None),
    "rollout.max_seq_len": (2, True, None),
    "rollout.n_samples": (1, True, None),
    "rollout.tp_size": (1, True, None),
    "rollout.sampling.temperature": (0, True, None),
    "rollout.sampling.top_p": (0, False, 1.0),
    "rollout.sampling.max_new_tokens": (1, True, None),
    "algo.eps_low": (0, True, 1.0),
    "algo.eps_high": (0, True, None),
    "algo.tis_cap": (1, True, None),
    "algo.kl_coef": (0, True, None),
    "algo.overlong.buffer": (0, True, None),
    "algo.overlong.factor": (0, True, None),
    "quant.invariant_scaling.s": (0, False, None),
    "train.lr": (0, False, None),
    "train.weight_decay": (0, True, None),
    "train.warmup_steps": (0, True, None),
    "train.batch_prompts": (1, True, None),
    "train.mini_batches": (1, True, None),
    "train.micro_batch_tokens": (1, True, None),
    "train.steps": (1, True, None),
    "train.grad_clip": (0, False, None),
    "train.max_skipped_steps": (0, True, None),
    "async.max_staleness": (0, True, None),
    "async.wait_timeout_s": (0, True, None),
    "algo.drift_kl_threshold": (0, False, None),
    "mismatch.max_kl": (0, True, None),
    "mismatch.alarm_steps": (1, True, None),
    "mismatch.smoothing": (0, False, 1.0),
    "cluster.learner_ranks": (1, True, None),
    "cluster.rollout_servers": (1, True, None),
    "sync.full_every": (1, True, None),
    "sync.group_timeout_s": (0, False, None),
    "sync.buckets_in_flight": (1, True, None),
    "eval.every": (0, True, None),
    "eval.n_samples": (1, True, None),
    "eval.temperature": (0, True, None),
    "eval.max_problems": (1, True, None),
    "eval.max_new_tokens": (0, True, None),
    "checkpoint.every": (0, True, None),
    "checkpoint.keep": (1, True, None),
    "log.interval_s": (0, False, None),
}

_ENDPOINT = re.compile(r"^(tcp://(?P<host>[^:/]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})|ipc://.+|auto)$")


def _to_schema_key(dotted: str) -> str:
    head, _, rest = dotted.partition(".")
    head = _KEYWORD_RENAMES.get(head, head)
    return f"{head}.{rest}" if rest else head


def _to_user_key(dotted: str) -> str:
    head, _, rest = dotted.partition(".")
    for user, schema in _KEYWORD_RENAMES.items():
        if head == schema:
            head = user
    return f"{head}.{rest}" if rest else head


def _rename_top(tree: Any, renames: dict[str, str]) -> Any:
    if isinstance(tree, dict):
        return {renames.get(k, k): v for k, v in tree.items()}
    return tree


def get(cfg: DictConfig, key: str) -> Any:
    """Read a user-facing dotted key (`async.max_staleness`) from a loaded config."""
    return OmegaConf.select(cfg, _to_schema_key(key), throw_on_missing=True)


def _omegaconf_error(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = _to_user_key(str(getattr(exc, "full_key", "") or "?"))
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ConfigKeyError):
        return ConfigError(f"{source}: unknown key '{key}'")
    if "is not a ListConfig" in text:  # a bare string where the schema has a list
        example = getattr(exc, "value", None) or "..."
        return ConfigError(f"{source}: '{key}' must be a list, e.g. {key}=[{example}]")
    return ConfigError(f"{source}: bad value for '{key}': {text}")


def int8_lm_head(cfg: DictConfig) -> bool:
    """quant.lm_head with null resolved: on exactly where it can be, the torch engine's int8 rollout."""
    chosen = get(cfg, "quant.lm_head")
    return get(cfg, "rollout.quant") == "int8" and get(cfg, "rollout.engine") == "torch" if chosen is None else chosen


def rollout_dtype(cfg: DictConfig) -> str:
    """rollout.dtype with auto resolved: bfloat16 where the engine's device computes it natively (a GPU, or a CPU with
    AVX512-BF16 or AMX: INT8 decodes 1.3x bf16 there with bf16 activations, RESULTS §13), float32 elsewhere."""
    chosen = get(cfg, "rollout.dtype")
    if chosen != "auto":
        return chosen
    if get(cfg, "rollout.engine") == "sglang":
        return "bfloat16"  # its quantized layers take nothing else
    import torch  # here, not above: importing qurl.config stays torch-free (as qurl.corrections.spec does)

    from qurl.hardware import native_bf16

    return "bfloat16" if native_bf16(torch.device(get(cfg, "rollout.device"))) else "float32"


def load_config(path: str | None = None, overrides: list[str] = (), check_paths: bool = True) -> DictConfig:
    """Merge schema defaults, a YAML file and overrides, then validate; raise ConfigError on any problem."""
    cfg = OmegaConf.structured(Config)
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"--config: no such file '{path}'")
        try:
            raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        except yaml.MarkedYAMLError as exc:  # yaml errors are not OmegaConf errors
            mark = exc.problem_mark or exc.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
            raise ConfigError(f"{where}: not valid YAML: {exc.problem or exc.context}") from None
        except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of config groups")
        try:
            cfg = OmegaConf.merge(cfg, _rename_top(raw, _KEYWORD_RENAMES))
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, path) from None
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override '{item}': expected key=value, e.g. rollout.quant=none")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{_to_schema_key(key)}={value}"]))
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, f"override '{item}'") from None
    validate(cfg, check_paths=check_paths)
    return cfg


def validate(cfg: DictConfig, check_paths: bool = True) -> None:
    """Check choices, bounds and cross-field rules; raise ConfigError naming the first bad key."""
    _check_finite(cfg)
    for key, allowed in CHOICES.items():
        value = get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")
    for key, (low, inclusive, high) in BOUNDS.items():
        value = get(cfg, key)
        too_low = value < low if inclusive else value <= low
        too_high = high is not None and value > high
        if too_low or too_high:
            rng = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            raise ConfigError(f"{key}={value!r} is out of range; it must be {rng}")
    if get(cfg, "rollout.sampling.top_k") != -1 and get(cfg, "rollout.sampling.top_k") < 1:
        raise ConfigError("rollout.sampling.top_k must be -1 (off) or >= 1")
    try:  # the objective's choices and ranges come from its registries (qurl.corrections)
        LossSpec.from_config(cfg.algo)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if get(cfg, "rollout.n_samples") < 2:
        raise ConfigError(
            f"rollout.n_samples=1 does not work with algo.advantage={get(cfg, 'algo.advantage')} "
            "(group-based); it must be >= 2"
        )
    if get(cfg, "eval.max_new_tokens") > get(cfg, "rollout.sampling.max_new_tokens"):
        raise ConfigError(
            f"eval.max_new_tokens={get(cfg, 'eval.max_new_tokens')} is out of range; it must be <= "
            f"rollout.sampling.max_new_tokens={get(cfg, 'rollout.sampling.max_new_tokens')} (0: the same)"
        )
    if get(cfg, "train.mini_batches") > get(cfg, "train.batch_prompts"):
        raise ConfigError("train.mini_batches must be <= train.batch_prompts")
    targets = list(get(cfg, "quant.invariant_scaling.targets"))
    if not targets or any(t not in ("qkv", "mlp") for t in targets):
        raise ConfigError(f"quant.invariant_scaling.targets={targets} is not allowed; use [qkv] or [qkv, mlp]")
    bits = get(cfg, "quant.weight_bits")
    int_torch = get(cfg, "rollout.quant") == "int8" and get(cfg, "rollout.engine") == "torch"
    if bits != 8 and not (4 <= bits <= 7 and int_torch):
        raise ConfigError(
            f"quant.weight_bits={bits!r} is not allowed; use 8, or 4..7 with rollout.quant=int8 and "
            "rollout.engine=torch (a mismatch study knob)"
        )
    if get(cfg, "quant.lm_head") and not int_torch:
        raise ConfigError(
            "quant.lm_head=true needs rollout.quant=int8 and rollout.engine=torch "
            f"(got {get(cfg, 'rollout.quant')} on {get(cfg, 'rollout.engine')})"
        )
    if (
        get(cfg, "rollout.engine") == "sglang"
        and get(cfg, "rollout.quant") != "none"
        and get(cfg, "rollout.dtype") not in ("bfloat16", "auto")
    ):
        raise ConfigError(
            f"rollout.dtype={get(cfg, 'rollout.dtype')} with rollout.engine=sglang and rollout.quant="
            f"{get(cfg, 'rollout.quant')}: SGLang's quantized layers take bfloat16 only; "
            "set rollout.dtype=bfloat16"
        )
    name = get(cfg, "reward.name")
    if name not in BUILTIN and not re.fullmatch(r"[\w.]+:\w+", name):
        raise ConfigError(f"reward.name={name!r} is not allowed; use {', '.join(BUILTIN)} or package.module:function")
    _validate_transport(cfg)
    _validate_sync(cfg)
    if check_paths:
        _validate_paths(cfg)


def _check_finite(cfg: Any, prefix: str = "") -> None:
    """Every float key must be finite: inf / nan (which YAML and overrides accept) would train NaN weights."""
    for key, value in cfg.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, DictConfig):
            _check_finite(value, f"{dotted}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{_to_user_key(dotted)}={value!r} is not a finite number")


def _validate_transport(cfg: DictConfig) -> None:
    secret = get(cfg, "transport.secret")
    for name in ("trajectories", "weights", "control"):
        endpoint = get(cfg, f"transport.{name}")
        match = _ENDPOINT.match(endpoint)
        if not match:
            raise ConfigError(
                f"transport.{name}={endpoint!r} is not an endpoint; use auto, tcp://HOST:PORT or ipc://PATH"
            )
        host = match.group("host")
        if host and not is_loopback_host(host) and not secret:
            raise ConfigError(f"transport.{name}={endpoint!r} is not loopback; set transport.secret to bind it")


def _validate_sync(cfg: DictConfig) -> None:
    """sync.transport: zmq anywhere; cuda-ipc (same node) and nccl only for SGLang replicas on GPUs."""
    fraction = get(cfg, "rollout.mem_fraction")
    if fraction is not None and not 0 < fraction < 1:
        raise ConfigError(f"rollout.mem_fraction={fraction!r} is out of range; it must be > 0 and < 1, or null")
    kind, endpoint = get(cfg, "sync.transport"), get(cfg, "sync.group_endpoint")
    match = _ENDPOINT.match(endpoint)
    if not match or endpoint.startswith("ipc://"):
        raise ConfigError(f"sync.group_endpoint={endpoint!r} is not allowed; use auto or tcp://HOST:PORT")
    if kind == "zmq":
        return
    if get(cfg, "rollout.engine") != "sglang":
        raise ConfigError(f"sync.transport={kind} needs rollout.engine=sglang; the torch engine takes weights over zmq")
    if not get(cfg, "cluster.learner_gpus") or not get(cfg, "cluster.rollout_gpus"):
        raise ConfigError(
            f"sync.transport={kind} needs GPUs (cluster.learner_gpus and cluster.rollout_gpus); "
            "on CPU use sync.transport=zmq"
        )
    if kind == "nccl" and get(cfg, "rollout.quant") == "int8":
        raise ConfigError(
            "sync.transport=nccl cannot refit rollout.quant=int8 (sglang 0.5.23's distributed update "
            "skips the INT8 loader); use sync.transport=cuda-ipc or zmq"
        )
    if kind == "cuda-ipc":
        host = _ENDPOINT.match(get(cfg, "transport.weights")).group("host")
        if host and not is_loopback_host(host):
            raise ConfigError(
                f"sync.transport=cuda-ipc hands CUDA memory handles to servers on this node; "
                f"transport.weights={get(cfg, 'transport.weights')!r} must be loopback or ipc://"
            )


def is_loopback_host(host: str) -> bool:
    """localhost or a loopback address (bracketed IPv6 too); names and wildcards are not provably local."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _validate_paths(cfg: DictConfig) -> None:
    model = get(cfg, "model.path")
    if not model:
        raise ConfigError("model.path is not set; give a Hugging Face model folder")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ConfigError(f"model.path={model!r} is not a model folder (no config.json there)")
    files = list(get(cfg, "data.train_files"))
    if not files:
        raise ConfigError("data.train_files is empty; give at least one JSONL or Parquet file")
    for key in ("data.train_files", "data.eval_files"):
        for f in get(cfg, key):
            if not os.path.isfile(f):
                raise ConfigError(f"{key}: no such file {f!r}")


def run_dir(cfg: DictConfig) -> str:
    """The run's output folder: run.dir, or runs/<run.name>."""
    return get(cfg, "run.dir") or os.path.join("runs", get(cfg, "run.name"))


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as users write it (with `async`, not `async_`)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    inverse = {v: k for k, v in _KEYWORD_RENAMES.items()}
    return OmegaConf.to_yaml(_rename_top(container, inverse))
