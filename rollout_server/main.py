"""qurl-rollout-server: build the engine, data, rewards and sockets from the config, then run the loop."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any

import zmq
from omegaconf import DictConfig

from qurl.config import get, int8_lm_head, rollout_dtype
from qurl.data import DatasetError
from qurl.evaluate import load_eval_set, load_prompts
from qurl.quant import scheme_for
from qurl.rewards import RewardError, RewardPool
from qurl.supervisor.cli import EXIT_INPUT, parse
from qurl.supervisor.layout import REPLACES_ENV
from qurl.wire import transport
from qurl.wire.protocol import TRAJECTORY_MAX_BYTES, WEIGHTS_MAX_BYTES
from rollout_server.admission import Admission
from rollout_server.engines import load_engine
from rollout_server.loop import RolloutLoop, Sockets, stop_token_ids
from rollout_server.weight_receiver import join_update_group

PROG = "qurl-rollout-server"
DATA_SEED_STRIDE = 1_000_003  # replica i shuffles prompts with seed run.seed + i * this: servers draw different prompts

log = logging.getLogger("rollout_server")


def replica_index() -> int:
    """This server's replica index (which GPUs of cluster.rollout_gpus it runs on), from QURL_SERVER_INDEX."""
    raw = os.environ.get("QURL_SERVER_INDEX", "0")
    if not raw.isdigit():
        raise ValueError(f"QURL_SERVER_INDEX={raw!r} must be this server's replica index: 0, 1, ...")
    return int(raw)


def predecessor_pid() -> int:
    """The pid of the server this one replaces (qurl-async sets QURL_REPLACES_PID on a restart), else 0."""
    raw = os.environ.get(REPLACES_ENV, "0")
    if not raw.isdigit():
        raise ValueError(f"{REPLACES_ENV}={raw!r} must be the pid of the server this one replaces")
    return int(raw)


def _auto_endpoint(cfg: DictConfig) -> str | None:
    """One error line when an endpoint was left for the launcher to fill in."""
    for name in ("trajectories", "weights", "control"):
        if get(cfg, f"transport.{name}") == "auto":
            return f"transport.{name}=auto: give an endpoint when starting this process by hand"
    return None


def open_sockets(cfg: DictConfig, server_id: str) -> Sockets:
    """Connect PUSH (trajectories), SUB (weights) and DEALER (control, routing id = server id)."""
    ctx = zmq.Context()
    push = transport.connect(ctx, zmq.PUSH, get(cfg, "transport.trajectories"), max_bytes=TRAJECTORY_MAX_BYTES)
    sub = transport.connect(ctx, zmq.SUB, get(cfg, "transport.weights"), max_bytes=WEIGHTS_MAX_BYTES, hwm=4)
    control = get(cfg, "transport.control")
    # no stale heartbeat pile (hwm 16); as large as a weight push: the learner resends weights to one server here
    dealer = transport.connect(ctx, zmq.DEALER, control, max_bytes=WEIGHTS_MAX_BYTES, hwm=16)
    dealer.disconnect(control)  # a routing id applies to later connections only
    dealer.setsockopt(zmq.ROUTING_ID, server_id.encode())
    dealer.connect(control)
    return Sockets(ctx, push, sub, dealer)


def check_vocab(tokenizer_size: int, vocab_size: int, path: str) -> None:
    """A tokenizer with ids past the model's embedding rows belongs to another model: one line, before anything runs."""
    if tokenizer_size > vocab_size:
        raise ValueError(
            f"model.path={path!r}: the tokenizer has {tokenizer_size} tokens but the model's vocab_size is "
            f"{vocab_size}; the tokenizer and the weights belong to different models"
        )


def check_context(max_seq_len: int, model_config: Any, path: str) -> None:
    """A context past the model's positions is refused by SGLang at start and untrained for any engine: say so first."""
    positions = model_config.max_position_embeddings
    rope = getattr(model_config, "rope_scaling", None) or {}
    if rope.get("rope_type", "") in ("yarn", "dynamic", "linear"):  # these stretch the trained positions
        positions = int(positions * rope.get("factor", 1.0))
    if max_seq_len > positions:
        raise ValueError(
            f"rollout.max_seq_len={max_seq_len} exceeds the {positions} positions of the model at "
            f"model.path={path!r} (max_position_embeddings in its config.json); lower rollout.max_seq_len "
            "(with data.max_prompt_len and rollout.sampling.max_new_tokens)"
        )


