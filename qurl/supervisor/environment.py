"""The machine a run starts on, checked before any process starts: the NVIDIA driver against the CUDA of the installed
torch and sglang, /dev/shm against the largest weight push SGLang is handed through it, and free disk against the
checkpoints the run keeps. Each problem is one line (ConfigError); sizes come from the model folder's safetensors
headers, so nothing is loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from importlib import metadata
from typing import Any

from qurl.config import ConfigError, get, rollout_dtype

# The oldest Linux driver each CUDA major runs on (NVIDIA's CUDA release notes, minor-version compatibility): a torch
# or sglang built for CUDA 13 installs on an older driver and then fails at its first CUDA call.
MIN_DRIVER = {13: "580.65.06", 12: "525.60.13", 11: "450.80.02"}
SHM = "/dev/shm"
BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
CODE_BYTES = 1  # an int8 or fp8 code; the scales are a rounding error beside them


ADAMW_BYTES = 12  # per parameter in a checkpoint: fp32 weights plus AdamW's two fp32 moments
GB = 1e9


def gpu_keys(cfg: Any) -> str:
    """The settings that place a process on a GPU, as `key=value` ('' for a CPU config)."""
    keys = [f"cluster.{k}={list(get(cfg, f'cluster.{k}'))}" for k in ("learner_gpus", "rollout_gpus")]
    keys = [k for k, key in zip(keys, ("learner_gpus", "rollout_gpus")) if get(cfg, f"cluster.{key}")]
    if str(get(cfg, "rollout.device")).startswith("cuda"):
        keys.append(f"rollout.device={get(cfg, 'rollout.device')!r}")
    return ", ".join(keys)


def nvidia_driver() -> str | None:
    """The driver version nvidia-smi reports, or None when there is no nvidia-smi (no driver)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def sglang_torch_pin() -> tuple[str, str] | None:
    """(sglang's version, the torch version it pins), or None when sglang is not installed."""
    try:
        dist = metadata.distribution("sglang")
    except metadata.PackageNotFoundError:
        return None
    for req in dist.requires or []:
        m = re.match(r"torch\s*==\s*([\w.]+)", req)
        if m and "extra ==" not in req:
            return dist.version, m.group(1)
    return dist.version, ""


def driver_problem(
    driver: str | None,
    torch_version: str,
    torch_cuda: str | None,
    sglang: tuple[str, str] | None,
    needs_sglang: bool,
    keys: str = "the config",
) -> str:
    """'' when this driver runs the installed torch (and sglang), else the one line that says why not; `keys`: the
    settings that ask for GPUs."""
    if driver is None:
        return (
            f"{keys} but this machine has no CUDA device (no NVIDIA driver: nvidia-smi is not on PATH); "
            "use rollout.device=cpu and no cluster GPUs to run on the CPU"
        )
    if torch_cuda is None:
        return f"torch {torch_version} is a CPU build; a GPU run needs a CUDA build of torch"
    if needs_sglang:
        if sglang is None:
            return "rollout.engine=sglang, but sglang is not installed: pip install -e '.[sglang]' on this node"
        version, pin = sglang
        if pin and torch_version.split("+")[0] != pin:
            return (
                f"sglang {version} needs torch=={pin}, but this environment has torch {torch_version}: "
                "pip install -e '.[sglang]' into the environment the run uses"
            )
    major = _version(torch_cuda)[0]
    need = MIN_DRIVER.get(major)
    if need is not None and _version(driver) < _version(need):
        stack = f"torch {torch_version}" + (f" and sglang {sglang[0]}" if needs_sglang and sglang else "")
        return (
            f"NVIDIA driver {driver} is older than {need}, the oldest that runs CUDA {major} "
            f"({stack}, built for CUDA {torch_cuda}); upgrade the driver or install a torch built for an older CUDA"
        )
    return ""


