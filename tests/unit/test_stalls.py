"""stalls.py: the pure stall decision (issue 12)."""

from __future__ import annotations

from vlm_operator.stalls import (
    ANSWERED,
    OK,
    PROGRESS_METRICS,
    STALLED,
    TIMED_OUT,
    UNCORROBORATED,
    UNKNOWN,
    UNRESPONSIVE,
    after_canary,
    after_health,
    api_verdict,
    canary_due,
    not_ready,
    observe,
    stall_detail,
)

T = 1000.0
STALL, CANARY = 30.0, 10.0


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
    assert not canary_due(p, T + 119, STALL, CANARY)


def test_flat_counters_call_for_a_canary_before_the_stall_time():
    p = run([values(gen=5)] * 25)
    assert p.moved_at == T
    assert not canary_due(p, T + 19, STALL, CANARY)
    assert canary_due(p, T + 20, STALL, CANARY)  # 30 - 10: the answer is due by T + 30


def test_any_counter_moving_is_progress_and_a_reset_after_a_restart_too():
    p = run([values(gen=5, prompt=9)] * 10 + [values(gen=5, prompt=10)])
    assert p.moved_at == T + 10
    p = observe(p, values(gen=0, prompt=0), T + 40)  # a restarted container starts at 0
    assert p.moved_at == T + 40 and not canary_due(p, T + 45, STALL, CANARY)


def test_missing_counters_and_failed_reads_never_call_for_a_canary():
    """Unknown is not flat: a pod exporting none of the counters, or one whose /metrics
    cannot be read, is never declared stalled from its counters."""
    p = run([{"vllm:num_requests_running": 0.0}] * 60)
    assert p.counters is None and not canary_due(p, T + 59, STALL, CANARY)
    p = run([values(gen=1)] + [None] * 40)
    assert p.read_at == T and not canary_due(p, T + 40, STALL, CANARY)
    assert observe(None, None, T).read_at == 0.0  # never read
    assert len(PROGRESS_METRICS) == 3


def test_canary_answered_means_idle_not_stuck():
    p = run([values(gen=5)] * 21)
    p, verdict = after_canary(p, ANSWERED, T + 20, T + 20.05)
    assert verdict == OK and p.moved_at == T + 20.05
    assert not canary_due(p, T + 30, STALL, CANARY)  # the next canary only in 20 s


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
    text = stall_detail(p, T + 31, CANARY, "vlm-operator-canary-ab12")
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
    assert api_verdict(p, 3, not_ready(pod("False"))) == UNRESPONSIVE
    assert api_verdict(p, 3, not_ready(pod("True"))) == UNCORROBORATED
    assert api_verdict(p, 3, not_ready(pod(None))) == UNCORROBORATED  # no word yet: unknown
    deleting = {**pod("False"), "metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert not not_ready(deleting)
