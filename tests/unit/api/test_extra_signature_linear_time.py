"""Users' extra signatures match in time linear in the line, whatever pattern validation accepts.

A VLMDeployment author's regex runs on every line of every pod in the follower threads; one
backtracking pattern (`abc(?:x|x)+y` under Python's re: 11 s at 30 characters, never at 8,192)
would stall the operator for every tenant. Each example compiles a pattern the way the operator
does, builds adversarial lines (the literal start, then a pumped run of what the pattern's
repetitions can eat, then a character that makes the match fail late), and takes the best
matching time at 1,024, 2,048, 4,096 and 8,192 characters in one process. Linear time at most
doubles per doubling of the line; quadratic quadruples, exponential never ends. RE2 switches
engines with the text's size (a bit-state backtracker on short texts, then an NFA or DFA, each
linear with its own constant), which can make one doubling jump, so the smallest of the three
ratios must stay under 3. Matching runs in a worker process, so a pattern that never finishes
fails the test (the worker is killed) instead of hanging it.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vlm_operator.api.log_signatures import SignatureConfigError, compile_spec_signatures
from vlm_operator.logs.matcher import MAX_MESSAGE, LogLine, match

LENGTHS = (MAX_MESSAGE // 8, MAX_MESSAGE // 4, MAX_MESSAGE // 2, MAX_MESSAGE)
BOUND = 3.0  # per doubling: linear 2 (less with per-call overhead), quadratic 4
HANG_S = 120  # a linear match of 8 KiB takes microseconds: this only catches runaway patterns

ATOMS = ["x", "a", "xa", r"\w", r"\s", r"\d", r"\S", ".", "[ax]", "[^y]", "(?:x|x)",
         "(?:a|xa?)", "(?:x|a|xa)", r"\b", "(?:)"]
QUANTIFIERS = ["*", "+", "?", "{2,}", "{1,5}", "*?", "+?", "{0,40}"]


def _regex_bodies():
    atom = st.sampled_from(ATOMS)

    def extend(inner):
        quantified = st.tuples(inner, st.sampled_from(QUANTIFIERS)).map(
            lambda t: f"(?:{t[0]}){t[1]}")
        concat = st.lists(inner, min_size=2, max_size=4).map("".join)
        alternation = st.lists(inner, min_size=2, max_size=3).map(
            lambda xs: "(?:" + "|".join(xs) + ")")
        captured = inner.map(lambda x: f"({x})")
        return quantified | concat | alternation | captured

    return st.recursive(atom, extend, max_leaves=8)


def _line(pump: str, length: int) -> LogLine:
    """A record-start ERROR line whose message is the literal start, the pump, then `!`."""
    message = ("abc" + pump * length)[:length - 1] + "!"
    return LogLine(message=message, level="ERROR", time="11-29 09:00:00", file="worker.py",
                   lineno=1)


def best_seconds(regex: str, pump: str) -> list[float] | None:
    """In the worker: best time of a batch of matches at each length (None: refused)."""
    try:
        extra = compile_spec_signatures([{"name": "user", "regex": regex}])
    except SignatureConfigError:
        return None
    lines = [_line(pump, n) for n in LENGTHS]
    best = [float("inf")] * len(LENGTHS)
    for _ in range(5):
        for i, line in enumerate(lines):
            start = time.perf_counter()
            for _ in range(4):
                match(line, extra=extra)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


class Worker:
    def __init__(self) -> None:
        self.pool = self._start()

    @staticmethod
    def _start():
        return multiprocessing.get_context("fork").Pool(1)

    def ratio(self, regex: str, pump: str) -> float | None:
        """The smallest growth per doubling of the line, best of three measurements (noise
        only ever raises it)."""
        ratios = []
        for _ in range(3):
            pending = self.pool.apply_async(best_seconds, (regex, pump))
            try:
                times = pending.get(HANG_S)
            except multiprocessing.TimeoutError:
                self.pool.terminate()
                self.pool = self._start()
                raise AssertionError(
                    f"{regex!r} did not match {LENGTHS} characters within {HANG_S} s"
                ) from None
            if times is None:
                return None
            ratios.append(min(b / a for a, b in itertools.pairwise(times)))
            if ratios[-1] <= BOUND:
                break
        return min(ratios)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.pool.terminate()


@settings(max_examples=200, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(body=_regex_bodies(), tail=st.sampled_from(["y", "z", "$", "", "(?:y|z)"]),
       pump=st.text(alphabet="xa 0", min_size=1, max_size=3))
@example(body="(?:x|x)+", tail="y", pump="x")  # the patterns
@example(body=r"\w*\w*\w*\w*", tail="z", pump="a")
@example(body="(?:(?:x+)+)+", tail="$", pump="x")
@example(body="(?:x|xa?)*(?:a|xa)*", tail="y", pump="xa")
@example(body=r"((?:(?:\w){0,40})*)", tail="", pump="0")  # RE2 changes engine past 4 KiB
@example(body=r"(?:(?:[\w\s]*[^y]){1,30}){1,30}", tail="y", pump="x")  # RE2's DFA gives up
def test_accepted_patterns_match_in_linear_time(worker, body, tail, pump):
    regex = "abc" + body + tail
    ratio = worker.ratio(regex, pump)
    if ratio is None:  # refused at validation: never runs in the operator
        return
    assert ratio <= BOUND, (
        f"{regex!r} on {pump!r}: every doubling of the line made matching {ratio:.1f}x slower")
