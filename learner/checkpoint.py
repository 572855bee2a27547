"""Checkpoints and the hf/ export.

Layout of `checkpoints/step_N/` (written into `.tmp-step_N/`, renamed when complete):

    model.safetensors  the full (unsharded) fp32 policy weights, Hugging Face names, invariant scaling
                       still applied (exactly what the learner trains); a tied lm_head.weight is stored
                       once, under model.embed_tokens.weight (metadata "aliases")
    optim.safetensors  the full AdamW state, one tensor per "<param name>::<exp_avg|exp_avg_sq|step>"
    rng_rank{R}.pt     rank R's torch RNG states (torch.save of tensors only; rank 0 gathers and writes them all)
    state.json         step, version, the learner's counters (its data cursor), the lr schedule position
    manifest.json      written last: format tag, model fingerprint, every file with its size and sha256
                       (verified on load: a checkpoint damaged in place, same size, is skipped)

Rank 0 gathers and writes full state dicts (get_model_state_dict / get_optimizer_state_dict with
full_state_dict and cpu_offload) and on resume reads them and broadcasts to the other ranks, so a
checkpoint loads with any rank count and only rank 0 needs the filesystem. Nothing is unpickled:
safetensors, JSON, and torch.load(weights_only=True) for the RNG tensors. (torch.distributed.checkpoint
would scale better past ~10B parameters but its metadata file is a pickle.) Optimizer hyper-parameters
come from the config, the lr from the schedule position in state.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoConfig, AutoModelForCausalLM

from learner.errors import first_line
from qurl.outputs import checkpoint_files
from qurl.outputs.checkpoint_files import FORMAT, step_dirs
from qurl.quant.invariant_scaling import remove_invariant_scaling

_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt)$|.*\.index\.json$|^config\.json$")
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the folder and why."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, folder read-only); one line naming it and what is intact (empty
    off rank 0). The run stops with exit 1: once there is room, a resume continues from the intact one."""


def fingerprint(model: nn.Module) -> str:
    """Hash of parameter names and global shapes: tells this model's checkpoints from a foreign one's."""
    text = ";".join(f"{name}:{tuple(t.shape)}" for name, t in sorted(model.state_dict().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded fp32 weights on rank 0's CPU (an empty dict elsewhere)."""
    return get_model_state_dict(model, options=_GATHER)


def _aliases(model: nn.Module) -> dict[str, str]:
    """Tied parameters (lm_head.weight -> model.embed_tokens.weight): stored once, under the first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _flat_optim(osd: dict) -> dict[str, torch.Tensor]:
    return {f"{name}::{key}": t.contiguous() for name, state in osd["state"].items() for key, t in state.items()}


def _nested_optim(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        name, _, field = key.rpartition("::")
        state.setdefault(name, {})[field] = t
    return state


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _gather_rng() -> list[dict[str, torch.Tensor]]:
    """Collective: every rank's RNG states, on rank 0 (empty elsewhere): no other rank needs run.dir (other nodes)."""
    local = _rng_state()
    world = dist.get_world_size()
    gathered = {k: [torch.empty_like(v) for _ in range(world)] for k, v in local.items()}
    for key in sorted(local):
        dist.all_gather(gathered[key], local[key])
    return [{k: g[r] for k, g in gathered.items()} for r in range(world)] if dist.get_rank() == 0 else []


def _scatter_rng(path: str) -> None:
    """Collective: rank 0 reads rng_rank{R}.pt for every rank, hands each its own (absent: more ranks than wrote)."""
    local = _rng_state()
    for r in range(dist.get_world_size()):
        file = os.path.join(path, f"rng_rank{r}.pt")
        states = torch.load(file, weights_only=True) if dist.get_rank() == 0 and os.path.isfile(file) else {}
        found = torch.tensor([int(k in states) for k in sorted(local)])
        dist.broadcast(found, src=0)
        for key, present in zip(sorted(local), found.tolist()):
            if not present:
                continue
            tensor = states[key] if dist.get_rank() == 0 else torch.empty_like(local[key])
            dist.broadcast(tensor, src=0)
            if dist.get_rank() == r:
                (torch.set_rng_state if key == "cpu" else torch.cuda.set_rng_state)(tensor)


def _fsync_write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save(root: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, keep: int) -> str:
    """Collective: write checkpoints/step_N atomically (temp dir, manifest last, rename), keep the newest `keep`."""
    rank = dist.get_rank()
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp-step_{step}")
    weights = full_state_dict(model)
    optim = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    rng = _gather_rng()
    failed = torch.zeros(1)
    if rank == 0:
        try:
            _write(root, tmp, final, step, model, weights, optim, rng, state, keep)
        except (OSError, RuntimeError, SafetensorError) as exc:  # disk full, folder read-only: torch and safetensors
            shutil.rmtree(tmp, ignore_errors=True)  # raise their own types; the partial copy goes, older ones stay
            failed[0] = 1
            free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
            why = f"{exc.strerror if isinstance(exc, OSError) else first_line(exc)} ({free / 2**20:.1f} MiB free)"
    dist.all_reduce(failed)  # every rank stops together
    if failed.item():
        intact = step_dirs(root)
        raise CheckpointWriteError(
            f"cannot write checkpoint {final}: {why}; the partial copy was removed; "
            + (f"{intact[0][1]} is intact" if intact else "no earlier checkpoint exists")
            + "; free space or fix the folder, then resume with run.resume=true"
            if rank == 0
            else ""
        )
    return final


def _write(root, tmp, final, step, model, weights, optim, rng, state, keep) -> None:  # noqa: ANN001
    """Rank 0's half of save(): the files into tmp, the manifest last, then the rename and the pruning."""
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for r, states in enumerate(rng):
        torch.save(states, os.path.join(tmp, f"rng_rank{r}.pt"))
    aliases = _aliases(model)
    save_file(
        {k: v.contiguous() for k, v in weights.items() if k not in aliases},
        os.path.join(tmp, "model.safetensors"),
        metadata={"aliases": json.dumps(aliases)},
    )
    save_file(_flat_optim(optim), os.path.join(tmp, "optim.safetensors"))
    _fsync_write(os.path.join(tmp, "state.json"), json.dumps(state, indent=1, sort_keys=True))
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": dist.get_world_size(),
        "fingerprint": fingerprint(model),
        "files": checkpoint_files.describe(tmp),
    }
    _fsync_write(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=1, sort_keys=True))
    if os.path.exists(final):  # a rerun of the same step after a crash: the new one wins
        shutil.rmtree(final)
    os.rename(tmp, final)
    _prune(root, keep)