def build(cfg: DictConfig, server_id: str, cleanup: contextlib.ExitStack, replica: int = 0) -> RolloutLoop:
    """Tokenizer, prompts, engine, reward pool and sockets, wired into one loop; cleanup closes them."""
    from transformers import AutoConfig, AutoTokenizer

    path = get(cfg, "model.path")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model_config = AutoConfig.from_pretrained(path)
    check_vocab(len(tokenizer), model_config.vocab_size, path)
    check_context(get(cfg, "rollout.max_seq_len"), model_config, path)
    # a prompt must leave room in the KV cache for a full response
    if get(cfg, "rollout.max_seq_len") <= get(cfg, "rollout.sampling.max_new_tokens"):
        raise ValueError(
            f"rollout.max_seq_len={get(cfg, 'rollout.max_seq_len')} leaves no room for a prompt "
            f"before rollout.sampling.max_new_tokens={get(cfg, 'rollout.sampling.max_new_tokens')}"
        )
    dataset = load_prompts(
        cfg,
        list(get(cfg, "data.train_files")),
        tokenizer,
        seed=get(cfg, "run.seed") + DATA_SEED_STRIDE * replica,
        shuffle=get(cfg, "data.shuffle"),
    )
    scheme = scheme_for(get(cfg, "rollout.quant"), get(cfg, "quant.fp8_granularity"))
    options = {}
    if get(cfg, "rollout.engine") == "sglang":
        from rollout_server.engines.sglang_args import placement

        options = placement(cfg, replica)
    engine = load_engine(
        path,
        engine=get(cfg, "rollout.engine"),
        quant=scheme,
        dtype=rollout_dtype(cfg),
        device=get(cfg, "rollout.device"),
        max_batch=get(cfg, "rollout.max_batch"),
        max_seq_len=get(cfg, "rollout.max_seq_len"),
        weight_bits=get(cfg, "quant.weight_bits"),
        int8_lm_head=int8_lm_head(cfg),
        **options,
    )
    if hasattr(engine, "close"):
        cleanup.callback(engine.close)
    if get(cfg, "sync.transport") == "nccl":
        log.info("joining the nccl weight group at %s as replica %d", get(cfg, "sync.group_endpoint"), replica)
        join_update_group(engine, cfg, replica)
    pool = cleanup.enter_context(
        RewardPool(get(cfg, "reward.name"), workers=get(cfg, "reward.workers"), timeout_s=get(cfg, "reward.timeout_s"))
    )
    sockets = open_sockets(cfg, server_id)
    cleanup.callback(sockets.close)
    loop = RolloutLoop(
        cfg,
        server_id=server_id,
        engine=engine,
        scheme=scheme,
        tokenizer=tokenizer,
        dataset=dataset,
        pool=pool,
        sockets=sockets,
        secret=get(cfg, "transport.secret").encode() or None,
        admission=Admission(),
        stop_ids=stop_token_ids(tokenizer, path),
        eval_set=load_eval_set(cfg, tokenizer),
        replica=replica,
        replaces_pid=predecessor_pid(),
    )
    cleanup.callback(loop.close)
    log.info(
        "ready: engine %s quant %s, %d prompts, pushing to %s",
        get(cfg, "rollout.engine"),
        scheme,
        len(dataset),
        get(cfg, "transport.trajectories"),
    )
    return loop


def main(argv: list[str] | None = None) -> int:
    cfg = parse(PROG, argv)
    problem = _auto_endpoint(cfg)
    if problem:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return EXIT_INPUT
    try:
        replica = replica_index()
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_INPUT
    server_id = f"rollout-{replica}-{os.getpid()}"
    logging.basicConfig(
        level=get(cfg, "log.level").upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {server_id} %(levelname)s %(message)s",
    )
    stop = threading.Event()
    caught: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        caught.append(signum)  # no logging here: the handler may interrupt a log call
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with contextlib.ExitStack() as cleanup:
        try:
            loop = build(cfg, server_id, cleanup, replica)
        except (DatasetError, RewardError, ValueError, OSError) as exc:
            print(f"{PROG}: {' '.join(str(exc).split())}", file=sys.stderr)
            return EXIT_INPUT  # bad data, reward module, model folder: a restart would fail the same way
        loop.run(stop)
        log.info("stopping on signal %s", caught[0] if caught else "?")
    log.info("stopped: %s", loop.book_counters())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
