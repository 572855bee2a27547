"""A learner checkpoint's files as its manifest records them (size and sha256 of each), torch-free.

The learner writes and verifies manifests with these; qurl-async verifies them before a resume, so that a
resume with no intact checkpoint is refused before anything in the run folder changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

FORMAT = "qurl-learner-checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 20


def step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step_N folder under root, newest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root) if (m := _STEP_DIR.match(name))]
    return sorted(found, reverse=True)


def sha256(path: str) -> str:
    """Hex digest of a file's content, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def describe(folder: str) -> dict[str, dict[str, Any]]:
    """{file: {size, sha256}} of every file in a folder being made into a checkpoint."""
    return {
        name: {"size": os.path.getsize(p), "sha256": sha256(p)}
        for name in sorted(os.listdir(folder))
        if os.path.isfile(p := os.path.join(folder, name))
    }


def problem(path: str) -> tuple[str, dict]:
    """('', manifest) for an intact checkpoint, else (why it is unusable, {}); why is a few words."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return "incomplete (no manifest.json)", {}
    except (OSError, ValueError) as exc:
        return f"unreadable manifest.json ({type(exc).__name__})", {}
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        return f"not a qurl learner checkpoint (format {found!r})", {}
    for name, entry in manifest.get("files", {}).items():
        size, digest = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (entry, None)
        file = os.path.join(path, name)
        if not os.path.isfile(file) or os.path.getsize(file) != size:
            return f"corrupt ({name} is missing or has the wrong size)", {}
        if digest is not None and sha256(file) != digest:  # manifests before checksums carry sizes only
            return f"corrupt ({name} does not match its sha256 in manifest.json)", {}
    return "", manifest
