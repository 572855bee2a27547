"""Verifiable rewards, scored in worker processes with a hard per-item timeout.

Built-in reward functions, chosen by name (config `reward.name`; the registry BUILTIN):
- ``math``: math-verify on the response's final answer against the gold answer. The final answer is
  the last ``\\boxed{...}``, else the last ``Answer: X`` line (the form DAPO-Math-17k and its AIME sets ask for),
  else the last ``#### X`` line, else the last "the answer is X".
- ``dapo``: DAPO's own verifier (verl's ``math_dapo``): in the response's last 300 characters, the last
  ``Answer: X`` (case-insensitive), else the last ``\\boxed{}`` of the last 100 characters, normalised as Minerva
  does (units, ``\\text{}``, ``$``, thousands separators dropped) and compared as strings with the normalised
  gold answer. It scores 1 or 0 (DAPO's -1 for a wrong answer is the same advantage after group normalisation).
- ``gsm8k``: grade-school math with a numeric gold answer. The final answer is, in this order, the
  last ``#### N``, else the last ``\\boxed{...}``, else the last number anywhere in the response.
  Thousands separators, currency signs, units and a trailing period are removed and the numbers are
  compared exactly (``1,234.50`` equals ``1234.5``); a boxed answer that is not a plain number
  (``\\frac{3}{4}``) goes to math-verify.
- ``arith``: exact integer match of the response's last line (or its last ``\\boxed{N}``).
- ``gym``: reasoning-gym's own verifier. The gold answer is the JSON ``{"task", "entry"}`` that
  ``qurl/real/gym.py`` writes; the final answer is the last ``<answer>...</answer>`` (the library's
  ``extract_answer``, with no fallback: an answer outside the tags is no answer, as in reasoning-gym's own
  evaluation), and the dataset's ``score_answer(answer, entry)`` judges it: 1 where it gives full marks, else 0.
  Its partial credit (the default ``score_answer`` gives len(gold) / len(answer) to an answer containing the gold
  one, so ``12`` for ``2`` earns 0.5) counts as wrong, so that the reward is the accuracy the evaluation reports
  and no policy is paid for padding a guess.
- ``package.module:function``: any ``function(response: str, answer: str) -> float``. It is
  imported and run inside the worker processes, never in the caller, so it may hang, crash or
  call ``signal.alarm``; the module must be importable from the caller's ``sys.path``.

math-verify's own timeouts (``signal.alarm``, whole seconds, and a timeout silently becomes a
wrong answer) are switched off: each worker runs one item at a time, and the pool kills a worker
whose item overruns ``timeout_s`` and starts a fresh one, so every timeout is counted.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import numbers
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

log = logging.getLogger(__name__)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_INT = re.compile(r"[+-]?\d+")
_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer is:?\s*([^\n]*)", re.IGNORECASE)
_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)  # DAPO's pattern: its prompts ask for it
# A number as people write it: optional sign and currency, thousands separators, decimals.
_NUMBER = re.compile(r"-?[$£€¥]?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?[$£€¥]?\s*\.\d+")


class RewardError(RuntimeError):
    """A reward pool that cannot start: bad reward name, or a function that cannot be imported."""


FAILED_STATUSES = ("error", "timeout", "nan")  # the verifier did not score (no_answer is the model's doing)


@dataclass(frozen=True)
class RewardResult:
    reward: float
    status: str  # ok | no_answer (a built-in reward found no final answer to read) | timeout | error | nan
    detail: str = ""


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``); None when the last one is unclosed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i = start = starts[-1]
    depth = 1
    while i < len(text):
        c = text[i]
        if c == "\\":  # \{ and \} are literal braces, not grouping
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _last_match(pattern: re.Pattern, text: str) -> str | None:
    found = pattern.findall(text)
    return found[-1].strip() if found else None


def _verify(pred: str, gold: str) -> bool:
    """math-verify equality of two answers written as LaTeX (without the surrounding box)."""
    from math_verify import parse, verify

    g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return bool(g and p and verify(g, p, timeout_seconds=None))


def math_final_answer(response: str) -> str | None:
    """The last boxed answer, else the last ``Answer: X``, else ``#### X``, else "the answer is X"; None if none."""
    pred = last_boxed(response)
    if pred is None:
        pred = _last_match(_ANSWER_LINE, response) or _last_match(_HASHES, response)
        pred = pred or _last_match(_ANSWER_IS, response)
        pred = pred.rstrip(".").strip("$* ") if pred else None
    return pred or None


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer (math_final_answer) equals the gold answer under math-verify."""
    pred = math_final_answer(response)
    if not pred:
        return 0.0
    gold = answer.strip()
    gold = last_boxed(gold) or gold.strip("$")  # gold answers sometimes come boxed or in $...$
    return 1.0 if _verify(pred, gold) else 0.0


# Minerva's answer normalisation, as DAPO's verifier applies it: replacements, then words and marks removed
_MINERVA_REPLACE = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_MINERVA_REMOVE = (
    *("square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits".split()),
    *("cents degrees cm gm pounds meters meals edges students childrentickets multiples".split()),
    *("\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}"),
    *("\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots"),
)
_MINERVA_REGEX = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # the first $...$ span, alone
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrta -> \sqrt{a}
)


def minerva_normalize(text: str) -> str:
    """A final answer as Minerva (and DAPO's verifier) compare it: the part after the last '=', without units."""
    text = text.split("=")[-1]
    for before, after in _MINERVA_REPLACE:
        text = text.replace(before, after)
    for word in _MINERVA_REMOVE:
        text = text.replace(word, "")
    for pattern, repl in _MINERVA_REGEX:
        text = pattern.sub(repl, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_final_answer(response: str) -> str | None:
    """What DAPO's verifier reads: the last ``Answer: X`` of the last 300 characters, else their last 100's box."""
    tail = response[-300:]
    found = _ANSWER_LINE.findall(tail)
    if found:
        return found[-1]
    return last_boxed(tail[-100:])


def dapo_reward(response: str, answer: str) -> float:
    """1.0 when the Minerva-normalised final answer (dapo_final_answer) equals the normalised gold answer."""
    pred = dapo_final_answer(response)
    return 1.0 if pred is not None and minerva_normalize(pred) == minerva_normalize(answer) else 0.0


def parse_number(text: str) -> Fraction | None:
    """The first number in text as an exact fraction, ignoring currency, thousands separators and units."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    digits = re.sub(r"[$£€¥,\s]", "", m.group())
    return Fraction(digits) if digits not in ("", "-") else None


def gsm8k_final_answer(response: str) -> str | None:
    """The text holding the final answer: last ``#### N``, else last boxed, else the last number in the response."""
    for candidate in (_last_match(_HASHES, response), last_boxed(response)):
        if candidate:
            return candidate
    numbers = _NUMBER.findall(response)
    return numbers[-1].strip() if numbers else None


def gsm8k_reward(response: str, answer: str) -> float:
    """1.0 when the response's final number equals the numeric gold answer (math-verify for a non-numeric box)."""
    gold = parse_number(answer) if _NUMBER.fullmatch(answer.strip()) else None
    if gold is None:
        raise ValueError(f"gsm8k reward needs a numeric gold answer, got {answer[:40]!r}")
    final = gsm8k_final_answer(response)
    if final is None:
        return 0.0
    if "\\" in final or re.search(r"\d\s*/\s*\d", final):  # \frac{3}{4}, 3/4: math-verify decides
        return 1.0 if _verify(final, answer.strip()) else 0.0
    got = parse_number(final)
    return 1.0 if got is not None and got == gold else 0.0


def _as_int(text: str) -> int | None:
    text = text.strip()
    return int(text) if _INT.fullmatch(text) else None


def arith_final_answer(response: str) -> str | None:
    """The last non-empty line if it is an integer, else the last boxed value; None when neither is an integer."""
    lines = response.strip().splitlines()
    if lines and _as_int(lines[-1]) is not None:
        return lines[-1]
    boxed = last_boxed(response)
    return boxed if boxed is not None and _as_int(boxed) is not None else None


def arith_reward(response: str, answer: str) -> float:
    """1.0 when the response's last non-empty line, or else its last boxed value, is the gold integer."""
    gold = _as_int(answer)
    if gold is None:
        raise ValueError(f"arith reward needs an integer gold answer, got {answer[:40]!r}")
    got = arith_final_answer(response)
    return 1.0 if got is not None and _as_int(got) == gold else 0.0


_GYM_SCORERS: dict[str, Callable[[str | None, dict], float]] = {}


def gym_final_answer(response: str) -> str | None:
    """The last <answer>...</answer> (reasoning-gym's extract_answer); None when there is none."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(response)


def gym_reward(response: str, answer: str) -> float:
    """1 where the task's own score_answer gives the final answer full marks, else 0; answer is {"task", "entry"}."""
    truth = json.loads(answer)
    task, entry = truth["task"], truth["entry"]
    if task not in _GYM_SCORERS:
        import reasoning_gym

        _GYM_SCORERS[task] = reasoning_gym.get_score_answer_fn(task)
    got = gym_final_answer(response)
    return 1.0 if got is not None and _GYM_SCORERS[task](got, entry) == 1.0 else 0.0


@dataclass(frozen=True)
class Builtin:
    """A built-in reward: its score, and the final answer it reads (None: the response gives it nothing to read)."""

    score: Callable[[str, str], float]
    final_answer: Callable[[str], str | None]
    reads: str  # the forms of a final answer it reads, for the no-answer warning
    preload: tuple[str, ...] = ()  # modules the reward workers' fork server imports once


BUILTIN: dict[str, Builtin] = {
    "math": Builtin(
        math_reward, math_final_answer, "\\boxed{X}, 'Answer: X', '#### X' or 'the answer is X'", ("math_verify",)
    ),
    "dapo": Builtin(dapo_reward, dapo_final_answer, "'Answer: X' or \\boxed{X} at the end"),
    "gsm8k": Builtin(gsm8k_reward, gsm8k_final_answer, "'#### N', \\boxed{N} or any number", ("math_verify",)),
    "arith": Builtin(arith_reward, arith_final_answer, "an integer on the last line or in \\boxed{}"),
    "gym": Builtin(gym_reward, gym_final_answer, "<answer>X</answer>", ("reasoning_gym",)),
}


def verifier_modules(name: str) -> tuple[str, ...]:
    """The modules a reward's workers import before taking items: the built-in's own, math_verify for a custom one."""
    return BUILTIN[name].preload if name in BUILTIN else ("math_verify",)


def resolve_reward_fn(name: str) -> Callable[[str, str], float]:
    """The reward function a name refers to; imports ``module:function`` names."""
    if name in BUILTIN:
        return BUILTIN[name].score
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise RewardError(
            f"reward.name: unknown reward {name!r}; allowed: {', '.join(BUILTIN)} or package.module:function"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"reward.name: cannot import {name!r}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise RewardError(f"reward.name: {name!r} is not callable")
    return fn


def _send(conn: mpc.Connection, obj: object) -> None:
    conn.send_bytes(json.dumps(obj).encode())  # JSON, not pickle, between parent and worker


def _exit_with_owner(lifeline: mpc.Connection) -> None:
    """Leave when the pool's owner dies, even while the main thread is stuck in a verifier."""
    # Only the owner holds the write end, and never writes: readable means EOF means it is gone.
    # (The parent pid does not tell: under forkserver it is the fork server, which outlives the owner
    # as long as any worker lives, because each worker inherits the server's liveness pipe.)
    lifeline.poll(None)
    os._exit(0)


def _worker_main(conn: mpc.Connection, lifeline: mpc.Connection, name: str) -> None:
    threading.Thread(target=_exit_with_owner, args=(lifeline,), daemon=True).start()
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warning is intended
    try:
        fn = resolve_reward_fn(name)
        extract = BUILTIN[name].final_answer if name in BUILTIN else None
        # Imported and warmed here, not on an item's clock: the shared fork server preloads only what the
        # process's first pool asked for, and math_verify's first check takes ~0.2 s (parser set-up).
        for module in verifier_modules(name):
            importlib.import_module(module)
        if "math_verify" in verifier_modules(name):
            math_reward("\\boxed{\\frac{1}{2}}", "0.5")
    except BaseException as e:  # noqa: BLE001  (report any import failure to the parent)
        _send(conn, ["fatal", f"{type(e).__name__}: {e}"])
        return
    _send(conn, ["ready"])
    while True:
        try:
            job, response, answer = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            value = fn(response, answer)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                msg = ["error", job, f"reward function returned {type(value).__name__}, expected a number"]
            elif value == 0 and extract is not None and extract(response) is None:
                msg = ["no_answer", job, 0.0]
            else:
                msg = ["ok", job, float(value)]
        except Exception as e:  # noqa: BLE001  (any verifier failure is reward 0, counted)
            msg = ["error", job, f"{type(e).__name__}: {e}"[:300]]
        _send(conn, msg)


class _Worker:
    def __init__(self, ctx: mp.context.BaseContext, name: str) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        lifeline, self._lifeline = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_worker_main, args=(child, lifeline, name), daemon=True, name="qurl-reward")
        self.proc.start()
        child.close()
        lifeline.close()
        self.ready = False
        self.job: int | None = None  # index of the item in flight
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()
        self._lifeline.close()


class RewardPool:
    """Scores (response, answer) pairs in worker processes; a hang or crash costs one item, never the caller.

    Each worker runs one item at a time. An item that overruns ``timeout_s`` gets reward 0 with
    status ``timeout`` and its worker is killed and replaced; a worker that dies gives status
    ``error``. Not thread-safe: call ``score`` from one thread.
    """

    def __init__(
        self,
        name: str = "math",
        workers: int = 2,
        timeout_s: float = 10.0,
        end_texts: Sequence[str] = (),
        start_method: str = "forkserver",
        startup_timeout_s: float = 120.0,
    ) -> None:
        if workers < 1:
            raise RewardError(f"reward.workers: must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise RewardError(f"reward.timeout_s: must be > 0, got {timeout_s}")
        if name not in BUILTIN:
            resolve_reward_fn(name)  # fail here, in one line, rather than in every worker
        self.name, self.timeout_s, self.end_texts = name, float(timeout_s), tuple(end_texts)
        self.startup_timeout_s = startup_timeout_s
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Workers fork from a server that has these imported (math_verify takes ~1 s), so a
            # replacement is ready quickly. The fork server is shared: the first pool sets this.
            self._ctx.set_forkserver_preload(["qurl.rewards", *verifier_modules(name)])
        self.counters = {
            "reward/scored": 0,
            "reward/no_answer": 0,
            "reward/timeouts": 0,
            "reward/errors": 0,
            "reward/nan": 0,
            "reward/worker_restarts": 0,
        }
        self._workers = [_Worker(self._ctx, name) for _ in range(workers)]
        self._wait_ready()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker."""
        for w in self._workers:
            w.kill()
        self._workers = []

    def metrics(self) -> dict[str, int]:
        """Counters since start, for the metrics log."""
        return dict(self.counters)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not all(w.ready for w in self._workers):
            if time.monotonic() > deadline:
                self.close()
                raise RewardError(f"reward workers for {self.name!r} not ready after {self.startup_timeout_s:g} s")
            self._poll(deadline - time.monotonic(), results=[])

    def _strip(self, response: str) -> str:
        changed = True
        while changed:
            changed = False
            response = response.rstrip()
            for t in self.end_texts:
                if t and response.endswith(t):
                    response, changed = response[: -len(t)], True
        return response

    def score(self, items: Iterable[tuple[str, str]]) -> list[RewardResult]:
        """One RewardResult per (response, answer), in order; at worst ~ceil(n / workers) * timeout_s."""
        if not self._workers:
            raise RewardError("reward pool is closed")
        items = [(self._strip(r), str(a)) for r, a in items]
        results: list[RewardResult | None] = [None] * len(items)
        pending = deque(range(len(items)))
        while pending or any(w.job is not None for w in self._workers):
            for i, w in enumerate(self._workers):
                if pending and w.ready and w.job is None:
                    job = pending.popleft()
                    try:
                        _send(w.conn, [job, *items[job]])
                    except OSError:  # died while idle: the item goes to another worker
                        pending.appendleft(job)
                        self._replace(i)
                        continue
                    w.job, w.deadline = job, time.monotonic() + self.timeout_s
            busy = [w.deadline for w in self._workers if w.job is not None]
            wait_s = min(busy) - time.monotonic() if busy else self.startup_timeout_s
            if not self._poll(wait_s, results) and not busy:
                self.close()
                raise RewardError(f"reward workers for {self.name!r} not ready after {self.startup_timeout_s:g} s")
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.job is not None and now >= w.deadline:
                    results[w.job] = RewardResult(0.0, "timeout", f"no result within {self.timeout_s:g} s")
                    self.counters["reward/timeouts"] += 1
                    log.warning(
                        "reward %r: item timed out after %g s; restarting its worker", self.name, self.timeout_s
                    )
                    self._replace(i)
        self.counters["reward/scored"] += len(items)
        return results  # type: ignore[return-value]

    def _poll(self, wait_s: float, results: list[RewardResult | None]) -> int:
        """Wait up to wait_s for worker messages or exits, handle them, and say how many came."""
        by_handle: dict[object, _Worker] = {}
        for w in self._workers:
            by_handle[w.conn] = w
            by_handle[w.proc.sentinel] = w
        ready = mpc.wait(list(by_handle), timeout=max(wait_s, 0.0))
        for h in ready:
            w = by_handle[h]
            if w not in self._workers:  # replaced while handling an earlier handle
                continue
            try:
                while w.conn.poll():  # drain first: a worker may answer and then exit
                    self._handle(w, json.loads(w.conn.recv_bytes()), results)
            except (EOFError, OSError):
                w.proc.join(5.0)
            if not w.proc.is_alive():
                self._died(w, results)
        return len(ready)

    def _handle(self, w: _Worker, msg: list, results: list[RewardResult | None]) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
        elif kind == "fatal":
            self.close()
            raise RewardError(f"reward.name: worker cannot load {self.name!r}: {msg[1]}")
        elif msg[1] == w.job:
            results[w.job] = self._result(kind, msg[2])
            w.job = None

    def _result(self, kind: str, value: float | str) -> RewardResult:
        if kind == "no_answer":
            self.counters["reward/no_answer"] += 1
            return RewardResult(0.0, "no_answer", f"no final answer {self.name!r} can read")
        if kind == "error":
            self.counters["reward/errors"] += 1
            return RewardResult(0.0, "error", str(value))
        if not math.isfinite(value):
            self.counters["reward/nan"] += 1
            return RewardResult(0.0, "nan", f"reward function returned {value}")
        return RewardResult(value, "ok")

    def _died(self, w: _Worker, results: list[RewardResult | None]) -> None:
        code = w.proc.exitcode
        if w.job is not None:
            results[w.job] = RewardResult(0.0, "error", f"reward worker died with exit code {code}")
            self.counters["reward/errors"] += 1
            log.warning("reward %r: worker died with exit code %s; restarting it", self.name, code)
        elif not w.ready:
            self.close()
            raise RewardError(f"reward.name: worker for {self.name!r} died at start with exit code {code}")
        self._replace(self._workers.index(w))

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx, self.name)
        self.counters["reward/worker_restarts"] += 1
