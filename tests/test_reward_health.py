"""learner/reward_health.py: the share of failed scores that stops a run, and the first failure it keeps."""

from learner.reward_health import MIN_SEEN, WINDOW, RewardHealth


def _details(ok: int, error: int = 0, nan: int = 0, no_answer: int = 0) -> list[dict]:
    return (
        [{"status": "ok"}] * ok
        + [{"status": "error", "detail": "KeyError: 'expected_answer'"}] * error
        + [{"status": "nan"}] * nan
        + [{"status": "no_answer"}] * no_answer
    )


def test_the_first_failure_is_returned_once_and_the_share_stops_the_run_past_the_limit():
    health = RewardHealth(0.5, "mod:score")
    assert health.observe(_details(32)) is None and health.problem() is None
    first = health.observe(_details(10, error=12, nan=10))  # 22 of 64 failed: 34%
    assert first == "error: KeyError: 'expected_answer'"
    assert health.problem() is None
    assert health.observe(_details(0, error=20, nan=12)) is None  # 54 of 96: 56%, and the first stays the first
    line = health.problem()
    assert line.startswith("reward.name=mod:score: 54 of the last 96 scores failed (32 error, 22 nan; 56% > ")
    assert "reward.max_error_frac=0.5" in line and "first: error: KeyError: 'expected_answer'" in line


def test_no_verdict_on_few_scores_no_answer_is_not_a_failure_and_old_scores_leave_the_window():
    health = RewardHealth(0.5, "gym")
    health.observe(_details(0, error=MIN_SEEN - 1))
    assert health.problem() is None  # too few to judge
    health.observe(_details(0, no_answer=WINDOW))  # the model's doing, not the verifier's: and the errors scroll out
    assert health.problem() is None and len(health.window) == WINDOW
    off = RewardHealth(1.0, "gym")
    off.observe(_details(0, error=WINDOW))
    assert off.problem() is None  # reward.max_error_frac=1: never
