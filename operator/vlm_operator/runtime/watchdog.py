"""The watchdog: every loop of the operator beats once per completed round (a round that failed
still completed; its error is reported where it happened). A loop that has not beaten in
FACTOR times its period is stuck (a call without an answer, a deadlock) and is reported three
ways: a warning in the log when it stalls and a line when it runs again; the gauges
vlm_operator_loop_stalled and vlm_operator_loop_seconds_since_round (vlm_operator_rounds_stalled
counts VLMDeployments whose own round is stuck); and the condition OperatorStalled on the
VLMDeployments it serves: all of them for the operator-wide loops, one for its own round.

Loops named ROUND_PREFIX + "<namespace>/<name>" are a VLMDeployment's round (runtime/periodic.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from vlm_operator.api.reports import Report
from vlm_operator.metrics import LOOP_ROUND_AGE, LOOP_STALLED, ROUNDS_STALLED

log = logging.getLogger(__name__)

FACTOR = 10
ROUND_PREFIX = "round "
CONDITION = "OperatorStalled"


def round_loop(namespace: str, name: str) -> str:
    return f"{ROUND_PREFIX}{namespace}/{name}"


def overdue(loops: dict[str, tuple[float, float]], now: float,
            factor: float = FACTOR) -> dict[str, float]:
    """Loops (name -> (period, last round)) without a round for factor x period: name -> age."""
    return {name: now - last for name, (period, last) in loops.items()
            if now - last > factor * period}


class Watchdog:
    def __init__(self, factor: float = FACTOR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.factor, self.clock = factor, clock
        self._lock = threading.Lock()
        self._loops: dict[str, tuple[float, float]] = {}  # name -> (period, last round)
        self._stalled: dict[str, float] = {}  # name -> age when last checked

    def beat(self, name: str, period_s: float) -> None:
        """`name` completed a round; it runs every period_s."""
        with self._lock:
            self._loops[name] = (period_s, self.clock())

    def forget(self, name: str) -> None:
        """The loop ended on purpose (stopped, its VLMDeployment gone)."""
        with self._lock:
            self._loops.pop(name, None)
            self._stalled.pop(name, None)
        for gauge in (LOOP_STALLED, LOOP_ROUND_AGE):
            with contextlib.suppress(KeyError):  # never set: a round loop, or no check yet
                gauge.remove(name)

    def check(self) -> list[str]:
        """Update gauges, log stalls and recoveries; the loops whose state changed."""
        now = self.clock()
        with self._lock:
            loops = dict(self._loops)
            late = overdue(loops, now, self.factor)
            changed = sorted(set(late) ^ set(self._stalled))
            before, self._stalled = self._stalled, late
        for name, (_period, last) in loops.items():
            if not name.startswith(ROUND_PREFIX):
                LOOP_ROUND_AGE.labels(name).set(round(now - last, 1))
                LOOP_STALLED.labels(name).set(1 if name in late else 0)
        ROUNDS_STALLED.set(sum(1 for name in late if name.startswith(ROUND_PREFIX)))
        for name in changed:
            if name in late:
                log.warning("watchdog: %s has not completed a round for %.0f s (it runs every "
                            "%g s)", name, late[name], loops[name][0])
            else:
                log.info("watchdog: %s completes rounds again (stalled for at least %.0f s)",
                         name, before[name])
        return changed

    def reports(self, namespace: str, name: str) -> list[Report]:
        """Report provider: OperatorStalled for this VLMDeployment."""
        mine = round_loop(namespace, name)
        with self._lock:
            late = [n for n in self._stalled if n == mine or not n.startswith(ROUND_PREFIX)]
            periods = {n: self._loops[n][0] for n in late if n in self._loops}
        if not late:
            return [Report(CONDITION, "False", "LoopsRunning",
                           "every loop of the operator completes its rounds")]
        text = "; ".join(f"{'its round' if n == mine else n} has not completed in "
                         f"{self.factor * periods.get(n, 0):g} s (it runs every "
                         f"{periods.get(n, 0):g} s)" for n in sorted(late))
        return [Report(CONDITION, "True", "LoopStalled",
                       f"{text}: what it does for this VLMDeployment (stall detection, "
                       "autoscaling, resync) waits until it completes again")]
