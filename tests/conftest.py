"""Shared fixtures: the prepared CPU demo, built once and cached across test sessions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The default demo folder (same place as `qurl-prepare-demo`), prepared on first use."""
    from qurl.demo.prepare import Recipe, prepare

    root = Path(os.environ.get("QURL_DEMO_DIR") or REPO / ".cache" / "qurl-demo")
    prepare(root, Recipe(), progress=False)
    return root


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tests run tiny ops: a second OpenMP thread in the test process only waits on a shared 2-core machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
