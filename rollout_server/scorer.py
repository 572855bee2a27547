"""Reward scoring off the decode thread: the loop hands each finished group over and collects it scored."""

from __future__ import annotations

import queue
import threading
from typing import Any

from qurl.rewards import RewardPool, RewardResult


class Scorer:
    """Scores finished groups on one thread (the pool's only caller), so decoding never waits on a verifier."""

    def __init__(self, pool: RewardPool) -> None:
        self.pool = pool
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self.pending = 0
        self._thread = threading.Thread(target=self._run, name="qurl-scorer", daemon=True)
        self._thread.start()

    def submit(self, group: Any, items: list[tuple[str, str]]) -> None:
        self.pending += 1
        self._todo.put((group, items))

    def collect(self) -> list[tuple[Any, list[RewardResult]]]:
        """Every group scored since the last call."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        return out

    def close(self, timeout_s: float) -> bool:
        """Stop the thread after the item in hand; False if it is still busy after timeout_s."""
        self._todo.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            jobs = [self._todo.get()]
            while not self._todo.empty():  # score everything that is waiting in one call
                jobs.append(self._todo.get())
            work = [job for job in jobs if job is not None]
            items = [item for _, group_items in work for item in group_items]
            try:
                results = self.pool.score(items) if items else []
            except Exception as exc:  # noqa: BLE001  (a broken pool scores 0 with a reason, the loop goes on)
                results = [RewardResult(0.0, "error", f"{type(exc).__name__}: {exc}"[:300])] * len(items)
            pos = 0
            for group, group_items in work:
                self._done.put((group, results[pos : pos + len(group_items)]))
                pos += len(group_items)
            if len(work) < len(jobs):
                return
