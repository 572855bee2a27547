"""Start-up checks that would fail on every try: run once by qurl-async before it claims the run folder.

Each problem is one line naming the key and the file; nothing here is retried. What passes but deserves a
word (skipped data rows) comes back as counts for the console and summary.json.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from typing import Any

from omegaconf import DictConfig

from qurl.config import ConfigError, get
from qurl.data import DatasetError, load_examples
from qurl.rewards import RewardError, resolve_reward_fn

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, byte-level BPE


def check(cfg: DictConfig) -> dict[str, Any]:
    """Raise ConfigError (one line) for a start-up error that will recur; return data counts worth reporting."""
    _check_model(get(cfg, "model.path"))
    _check_device(get(cfg, "rollout.device"))
    try:
        resolve_reward_fn(get(cfg, "reward.name"))
    except RewardError as exc:
        raise ConfigError(str(exc)) from None
    return {
        "train": _check_data("data.train_files", list(get(cfg, "data.train_files"))),
        **({"eval": _check_data("data.eval_files", files)} if (files := list(get(cfg, "data.eval_files"))) else {}),
    }


def _check_model(path: str) -> None:
    """Tokenizer files present and every safetensors file as long as its header says."""
    names = set(os.listdir(path))
    if not names & set(TOKENIZER_FILES):
        raise ConfigError(
            f"model.path={path!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy them from the base model"
        )
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    if not shards and not any(n.endswith(".bin") for n in names):
        raise ConfigError(f"model.path={path!r} has no weights (*.safetensors or *.bin)")
    for name in shards:
        problem = safetensors_problem(os.path.join(path, name))
        if problem:
            raise ConfigError(f"model.path: {os.path.join(path, name)} is {problem}")


def safetensors_problem(file: str) -> str:
    """'' for a safetensors file whose header parses and whose size covers every tensor, else what is wrong."""
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return f"truncated ({size} bytes, header claims {n})"
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError):
        return "not a safetensors file (unreadable header)"
    if 8 + n + end > size:
        return f"truncated ({size} bytes, its header needs {8 + n + end})"
    return ""


def _check_device(device: str) -> None:
    """rollout.device must exist on this machine (cuda without CUDA fails only deep inside the engine)."""
    if device == "cpu":
        return
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"rollout.device={device!r} but this machine has no CUDA device; use rollout.device=cpu")
    try:
        torch.device(device)
    except RuntimeError:
        raise ConfigError(f"rollout.device={device!r} is not a device; use cpu or cuda[:N]") from None


def _check_data(key: str, files: list[str]) -> dict[str, Any]:
    """Every file readable with at least one usable row; the rows skipped, with the first few named."""
    for f in files:
        if os.path.getsize(f) == 0:
            raise ConfigError(f"{key}: {f!r} is empty")
    data_log = logging.getLogger(load_examples.__module__)
    level = data_log.level
    data_log.setLevel(logging.ERROR)  # its per-file warning would be a second line; the caller reports the counts
    try:
        examples, report = load_examples(files)
    except DatasetError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read: {exc}") from None
    finally:
        data_log.setLevel(level)
    if not examples:
        first = f"; first: {report.first_bad[0]}" if report.first_bad else ""
        raise ConfigError(f"{key}: no usable rows ({report.rows} rows, {report.bad_rows} bad){first}")
    return {"rows": report.rows, "bad_rows": report.bad_rows, "first_bad": report.first_bad}
