"""Reward functions and the worker pool: math-verify cases, arith, and hung/crashing/NaN verifiers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qurl.rewards import (
    RewardError,
    RewardPool,
    RewardResult,
    arith_reward,
    dapo_reward,
    gsm8k_final_answer,
    gsm8k_reward,
    last_boxed,
    math_final_answer,
    math_reward,
    minerva_normalize,
)

TESTS = Path(__file__).parent
TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def pool():
    if str(TESTS) not in sys.path:  # workers inherit sys.path, so they can import reward_fns
        sys.path.insert(0, str(TESTS))
    with RewardPool("reward_fns:chaos", workers=2, timeout_s=TIMEOUT_S, end_texts=("<|im_end|>",)) as p:
        yield p


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{\\left\\{ x \\right.} end", "\\left\\{ x \\right."),  # an escaped brace does not open a group
        ("\\boxed {7}", "7"),
        ("\\fbox{8}", "8"),
        ("no box here", None),
        ("\\boxed{3} and an unclosed \\boxed{4", None),
    ],
)
def test_last_boxed(text: str, boxed: str | None) -> None:
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    "response, gold",
    [
        ("So \\boxed{42}", "42"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{1/2}", "\\frac12"),
        ("\\boxed{\\dfrac{3}{4}}", "0.75"),
        ("\\boxed{\\sqrt{4}}", "2"),
        ("\\boxed{\\pi \\cdot 2}", "2\\pi"),
        ("\\boxed{\\frac{1}{2}\\sqrt{3}}", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed{1+x}", "x+1"),
        ("\\boxed{10.0}", "10"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"),
        ("first \\boxed{3}, finally \\boxed{7}", "7"),
        ("\\boxed{7}", "\\boxed{7}"),  # gold given boxed
        ("\\boxed{7}", "$7$"),  # gold given in math mode
        ("The answer is 72.", "72"),  # no box: "the answer is X"
        ("48 / 2 = 24 clips in May.\n48 + 24 = 72\n#### 72", "72"),  # no box: the GSM8K "#### X" line
        ("so the answer is: \\frac{1}{2}", "0.5"),
    ],
)
def test_math_equal(response: str, gold: str) -> None:
    assert math_reward(response, gold) == 1.0


@pytest.mark.parametrize(
    "response, gold",
    [
        ("42 is what I get", "42"),  # no boxed answer, no "#### X", no "the answer is"
        ("The answer is 41.", "42"),
        ("\\boxed{41}\n#### 42", "42"),  # a box comes before "####" for math
        ("\\boxed{41}", "42"),  # wrong
        ("\\boxed{\\frac{1}{3}}", "0.5"),
        ("\\boxed{42} no wait \\boxed{43}", "42"),  # last boxed wins
        ("\\boxed{42} and then \\boxed{4", "42"),  # last boxed unclosed: no answer
        ("\\boxed{}", "42"),
        ("\\boxed{2\\pi}", "\\pi"),
    ],
)
def test_math_not_equal(response: str, gold: str) -> None:
    assert math_reward(response, gold) == 0.0


@pytest.mark.parametrize(
    "response, gold, reward",
    [
        ("579", "579", 1.0),
        ("  579\n", "579", 1.0),
        ("+579", "579", 1.0),
        ("-12", "-12", 1.0),
        ("007", "7", 1.0),
        ("12+34=46\n46+56=102\n102", "102", 1.0),  # the demo's step format: answer on the last line
        ("I think \\boxed{579}", "579", 1.0),
        ("578", "579", 0.0),
        ("579.0", "579", 0.0),
        ("5 79", "579", 0.0),
        ("1_000", "1000", 0.0),
        ("", "579", 0.0),
        ("579 is it", "579", 0.0),
    ],
)
def test_arith(response: str, gold: str, reward: float) -> None:
    assert arith_reward(response, gold) == reward


@pytest.mark.parametrize(
    "response, gold, reward",
    [
        # GSM8K's own solution form, and SmolLM2-135M's real outputs on GSM-Symbolic prompts
        (
            "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72",
            "72",
            1.0,
        ),
        ("The number of girls in the field is 10 + 4 = 14\n#### 14", "14", 1.0),
        ("So they have 11168 minutes.\n\n#### 11168\n#### 11168\n#### 111", "11168", 0.0),  # cut mid-number
        ("#### N = 100\n#### N = 100", "100", 1.0),  # the model copied the N of the instruction
        ("She spent £12 + £21 + £38 + £6 = £77.\n#### £77", "77", 1.0),  # currency
        ("#### $1,234.50", "1234.5", 1.0),  # thousands separator and trailing zero
        ("#### 1,234", "1234", 1.0),
        ("#### 72 dollars", "72", 1.0),  # units
        ("#### 12.5 hours.", "12.5", 1.0),
        ("#### 50%", "50", 1.0),
        ("#### -5", "-5", 1.0),
        ("#### 72", "72.0", 1.0),
        ("#### 8\nThen she buys 9 more.", "8", 1.0),  # "####" wins over a later number
        ("#### 8\n\\boxed{9}", "9", 0.0),  # "####" wins over a box
        ("So she pays \\boxed{\\$1,200}.", "1200", 1.0),
        ("\\boxed{72 \\text{ dollars}}", "72", 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),  # not a plain number: math-verify
        ("#### 3/4", "0.75", 1.0),
        ("She has 3 + 4 = 7 apples left.", "7", 1.0),  # no marker: the last number
        ("She has 7 apples, then 3 more.", "7", 0.0),
        ("The total is 1,000,000.", "1000000", 1.0),
        ("I do not know.", "7", 0.0),
        ("#### 71", "72", 0.0),
        ("#### 7.2", "72", 0.0),
        ("", "72", 0.0),
    ],
)
def test_gsm8k(response: str, gold: str, reward: float) -> None:
    assert gsm8k_reward(response, gold) == reward


def test_gsm8k_final_answer_order() -> None:
    assert gsm8k_final_answer("\\boxed{3} then #### 4") == "4"
    assert gsm8k_final_answer("6 apples and \\boxed{3}, 9") == "3"
    assert gsm8k_final_answer("6 apples and 9") == "9"
    assert gsm8k_final_answer("no digits") is None


def test_gsm8k_refuses_non_numeric_gold() -> None:
    with pytest.raises(ValueError, match="numeric gold"):
        gsm8k_reward("#### 1", "x+1")


def test_arith_refuses_non_integer_gold() -> None:
    with pytest.raises(ValueError, match="integer gold"):
        arith_reward("1", "1.5")


@pytest.mark.parametrize(
    "name, match",
    [
        ("nonsense", "allowed: math, dapo, gsm8k, arith"),
        ("no_such_module_xyz:f", "cannot import"),
        ("reward_fns:missing", "cannot import"),
        ("reward_fns:not_callable", "not callable"),
    ],
)
def test_bad_reward_name(name: str, match: str) -> None:
    sys.path.insert(0, str(TESTS))
    try:
        with pytest.raises(RewardError, match=match):
            RewardPool(name, workers=1, timeout_s=1.0)
    finally:
        sys.path.remove(str(TESTS))


def test_pool_scores_in_order(pool: RewardPool) -> None:
    items = [("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{3}", "4"), ("none", "1"), ("\\boxed{2}<|im_end|>", "2")] * 3
    assert [r.reward for r in pool.score(items)] == [1.0, 0.0, 0.0, 1.0] * 3
    assert all(r.status == "ok" for r in pool.score(items))
    assert pool.score([]) == []


def test_custom_function_may_use_signal_alarm(pool: RewardPool) -> None:
    res = pool.score([("ALARM \\boxed{0.5}", "\\frac{1}{2}"), ("ALARM \\boxed{0.4}", "\\frac{1}{2}")])
    assert [(r.reward, r.status) for r in res] == [(1.0, "ok"), (0.0, "ok")]  # runs in the worker's main thread


@pytest.mark.parametrize("kind", ["HANG", "SPIN"])
def test_hanging_verifier_times_out(pool: RewardPool, kind: str) -> None:
    before = pool.metrics()
    t0 = time.monotonic()
    res = pool.score([(kind, "1"), ("\\boxed{5}", "5")])
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT_S + 5  # a bound, not a benchmark
    assert res[0] == RewardResult(0.0, "timeout", f"no result within {TIMEOUT_S:g} s")
    assert res[1].reward == 1.0 and res[1].status == "ok"  # the other worker kept scoring
    after = pool.metrics()
    assert after["reward/timeouts"] == before["reward/timeouts"] + 1
    assert after["reward/worker_restarts"] == before["reward/worker_restarts"] + 1
    # the replacement worker scores correctly
    assert [r.reward for r in pool.score([("\\boxed{6}", "6")] * 4)] == [1.0] * 4


def test_crash_error_nan_are_zero_and_counted(pool: RewardPool) -> None:
    before = pool.metrics()
    res = pool.score([("CRASH", "1"), ("RAISE", "1"), ("NAN", "1"), ("INF", "1"), ("STR", "1"), ("\\boxed{9}", "9")])
    assert [r.reward for r in res] == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert [r.status for r in res] == ["error", "error", "nan", "nan", "error", "ok"]
    assert "exit code 3" in res[0].detail and "verifier exploded" in res[1].detail
    after = pool.metrics()
    assert after["reward/errors"] - before["reward/errors"] == 3
    assert after["reward/nan"] - before["reward/nan"] == 2
    assert after["reward/timeouts"] == before["reward/timeouts"]
    assert after["reward/worker_restarts"] - before["reward/worker_restarts"] == 1
    assert [r.reward for r in pool.score([("\\boxed{0.5}", "\\frac{1}{2}")] * 3)] == [1.0] * 3


def test_many_hangs_in_one_batch_still_bounded(pool: RewardPool) -> None:
    t0 = time.monotonic()
    res = pool.score([("HANG", "1")] * 2 + [("\\boxed{1}", "1")] * 4)
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    assert [r.status for r in res] == ["timeout"] * 2 + ["ok"] * 4


def test_spawn_pool_builtin_math() -> None:
    with RewardPool("math", workers=1, timeout_s=30.0, start_method="spawn") as p:
        res = p.score([("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{2}", "3"), ("I think it is 3", "3")])
    assert [r.reward for r in res] == [1.0, 0.0, 0.0]
    # a wrong answer is a wrong answer; a response with no final answer in a form math reads is told apart
    assert [r.status for r in res] == ["ok", "ok", "no_answer"]
    assert p.metrics()["reward/no_answer"] == 1


def test_workers_import_their_verifier_before_taking_items() -> None:
    """Not on an item's clock: the shared fork server preloads only what the process's first pool named."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    with RewardPool("reward_fns:imported", workers=1, timeout_s=30.0, start_method="spawn") as p:
        res = p.score([("", "math_verify"), ("", "reasoning_gym")])
    assert [r.reward for r in res] == [1.0, 0.0]  # a custom verifier gets math_verify, and nothing it did not ask for


