"""learner/evaluation.py: eval/acc_fp off the collectives. The real evaluator on the demo model, real gloo groups."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from datetime import timedelta

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo_cfg(demo_dir, *overrides):
    from qurl.config import load_config

    return load_config(
        os.path.join(ROOT, "configs", "demo-cpu.yaml"),
        [
            f"model.path={demo_dir}/model",
            f"data.train_files=[{demo_dir}/train.jsonl]",
            f"data.eval_files=[{demo_dir}/heldout.jsonl]",
            *overrides,
        ],
    )


class Rows:
    """A MetricsLogger's log(step, row) and nothing else: what the evaluation logs, in order."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log(self, step: int, row: dict) -> None:
        self.rows.append((step, row))


def _rank(rank: int, port: int, demo_dir: str, queue, ready) -> None:
    import torch.distributed as dist

    from learner.evaluation import Evaluation, FpEvaluator

    torch.set_num_threads(1)
    # 16,384 problems (the training file's, as held-out) take the demo model ~10 s with the CPU kernels (4,096 took
    # 2.5 s): longer than the timeout below
    cfg = demo_cfg(demo_dir, f"data.eval_files=[{demo_dir}/train.jsonl]", "eval.max_problems=16384")
    evaluator = FpEvaluator.from_config(cfg, torch.device("cpu")) if rank == 0 else None
    if rank == 0:
        ready.set()
    ready.wait(120)  # the ranks meet once rank 0's evaluator is built (the learner builds it before any collective)
    # a 3 s collective timeout, shorter than rank 0's evaluation
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=3)
    )
    rows = Rows()
    evaluation = Evaluation(evaluator, None, "int8", every=0, steps=1, mode="inline", enabled=True)
    try:
        started = time.perf_counter()
        if rank == 0:
            state = {k: v.clone() for k, v in evaluator.model.state_dict().items()}
            evaluation.start(state, version=0)
        reported = evaluation.hold(0, rows if rank == 0 else None)  # the step's time/eval_s
        held = time.perf_counter() - started
        dist.barrier()  # the ranks left the hold together
        queue.put((rank, held, reported, [row for _, row in rows.rows]))
    except Exception as exc:  # noqa: BLE001
        queue.put((rank, -1.0, -1.0, f"{type(exc).__name__}: {exc}"[:300]))
    finally:
        if evaluator is not None:
            evaluator.close()
        dist.destroy_process_group()


def test_an_inline_evaluation_longer_than_the_collective_timeout_holds_every_rank(demo_dir):
    """The learner before: rank 0 evaluated while rank 1 sat in one collective, whose timeout ended the run. Now rank
    1 meets rank 0 every 0.5 s until the evaluation is done, so a 3 s timeout outlasts a longer evaluation. The hold
    reports its own length (time/eval_s), which throughput figures leave out."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = ctx.Event()
    procs = [ctx.Process(target=_rank, args=(r, port, str(demo_dir), queue, ready)) for r in range(2)]
    for p in procs:
        p.start()
    results = {r: (held, reported, rows) for r, held, reported, rows in (queue.get(timeout=240) for _ in procs)}
    for p in procs:
        p.join(30)
    assert all(held > 0 for held, _, _ in results.values()), results
    assert results[0][0] > 3.0 and results[1][0] > 3.0, results  # longer than the timeout, for both ranks
    assert all(3.0 < reported <= held for held, reported, _ in results.values()), results
    (row,) = results[0][2]
    assert row["eval/version"] == 0 and 0.0 <= row["eval/acc_fp"] <= 1.0


def test_a_background_evaluation_lets_training_go_on_and_is_logged_when_done(demo_dir):
    from learner.evaluation import Evaluation, FpEvaluator, acc_fp_mode

    cfg = demo_cfg(demo_dir, "eval.acc_fp=background", "eval.max_new_tokens=4")
    assert acc_fp_mode(cfg, torch.device("cpu")) == "background"
    evaluator = FpEvaluator.from_config(cfg, torch.device("cpu"))
    assert evaluator.max_new_tokens == 4  # the cap, not rollout.sampling.max_new_tokens
    evaluation = Evaluation(evaluator, None, "int8", every=2, steps=4, mode="background", enabled=True)
    rows = Rows()
    try:
        evaluation.start({k: v.clone() for k, v in evaluator.model.state_dict().items()}, version=3)
        assert evaluation.busy()
        evaluation.start({}, version=4)  # one at a time: this version gets no acc_fp
        evaluation.log_fp(5, rows)  # still generating: nothing yet
        assert evaluation.hold(5, None) == 0.0  # nothing held: training goes on (None: nothing logged here)
        deadline = time.monotonic() + 120
        while evaluation.busy() and time.monotonic() < deadline:
            time.sleep(0.1)
        evaluation.log_fp(6, rows)
    finally:
        evaluation.close()
    assert [(step, row["eval/version"]) for step, row in rows.rows] == [(6, 3)]
    assert 0.0 <= rows.rows[0][1]["eval/acc_fp"] <= 1.0


def test_acc_fp_none_still_asks_for_the_quantized_eval_and_auto_is_inline_on_the_cpu(demo_dir):
    from learner.evaluation import FpEvaluator, acc_fp_mode

    assert FpEvaluator.from_config(demo_cfg(demo_dir, "eval.acc_fp=none"), torch.device("cpu")) is None
    assert acc_fp_mode(demo_cfg(demo_dir), torch.device("cpu")) == "inline"
    assert acc_fp_mode(demo_cfg(demo_dir), torch.device("cuda", 0)) == "background"


@pytest.mark.parametrize("tokens", [0, 4])
def test_the_eval_answer_cap_is_one_setting_for_both_engines(demo_dir, tokens):
    """eval.max_new_tokens caps eval/acc_fp here and eval/acc_quant on the server (rollout_server/loop.py)."""
    from qurl.evaluate import eval_max_new_tokens

    cfg = demo_cfg(demo_dir, f"eval.max_new_tokens={tokens}")
    assert eval_max_new_tokens(cfg) == (tokens or cfg.rollout.sampling.max_new_tokens)
    with pytest.raises(Exception, match="eval.max_new_tokens=99 is out of range"):
        demo_cfg(demo_dir, "eval.max_new_tokens=99")
