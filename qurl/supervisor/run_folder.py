"""The run folder: whether it holds a run, and one launcher at a time (an flock on <run>/.qurl-lock).

The lock is held open for the launcher's life; the kernel drops it when its owner exits in any way
(SIGKILL included), so a crashed run can be resumed at once, while a second launcher on a live run is
refused before it writes anything.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from typing import IO

from qurl.outputs.checkpoint_files import step_dirs
from qurl.outputs.report import read_metrics

LOCK_NAME = ".qurl-lock"


def holds_run(run_dir: str) -> bool:
    """A checkpoint or a trained step is there to lose; a start that failed before its first step leaves neither,
    so the same command (with the input fixed) may run there again."""
    if step_dirs(os.path.join(run_dir, "checkpoints")):
        return True
    return any("loss/policy" in r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")))


class RunFolderBusy(RuntimeError):
    """Another live launcher owns the run folder; the message names it in one line."""


class RunLock:
    """The held lock; `release` (or process exit) frees the folder."""

    def __init__(self, path: str, handle: IO[str]) -> None:
        self.path, self._handle = path, handle

    def release(self) -> None:
        """Unlock and close; the owner record stays, a later claim overwrites it."""
        if not self._handle.closed:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()


def claim(run_dir: str, prog: str) -> RunLock:
    """Lock run_dir for this process, or raise RunFolderBusy naming the owner (pid, host, start time)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_NAME)
    handle = open(path, "a+")  # never truncate before holding the lock: the owner's record must survive a refusal
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = _owner(handle.read())
        handle.close()
        raise RunFolderBusy(
            f"{run_dir} is in use by {owner}; stop that run first, or give this one another run.name / run.dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(
        json.dumps(
            {
                "prog": prog,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
    )
    handle.flush()
    return RunLock(path, handle)


def _owner(text: str) -> str:
    """The owner record as words; a record still being written reads as 'another launcher'."""
    try:
        o = json.loads(text)
        return f"{o['prog']} pid {o['pid']} on {o['host']} (started {o['started']})"
    except (ValueError, KeyError, TypeError):
        return "another launcher (its owner record is not written yet)"
