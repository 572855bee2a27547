"""The randomized fault soak (docs/RELIABILITY.md §3): the demo runs to a fixed step while a seeded injector throws
faults at it at random times, and afterwards every claim about what survives must hold.

Faults, one drawn at a time (among the kinds with some of their count left) after a random pause:
    kill_server   SIGKILL the rollout server (qurl-async restarts it)
    stop_server   SIGSTOP it for 1-6 s: a short stop is SIGCONTed, a long one meets the watchdog (run.server_silence_s)
    kill_learner  SIGKILL the learner: qurl-async exits 1, and the soak resumes the run (run.resume=true)
    garbage       fuzz frames (random bytes, bad headers, broken valid messages) at every socket the learner binds
                  (trajectories PULL, control ROUTER; the weights PUB takes no input)
    fill_disk     fill the run folder's disk for 1-3 s (the run folder on a tmpfs; skipped where none can be mounted)

Claims checked afterwards (`check`): the run reached the final step; the books balance across every restart, with
no group counted twice; every checkpoint left behind verifies; no process of the run is left over. The caller
compares the final held-out accuracy with an undisturbed run of the same seed.

    python tests/scenarios/soak.py [--steps 40] [--seed 0] [--faults 3] [--out soak.json]   # after qurl-prepare-demo
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import finish, fuzz_frames, start  # noqa: E402

from qurl.outputs import checkpoint_files  # noqa: E402
from qurl.outputs.checkpoint_files import step_dirs  # noqa: E402
from qurl.wire import transport  # noqa: E402

KINDS = ("kill_server", "stop_server", "kill_learner", "garbage", "fill_disk")
SILENCE_S = 3  # run.server_silence_s in the soak: a stop longer than this meets the watchdog
OVERRIDES = ["checkpoint.every=2", "checkpoint.keep=2", f"run.server_silence_s={SILENCE_S}", "async.wait_timeout_s=120"]


def mount_tmpfs(path: Path, size: str = "96m") -> bool:
    """A tmpfs at path (root in a container, as CI); False where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def _pids(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "logs" / "pids.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _endpoints(run_dir: Path) -> list[str]:
    """The trajectories PULL and control ROUTER endpoints the launcher resolved into the run's config.yaml."""
    text = (run_dir / "config.yaml").read_text()
    return [re.search(rf"{key}: (tcp://\S+)", text).group(1) for key in ("trajectories", "control")]


class Injector:
    """Throws seeded faults at a live run until `left` (faults still to throw, by kind) is spent or the learner is
    killed (the soak then resumes the run with a new injector); counts what it threw into `left`'s complement."""

    def __init__(self, run_dir: Path, disk: Path | None, left: Counter, seed: int, pause_s: tuple[float, float]):
        self.run_dir, self.disk, self.left, self.pause_s = run_dir, disk, left, pause_s
        self.rng = np.random.default_rng(seed)
        self.thrown: Counter = Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        while +self.left and not self.stop.wait(float(self.rng.uniform(*self.pause_s))):
            kind = str(self.rng.choice(sorted(+self.left)))
            if self.throw(kind):
                self.thrown[kind] += 1
                self.left[kind] -= 1
                if kind == "kill_learner":
                    return

    def throw(self, kind: str) -> bool:
        """One fault; False when its target was not there to hit (between lives)."""
        pids = _pids(self.run_dir)
        try:
            if kind == "kill_server" and "rollout-0" in pids:
                os.kill(pids["rollout-0"], signal.SIGKILL)
            elif kind == "stop_server" and "rollout-0" in pids:
                os.kill(pids["rollout-0"], signal.SIGSTOP)
                time.sleep(float(self.rng.uniform(1, 2 * SILENCE_S)))
                os.kill(pids["rollout-0"], signal.SIGCONT)  # too late when the watchdog has killed it
            elif kind == "kill_learner" and "learner" in pids:
                os.kill(pids["learner"], signal.SIGKILL)
            elif kind == "garbage":
                self._garbage()
            elif kind == "fill_disk" and self.disk is not None:
                self._fill(float(self.rng.uniform(1, 3)))
            else:
                return False
        except (ProcessLookupError, FileNotFoundError, zmq.ZMQError):
            return False
        return True

    def _garbage(self) -> None:
        ctx = zmq.Context()
        try:
            for endpoint, kind in zip(_endpoints(self.run_dir), (zmq.PUSH, zmq.DEALER)):
                sock = transport.connect(ctx, kind, endpoint, max_bytes=1 << 20)
                for frames in fuzz_frames(self.rng, None)[:40]:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
        finally:
            ctx.destroy(linger=500)

    def _fill(self, hold_s: float) -> None:
        filler = self.disk / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while f.write(b"\0" * (1 << 20)):
                    pass
            except OSError:
                pass
        time.sleep(hold_s)
        filler.unlink()


def leftover(run_dir: Path) -> list[int]:
    """Processes whose command line names the run folder (the learner and servers are started with its config)."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmd and int(pid) != os.getpid():
            alive.append(int(pid))
    return alive


def soak(
    demo_dir: str,
    work: Path,
    steps: int,
    seed: int,
    faults: dict[str, int],
    pause_s: tuple[float, float] = (2.0, 6.0),
    max_lives: int = 12,
    extra: list[str] | None = None,
) -> dict:
    """Run the demo to `steps` while `faults` (count per kind) are thrown, resuming after every learner death;
    return what was thrown and what held."""
    disk = work / "disk"
    on_tmpfs = bool(faults.get("fill_disk")) and mount_tmpfs(disk)
    left = Counter({k: n for k, n in faults.items() if on_tmpfs or k != "fill_disk"})
    run_dir = (disk if on_tmpfs else work) / "run"
    started, thrown, lives, codes = time.monotonic(), Counter(), 0, []
    try:
        while lives < max_lives:
            lives += 1
            (run_dir / "logs" / "pids.json").unlink(missing_ok=True)  # faults start once this life's children run
            resume = ["run.resume=true"] if lives > 1 else []
            proc = start(demo_dir, run_dir, steps, f"run.seed={seed}", *OVERRIDES, *(extra or []), *resume)
            while not (run_dir / "logs" / "pids.json").exists() and proc.poll() is None:
                time.sleep(0.2)
            injector = Injector(run_dir, disk if on_tmpfs else None, left, seed * 1000 + lives, pause_s)
            thread = threading.Thread(target=injector.run, daemon=True)
            thread.start()
            code, out = finish(proc, timeout=600)
            injector.stop.set()
            thread.join()
            thrown.update(injector.thrown)
            codes.append(code)
            summary = run_dir / "summary.json"
            if code == 0 and summary.exists() and json.loads(summary.read_text())["steps"] >= steps:
                break
            assert code == 1, (
                f"life {lives} exited {code} (only exit 1, a fault that can pass, is resumed):\n{out[-3000:]}"
            )
        summary = json.loads((run_dir / "summary.json").read_text())
        books = summary["books"]
        checkpoints = {
            os.path.basename(p): checkpoint_files.problem(p)[0] for _, p in step_dirs(str(run_dir / "checkpoints"))
        }
        return {
            "steps": steps,
            "seed": seed,
            "wall_s": round(time.monotonic() - started, 1),
            "faults": {k: thrown.get(k, 0) for k in faults},
            "faults_not_thrown": {k: n for k, n in left.items() if n > 0},  # the run ended first
            "lives": lives,
            "exit_codes": codes,
            "fill_disk": "on a tmpfs" if on_tmpfs else "not run (no tmpfs could be mounted)",
            "reached_step": summary["steps"],
            "books_balanced": books["balanced"],
            "books_problems": books["problems"],
            "books": {k: v for k, v in books.items() if isinstance(v, int)},
            "restarts": summary.get("restarts"),
            "checkpoints": checkpoints,
            "leftover_pids": leftover(run_dir),
            "acc_fp_final": summary.get("eval/acc_fp/final"),
            "run_dir": str(run_dir),
        }
    finally:
        if on_tmpfs:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", type=int, default=3, help="faults of each kind")
    p.add_argument("--demo-dir", default=os.path.join(Path(__file__).resolve().parents[2], ".cache", "qurl-demo"))
    p.add_argument("--out")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qurl-soak-") as work:
        result = soak(args.demo_dir, Path(work), args.steps, args.seed, dict.fromkeys(KINDS, args.faults))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