@pytest.mark.parametrize(
    "response, reward",
    [
        ("Step 1 ... step 9.\nAnswer: 34", 1.0),  # the last line DAPO's prompts ask for
        ("answer: 34", 1.0),  # DAPO's pattern ignores case
        ("Answer: 12\nI made a mistake.\nAnswer: 34", 1.0),  # the last one
        ("Answer: $34$", 1.0),
        ("Answer: 34 degrees", 1.0),  # Minerva's normalisation drops units
        ("Answer: 3,400", 0.0),  # a different number
        ("Answer: 35", 0.0),
        ("... so it is \\boxed{34}", 1.0),  # no Answer: line: the box near the end
        ("Answer: 34" + " padding" * 60, 0.0),  # only the last 300 characters are read
        ("34", 0.0),
    ],
)
def test_dapo_reads_the_last_answer_line_as_dapo_does(response: str, reward: float) -> None:
    assert dapo_reward(response, "34") == reward


def test_minerva_normalisation() -> None:
    assert minerva_normalize("x = \\frac12") == "\\frac{1}{2}"
    assert minerva_normalize("$1,234$") == "1234"
    assert minerva_normalize("\\text{5 inches}") == "5"
    assert minerva_normalize("90^\\circ") == "90"


def test_math_reads_the_answer_line_too() -> None:
    assert math_reward("Reasoning...\nAnswer: \\frac{4}{3}", "\\frac{4}{3}") == 1.0
    assert math_reward("**Final Answer:** 12", "12") == 1.0
    assert math_final_answer("the value is 12") is None


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out.update(kids)
            todo.extend(kids)
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_workers_exit_when_caller_is_killed() -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from qurl.rewards import RewardPool
        if __name__ == "__main__":
            pool = RewardPool("reward_fns:chaos", workers=2, timeout_s=600)
            print("ready", flush=True)
            pool.score([("HANG", "1"), ("HANG", "1")])
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # both workers are inside the hanging verifier
        kids = _descendants(proc.pid)
        assert len(kids) >= 2
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(k) for k in kids):
        time.sleep(0.1)
    assert [k for k in kids if _running(k)] == []


def _running(pid: int) -> bool:
    try:
        return "(zombie)" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_worker_killed_while_idle_is_replaced(pool: RewardPool) -> None:
    before = pool.metrics()["reward/worker_restarts"]
    for w in pool._workers:
        os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.join(5)
    res = pool.score([("\\boxed{4}", "4"), ("\\boxed{5}", "4")] * 2)
    assert [(r.reward, r.status) for r in res] == [(1.0, "ok"), (0.0, "ok")] * 2
    assert pool.metrics()["reward/worker_restarts"] == before + 2


def test_closed_pool_refuses() -> None:
    p = RewardPool("arith", workers=1, timeout_s=5.0)
    assert [r.reward for r in p.score([("12", 12), ("13<|im_end|>", "13")])] == [1.0, 0.0]  # no end_texts here
    p.close()
    with pytest.raises(RewardError, match="closed"):
        p.score([("1", "1")])