def check_driver(cfg: Any) -> None:
    """GPU configs: the driver runs the CUDA of the installed torch (and sglang); ConfigError otherwise."""
    keys = gpu_keys(cfg)
    if not keys:
        return
    import torch

    problem = driver_problem(
        nvidia_driver(),
        torch.__version__,
        torch.version.cuda,
        sglang_torch_pin(),
        get(cfg, "rollout.engine") == "sglang",
        keys,
    )
    if problem:
        raise ConfigError(problem)


def model_tensors(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor in the model folder's safetensors files."""
    out = {}
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(path, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"})
    return out


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def push_bytes(tensors: dict[str, tuple[str, tuple[int, ...]]], quant: str, engine_dtype: str) -> int:
    """Bytes of a full weight push: projections as 1-byte codes when quantized, the rest in the engine's dtype."""
    from qurl.quant import is_quantized_linear

    element = 2 if engine_dtype == "bfloat16" else 4
    return sum(
        _numel(shape) * (CODE_BYTES if quant != "none" and is_quantized_linear(name) else element)
        for name, (_, shape) in tensors.items()
    )


def checkpoint_bytes(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of one checkpoint: fp32 weights and AdamW's moments (the RNG states and JSON are small)."""
    return ADAMW_BYTES * sum(_numel(shape) for _, shape in tensors.values())


def free_bytes(path: str) -> int:
    """Free bytes for an unprivileged writer on the filesystem that holds `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_writable(run_dir: str) -> None:
    """ConfigError (one line) when the run folder cannot be made where run.dir points: a read-only mount, a
    parent that refuses new folders, a file in the way. Probed with a temporary folder that is removed at once."""
    base = os.path.abspath(run_dir)
    while not os.path.exists(base):
        base = os.path.dirname(base)
    try:
        if not os.path.isdir(base):
            raise NotADirectoryError(f"{base} is a file")
        os.rmdir(tempfile.mkdtemp(prefix=".qurl-probe-", dir=base))
    except OSError as exc:
        raise ConfigError(
            f"run.dir={run_dir}: cannot create the run folder there ({base}: {exc.strerror or exc}); choose a "
            "writable run.dir"
        ) from None


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def check_room(cfg: Any, run_dir: str, shm: str = SHM) -> dict[str, int]:
    """The run folder can be made, /dev/shm holds the largest push (SGLang over zmq) and the disk checkpoint.keep + 1
    checkpoints; ConfigError for any, else the estimates."""
    check_writable(run_dir)
    tensors = model_tensors(get(cfg, "model.path"))
    if not tensors:  # *.bin weights: no header to size them by
        return {}
    estimates = {"push_bytes": push_bytes(tensors, get(cfg, "rollout.quant"), rollout_dtype(cfg))}
    if get(cfg, "rollout.engine") == "sglang" and get(cfg, "sync.transport") == "zmq" and os.path.isdir(shm):
        free = free_bytes(shm)
        if free < estimates["push_bytes"]:
            raise ConfigError(
                f"{shm} has {free / GB:.1f} GB free, but sync.transport=zmq hands SGLang each full weight push "
                f"through it ({estimates['push_bytes'] / GB:.1f} GB for this model, rollout.quant="
                f"{get(cfg, 'rollout.quant')}); start the container with --shm-size="
                f"{max(1, round(2 * estimates['push_bytes'] / GB))}g or --ipc=host"
            )
    one = checkpoint_bytes(tensors)
    keep = get(cfg, "checkpoint.keep")
    # a new checkpoint is complete before the oldest is pruned (checkpoints already there are pruned in turn), and
    # the run ends by exporting hf/ (fp32 weights)
    existing = _folder_bytes(os.path.join(run_dir, "checkpoints"))
    need = max(0, (keep + 1) * one + one // 3 - existing)
    free = free_bytes(run_dir)
    estimates.update(checkpoint_bytes=one, disk_needed_bytes=need)
    if free < need:
        raise ConfigError(
            f"run.dir={run_dir!r}: {free / GB:.1f} GB free, but checkpoint.keep={keep} needs {need / GB:.1f} GB "
            f"({keep + 1} checkpoints of {one / GB:.1f} GB, fp32 weights and AdamW state, and hf/); free space, lower "
            "checkpoint.keep, or choose another run.dir"
        )
    return estimates