def _prune(root: str, keep: int) -> None:
    for _, path in step_dirs(root)[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):
        if name.startswith(".tmp-step_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def check(path: str, model_fingerprint: str) -> dict:
    """The manifest of an intact checkpoint (sizes and sha256 match) of this model; else CheckpointError (one line)."""
    why, manifest = checkpoint_files.problem(path)
    if why:
        raise CheckpointError(f"{path}: {why}")
    if manifest.get("fingerprint") != model_fingerprint:
        raise CheckpointError(
            f"{path}: written for a different model (parameter names or shapes differ from model.path)"
        )
    return manifest


def find_latest(root: str, model_fingerprint: str, warn: Callable[[str], None] | None = None) -> str | None:
    """The newest complete checkpoint of this model under root; each unusable newer folder costs one warning line."""
    for _, path in step_dirs(root):
        try:
            check(path, model_fingerprint)
            return path
        except CheckpointError as exc:
            if warn is not None:
                warn(f"skipping checkpoint {exc}")
    return None


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: rank 0 reads `path` and broadcasts model, optimizer and each rank's RNG; returns state.json."""
    weights: dict[str, torch.Tensor] = {}
    flat: dict[str, torch.Tensor] = {}
    error = ""
    if dist.get_rank() == 0:
        try:
            weights = load_file(os.path.join(path, "model.safetensors"))
            with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
                aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
            weights.update({name: weights[target] for name, target in aliases.items()})
            flat = load_file(os.path.join(path, "optim.safetensors"))
        except Exception as exc:  # safetensors raises several types for a damaged file
            error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    flags = torch.tensor([1 if error else 0, 1 if flat else 0])
    dist.broadcast(flags, src=0)
    if flags[0].item():
        raise CheckpointError(f"{path}: cannot read its weights: {error or 'see rank 0'}")
    set_model_state_dict(model, weights, options=_SCATTER)
    if flags[1].item():  # no state: no update was ever applied, and a fresh AdamW is exactly that
        groups = get_optimizer_state_dict(model, optimizer, options=_GATHER).get("param_groups")
        optim = {"state": _nested_optim(flat), "param_groups": groups} if dist.get_rank() == 0 else {}
        set_optimizer_state_dict(model, optimizer, optim, options=_SCATTER)
    _scatter_rng(path)
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)


def export_hf(
    state_dict: dict[str, torch.Tensor], model_path: str, out_dir: str, scaling: tuple[float, tuple[str, ...]] | None
) -> str:
    """Write the policy with invariant scaling removed as a Hugging Face folder (+ model.path's tokenizer files)."""
    config = AutoConfig.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state_dict, strict=True)
    if scaling is not None:
        remove_invariant_scaling(model, *scaling)
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in os.listdir(model_path):
        src = os.path.join(model_path, name)
        if os.path.isfile(src) and not _WEIGHT_FILES.match(name):
            shutil.copy2(src, os.path.join(tmp, name))
    old = out_dir.rstrip("/") + ".old"
    if os.path.exists(out_dir):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir
