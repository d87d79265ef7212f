"""The engine heartbeat: what vLLM's engine-core step loop is doing, logged every few seconds.

From outside, a hung engine and one long forward step (a long prompt with chunked prefill off,
a large vision-encoder pass) look the same: no counter moves, no log line, /health answers 200.
The engine core knows the difference, so the plugin has it say so. After vLLM builds its
scheduler (`vllm.v1.core.sched.scheduler.Scheduler` on every supported release, subclasses
included; built in the engine-core process once plugins are loaded), the instance's `schedule` and
`update_from_output` are wrapped: a step is in flight from the scheduler output `schedule`
returns until `update_from_output` takes it back (the forward pass runs in between), and a
daemon thread logs every `VLM_ENGINE_HEARTBEAT_SECONDS` (5; 0 turns it off) through logger
`vllm.vlm_engine_heartbeat`, so the line carries vLLM's header (docs/contributing.md):

    vlm-engine-heartbeat every=5 steps=<n> in_flight=<k> step_s=<s> step_tokens=<t>
    running=<r> waiting=<w>

(one line): `steps` completed steps that computed tokens, `in_flight` steps scheduled and not
yet completed (more than one with vLLM's batch queue), `step_s` and `step_tokens` the age and
the work of the oldest of them (its scheduled tokens plus the encoder input tokens of the
images encoded in it; 0 when none), `running`/`waiting` the scheduler's requests. A heartbeat
that stops is evidence too: the process is stopped, dead, or wedged holding the GIL.

Cost: two dictionary operations under a lock per step on the engine's thread, one line of
about 150 bytes per period. Nothing here raises into vLLM: a wrapper that fails passes the call
through, and the thread swallows its own errors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

from vllm_tokenizer_pool.plugin import emit

logger = logging.getLogger("vllm.vlm_engine_heartbeat")

DEFAULT_PERIOD_S = 5.0
MIN_PERIOD_S, MAX_PERIOD_S = 0.5, 3600.0
SCHEDULER = ("vllm.v1.core.sched.scheduler", "Scheduler")
_MARK = "__vlm_tokenizer_pool__"  # the plugin's mark on every wrapper it installs
_STEPS = "__vlm_engine_heartbeat__"  # an instrumented scheduler's StepLog
MAX_IN_FLIGHT = 64  # vLLM's batch queue holds a few; a leak can never grow past this


def period_s() -> float:
    return period_s_from(os.environ.get("VLM_ENGINE_HEARTBEAT_SECONDS", ""))


def period_s_from(raw: str) -> float:
    """VLM_ENGINE_HEARTBEAT_SECONDS: the period, 0.5 - 3600 s in tenths (0: off); the default
    when unset or anything else."""
    try:
        value = round(float(raw), 1)
    except ValueError:
        return DEFAULT_PERIOD_S
    return value if value == 0 or MIN_PERIOD_S <= value <= MAX_PERIOD_S else DEFAULT_PERIOD_S


def heartbeat_line(every: float, steps: int, in_flight: int, step_s: float, step_tokens: int,
                   running: int, waiting: int) -> str:
    return (f"vlm-engine-heartbeat every={every:g} steps={steps} in_flight={in_flight} "
            f"step_s={step_s:.1f} step_tokens={step_tokens} running={running} "
            f"waiting={waiting}")


class StepLog:
    """What one scheduler's steps are doing. Written by the engine's thread (scheduled, done),
    read by the heartbeat thread (snapshot); a lock keeps the two consistent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self.steps = 0

    def scheduled(self, output: Any, tokens: int, now: float) -> None:
        with self._lock:
            self._in_flight[id(output)] = (now, tokens)
            while len(self._in_flight) > MAX_IN_FLIGHT:
                self._in_flight.popitem(last=False)

    def done(self, output: Any) -> None:
        """vLLM completes steps in the order it scheduled them: anything scheduled before this
        one and still here was abandoned (an exception between the two calls), so it goes too;
        an abandoned step can never look like one running forever."""
        key = id(output)
        with self._lock:
            if key not in self._in_flight:
                return
            while self._in_flight:
                first, (_, tokens) = self._in_flight.popitem(last=False)
                if first == key:
                    self.steps += tokens > 0
                    return

    def snapshot(self, now: float) -> tuple[int, int, float, int]:
        """(steps, in_flight, age of the oldest step in flight, its scheduled tokens)."""
        with self._lock:
            steps, in_flight = self.steps, len(self._in_flight)
            oldest = next(iter(self._in_flight.values()), None)
        if oldest is None:
            return steps, 0, 0.0, 0
        return steps, in_flight, max(0.0, now - oldest[0]), oldest[1]


