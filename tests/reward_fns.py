"""Misbehaving reward functions for tests; imported by name ("reward_fns:chaos") inside reward workers."""

import os
import time

from qurl.rewards import math_reward


def chaos(response: str, answer: str) -> float:
    """Misbehave as the response says (HANG, SPIN, CRASH, RAISE, NAN, INF, STR, ALARM ...); else the math reward."""
    if response == "HANG":
        time.sleep(3600)
    if response == "SPIN":
        while True:
            pass
    if response == "CRASH":
        os._exit(3)
    if response == "RAISE":
        raise ValueError("verifier exploded")
    if response == "NAN":
        return float("nan")
    if response == "INF":
        return float("inf")
    if response == "STR":
        return "1.0"  # type: ignore[return-value]
    if response.startswith("ALARM "):  # math_verify with its default signal.alarm timeouts
        from math_verify import parse, verify

        return float(verify(parse("$" + answer + "$"), parse(response[len("ALARM ") :])))
    return math_reward(response, answer)


not_callable = 42


def flaky(response: str, answer: str) -> float:
    """A verifier that hangs, crashes, raises or returns NaN for some answers (by value), else the arith reward."""
    from qurl.rewards import arith_reward

    key = int(answer) % 10
    if key == 1:
        time.sleep(3600)
    if key == 2:
        os._exit(3)
    if key == 3:
        return float("nan")
    if key == 4:
        raise ValueError("verifier exploded")
    return arith_reward(response, answer)


def constant(response: str, answer: str) -> float:
    """A reward that carries no signal: every sample of every group scores the same."""
    return 0.0


def mostly_broken(response: str, answer: str) -> float:
    """A custom verifier with bugs on two answers in three: raises on one, returns a string on another."""
    from qurl.rewards import arith_reward

    key = int(answer) % 3
    if key == 0:
        raise KeyError("expected_answer")
    if key == 1:
        return "1.0"  # type: ignore[return-value]
    return arith_reward(response, answer)


def imported(response: str, answer: str) -> float:
    """1 where the module the answer names was imported before this call (a worker's verifier modules)."""
    import sys

    return float(answer in sys.modules)
