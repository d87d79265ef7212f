"""The plugin's engine heartbeat (vllm_tokenizer_pool/heartbeat.py): its bookkeeping, its line,
and the line's contract with the operator's signature (logs/matcher.py). The hook on vLLM's real
scheduler is tested per vLLM release in tests/engine/test_plugin_vllm.py."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_tokenizer_pool import heartbeat
from vlm_operator.logs import matcher
from vlm_operator.stalls import verdicts


def out(tokens: int, encoder: dict | None = None) -> SimpleNamespace:
    """The two fields of vLLM's SchedulerOutput the heartbeat reads."""
    return SimpleNamespace(total_num_scheduled_tokens=tokens,
                           scheduled_encoder_inputs=encoder or {})


def test_a_step_is_in_flight_from_schedule_until_its_output_is_taken_back():
    log = heartbeat.StepLog()
    assert log.snapshot(0.0) == (0, 0, 0.0, 0)
    first, second = out(2048), out(1)
    log.scheduled(first, 2048, 10.0)
    log.scheduled(second, 1, 11.0)  # vLLM's batch queue: two in flight
    assert log.snapshot(15.0) == (0, 2, 5.0, 2048)  # the oldest one's age and tokens
    log.done(first)
    assert log.snapshot(15.0) == (1, 1, 4.0, 1)
    log.done(second)
    assert log.snapshot(15.0) == (2, 0, 0.0, 0)


def test_steps_count_only_work_and_an_abandoned_step_never_runs_forever():
    log = heartbeat.StepLog()
    empty, lost, later = out(0), out(64), out(8)
    log.scheduled(empty, 0, 1.0)
    log.done(empty)
    assert log.snapshot(2.0)[0] == 0  # a step with nothing scheduled is not progress
    log.scheduled(lost, 64, 3.0)  # an exception between schedule and update: never taken back
    log.scheduled(later, 8, 4.0)
    log.done(later)  # steps complete in order: the lost one goes too
    assert log.snapshot(100.0) == (1, 0, 0.0, 0)
    log.done(out(5))  # an output it never saw is ignored
    assert log.snapshot(100.0) == (1, 0, 0.0, 0)


def test_in_flight_is_bounded():
    log = heartbeat.StepLog()
    outputs = [out(1) for _ in range(heartbeat.MAX_IN_FLIGHT + 10)]
    for i, o in enumerate(outputs):
        log.scheduled(o, 1, float(i))
    assert log.snapshot(100.0)[1] == heartbeat.MAX_IN_FLIGHT


def test_step_tokens_add_the_encoder_inputs_of_the_step():
    image = SimpleNamespace(mm_position=SimpleNamespace(length=1200))
    scheduler = SimpleNamespace(requests={"r": SimpleNamespace(mm_features=[image, image])})
    assert heartbeat.step_tokens(scheduler, out(256, {"r": [0, 1]})) == 256 + 2400
    assert heartbeat.step_tokens(scheduler, out(256, {"gone": [0]})) == 256  # names moved
    assert heartbeat.step_tokens(scheduler, SimpleNamespace()) == 0


@pytest.mark.parametrize(("raw", "period"), [
    ("", 5.0), ("2", 2.0), ("0.5", 0.5), ("0.25", 5.0), ("1.26", 1.3), ("0", 0.0),
    ("-1", 5.0), ("x", 5.0), ("3601", 5.0), ("inf", 5.0), ("nan", 5.0)])
def test_the_period_setting(raw, period):
    assert heartbeat.period_s_from(raw) == period


@given(every=st.sampled_from([0.5, 1.0, 2.5, 5.0, 60.0, 3600.0]),
       steps=st.integers(0, 10**15 - 1), in_flight=st.integers(0, heartbeat.MAX_IN_FLIGHT),
       step_s=st.floats(0, 10**8, allow_nan=False), tokens=st.integers(0, 10**12 - 1),
       running=st.integers(0, 10**9 - 1), waiting=st.integers(0, 10**9 - 1))
def test_every_line_the_plugin_writes_is_read_by_the_operator(every, steps, in_flight, step_s,
                                                                tokens, running, waiting):
    line = heartbeat.heartbeat_line(every, steps, in_flight, step_s, tokens, running, waiting)
    det = matcher.match(f"(EngineCore pid=7) INFO 12-01 20:58:03 [heartbeat.py:162] {line}")
    assert det is not None and det.signature == "engine_heartbeat", line
    b = verdicts.beat(det.fields, None, 0.0, 0.0)
    assert (b.every, b.steps, b.in_flight, b.step_tokens, b.running, b.waiting) == (
        every, steps, in_flight, tokens, running, waiting)
    assert b.step_s == pytest.approx(step_s, abs=0.051)


class Scheduler:
    """The two methods of vLLM's scheduler the heartbeat wraps, to check its wrappers' manners
    (vLLM's errors pass through, its own never do); vLLM's real one: tests/engine."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.running, self.waiting = fail, [1], []

    def schedule(self):
        return out(512)

    def update_from_output(self, scheduler_output, model_output):
        if self.fail:
            raise RuntimeError("vLLM's own error")
        return {"outputs": model_output}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.seen = threading.Event()

    def emit(self, record):
        self.lines.append(record.getMessage())
        self.seen.set()


def test_the_wrappers_pass_vllms_results_and_errors_through_and_lines_follow():
    lines = Lines()
    heartbeat.logger.addHandler(lines)
    heartbeat.logger.setLevel(logging.INFO)
    try:
        sched = Scheduler()
        steps = heartbeat.instrument(sched, 0.5)
        assert heartbeat.instrument(sched, 0.5) is None  # once per scheduler
        o = sched.schedule()
        assert o.total_num_scheduled_tokens == 512
        assert sched.update_from_output(o, "m") == {"outputs": "m"}
        assert steps.snapshot(time.monotonic())[:2] == (1, 0)
        failing = Scheduler(fail=True)
        heartbeat.instrument(failing, 0.5)
        with pytest.raises(RuntimeError, match="vLLM's own error"):
            failing.update_from_output(failing.schedule(), "m")
        assert lines.seen.wait(5)
        assert lines.lines[0].startswith("vlm-engine-heartbeat every=0.5 steps=")
    finally:
        heartbeat.logger.removeHandler(lines)