def step_tokens(scheduler: Any, output: Any) -> int:
    """The work of one step: the tokens scheduled (prompt chunks and decodes) plus the encoder
    input tokens of the multimodal items encoded in it (a large image costs its encoder pass
    even when few of its placeholder tokens fall into this step's chunk)."""
    tokens = int(getattr(output, "total_num_scheduled_tokens", 0) or 0)
    with contextlib.suppress(Exception):  # vLLM's names moved: the scheduled tokens alone
        for req_id, items in (getattr(output, "scheduled_encoder_inputs", None) or {}).items():
            features = scheduler.requests[req_id].mm_features
            tokens += sum(int(features[i].mm_position.length) for i in items)
    return tokens


def request_counts(scheduler: Any) -> tuple[int, int]:
    """(running, waiting): vLLM's own get_request_counts where it has one, else the queues."""
    counts = getattr(scheduler, "get_request_counts", None)
    if callable(counts):
        running, waiting = counts()
        return int(running), int(waiting)
    return len(scheduler.running), len(scheduler.waiting)


def instrument(scheduler: Any, every: float) -> StepLog | None:
    """Wrap this scheduler's schedule/update_from_output and start its heartbeat thread
    (once per instance); None when it is already instrumented."""
    if getattr(scheduler, _STEPS, None) is not None:
        return None
    steps = StepLog()
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def scheduled(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        with contextlib.suppress(Exception):  # the heartbeat must never cost vLLM a step
            steps.scheduled(output, step_tokens(scheduler, output), time.monotonic())
        return output

    def updated(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return update(scheduler_output, *args, **kwargs)
        finally:
            with contextlib.suppress(Exception):
                steps.done(scheduler_output)

    scheduler.schedule, scheduler.update_from_output = scheduled, updated
    setattr(scheduler, _STEPS, steps)
    threading.Thread(target=_beat, args=(weakref.ref(scheduler), steps, every), daemon=True,
                     name="vlm-engine-heartbeat").start()
    return steps


def _beat(ref: weakref.ref, steps: StepLog, every: float) -> None:
    """Log a heartbeat every `every` seconds while the scheduler lives."""
    while True:
        time.sleep(every)
        scheduler = ref()
        if scheduler is None:
            return
        try:
            running, waiting = request_counts(scheduler)
            del scheduler
            line = heartbeat_line(every, *steps.snapshot(time.monotonic()), running, waiting)
            emit(logging.INFO, line, logger, stacklevel=2)
        except Exception:  # a failed line is skipped, never raised: the next one comes
            continue


def hook(scheduler_cls: type, every: float) -> bool:
    """Wrap scheduler_cls.__init__ so every scheduler built from now on is instrumented;
    False when it already is (idempotent)."""
    original = scheduler_cls.__init__
    if getattr(original, _MARK, False):
        return False

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            instrument(self, every)
        except Exception as exc:  # the engine runs on, without a heartbeat
            emit(logging.WARNING, "vlm-engine-heartbeat off: reason=" + " ".join(
                f"{type(exc).__name__}: {exc}".split()), logger, stacklevel=2)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__.__name__, __init__.__qualname__ = original.__name__, original.__qualname__
    __init__.__doc__ = original.__doc__
    setattr(__init__, _MARK, True)
    scheduler_cls.__init__ = __init__
    return True


def install() -> str | None:
    """Hook vLLM's scheduler; the target's name, or None when the heartbeat is off by env."""
    import importlib

    every = period_s()
    if every == 0:
        return None
    module, cls = SCHEDULER
    hook(getattr(importlib.import_module(module), cls), every)
    return f"{module}.{cls}.__init__"
