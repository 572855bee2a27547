"""qurl-learner: one process, N local ranks spawned here (cluster.learner_ranks), or the ranks torchrun starts."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

from omegaconf import DictConfig

from qurl.supervisor.cli import EXIT_DIVERGED, EXIT_FAULT, EXIT_INPUT, die_with_parent, parse

PROG = "qurl-learner"
INIT_ENV = "QURL_LEARNER_INIT"  # set by _spawn / main for locally started ranks
log = logging.getLogger("learner")


def _under_launcher() -> bool:
    """torchrun (or a parent qurl-learner) set the rank environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _init_file() -> str:
    """A path for torch.distributed's FileStore: ranks started here meet through it, with no port to race for."""
    fd, path = tempfile.mkstemp(prefix="qurl-learner-", suffix=".store")
    os.close(fd)
    os.remove(path)  # FileStore wants a path that does not exist yet (or an empty file)
    return path


def _check(cfg: DictConfig) -> str | None:
    """Config combinations only the learner knows to be wrong, as one line."""
    gpus = list(cfg.cluster.learner_gpus)
    if gpus and not _under_launcher() and len(gpus) != cfg.cluster.learner_ranks:
        return (
            f"cluster.learner_gpus lists {len(gpus)} GPUs for cluster.learner_ranks={cfg.cluster.learner_ranks}; "
            "give one GPU per rank"
        )
    overlong = cfg.algo.overlong
    if overlong.enable and not 0 < overlong.buffer <= cfg.rollout.sampling.max_new_tokens:
        return (
            f"algo.overlong.buffer={overlong.buffer} must be in (0, rollout.sampling.max_new_tokens="
            f"{cfg.rollout.sampling.max_new_tokens}] when algo.overlong.enable=true"
        )
    return None


def _setup_logging(cfg: DictConfig, rank: int) -> None:
    level = getattr(logging, cfg.log.level.upper()) if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s {PROG}[{rank}] %(levelname)s %(message)s", force=True)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """A CPU learner's glibc keeps the memory the process frees for its next allocations: no block served by mmap, no
    heap trimmed at any size (-1: mallopt's int read as the largest size_t). FSDP2 frees and re-allocates every layer's
    buffers each step, and each fresh page costs a fault: SmolLM2's gym step on one AMX Xeon thread 3.84-3.94 s ->
    3.40-3.41 s; a 7B decoder layer frees over 2 GB at once, which a 2^31 - 1 threshold still trimmed, re-faulting 2-5
    GB a step. A GLIBC_TUNABLES malloc setting wins; False where it is set or the C library is not glibc."""
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))


def _run_rank(cfg: DictConfig) -> int:
    """One rank: join the process group (gloo on CPU, NCCL for GPU tensors), train, leave."""
    import torch
    import torch.distributed as dist

    from learner.checkpoint import CheckpointError, CheckpointWriteError
    from learner.errors import BadRewards, Diverged, StartError
    from learner.policy_step import DistEnv
    from learner.trainer import Learner

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    _setup_logging(cfg, rank)
    gpus = list(cfg.cluster.learner_gpus)
    if gpus:
        if not torch.cuda.is_available():
            print(f"{PROG}: cluster.learner_gpus={gpus} but CUDA is not available", file=sys.stderr)
            return EXIT_INPUT
        # under qurl-async CUDA_VISIBLE_DEVICES already holds exactly these GPUs, renumbered from 0
        index = local_rank if "CUDA_VISIBLE_DEVICES" in os.environ else gpus[local_rank % len(gpus)]
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # small control tensors stay on CPU, FSDP's go over NCCL
    else:
        device, backend = torch.device("cpu"), "gloo"
        keep_freed_memory()
    # ranks started here meet through a file (no port to race for); torchrun's ranks through its env://
    dist.init_process_group(
        backend,
        init_method=os.environ.get(INIT_ENV, "env://"),
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=60),
    )
    learner = None
    try:
        learner = Learner(cfg, DistEnv(rank, world, local_rank, device))
        code = learner.run()
        if world > 1:  # leave together: gloo torn down on one rank while its peer still works can abort that rank
            dist.barrier()
        return code
    except (CheckpointError, CheckpointWriteError, StartError, Diverged, BadRewards) as exc:
        if str(exc):  # empty: another rank failed and says why
            print(f"{PROG}: {exc}", file=sys.stderr)
        if isinstance(exc, CheckpointWriteError):
            return EXIT_FAULT  # room or permissions can come back: a resume continues from the intact checkpoint
        return EXIT_DIVERGED if isinstance(exc, Diverged) else EXIT_INPUT
    finally:
        if learner is not None:
            learner.close()
        dist.destroy_process_group()


def _spawn(cfg: DictConfig, argv: list[str]) -> int:
    """Start cluster.learner_ranks local ranks of this same command and supervise them."""
    n = cfg.cluster.learner_ranks
    store = _init_file()
    base = dict(os.environ, WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), **{INIT_ENV: f"file://{store}"})
    if not cfg.cluster.learner_gpus and "OMP_NUM_THREADS" not in os.environ:
        base["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    # own session: a terminal's Ctrl-C reaches the ranks once, through forward(), not twice
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "learner.main", *argv],
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
            preexec_fn=die_with_parent,
            start_new_session=True,
        )
        for r in range(n)
    ]

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:  # a dead rank leaves the others blocked in a collective: end them
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                return failed[0] if failed[0] > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        if os.path.exists(store):
            os.remove(store)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the qurl-learner console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse(PROG, argv)
    problem = _check(cfg)
    if problem:
        print(f"{PROG}: config error: {problem}", file=sys.stderr)
        return EXIT_INPUT
    if _under_launcher():
        _exit_now(_run_rank(cfg))
    if cfg.cluster.learner_ranks == 1:
        store = _init_file()
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", **{INIT_ENV: f"file://{store}"})
        try:
            code = _run_rank(cfg)
        finally:
            if os.path.exists(store):
                os.remove(store)
        _exit_now(code)
    return _spawn(cfg, argv)


def _exit_now(code: int) -> None:
    """Leave without interpreter teardown: a gloo thread still joinable there aborts the process ("terminate called
    without an active exception") after the rank has finished, checkpointed and closed everything it owns."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
