"""remediation/findings.py: what a pod's status shows (exits, crash loops, Unpatched,
LogDetectionOff)."""

from __future__ import annotations

import pytest

from vlm_operator.remediation.findings import pod_findings, unpatched_report

from .builders import pod

T0 = 1767225600.0  # 2026-01-01T00:00:00Z


def test_exit_zero_after_engine_death_is_a_finding():
    last = {"exitCode": 0, "finishedAt": "2026-01-01T00:00:10Z"}
    (f,) = pod_findings(pod(last=last, restarts=1), now=T0 + 20, engine_dead_at=T0 + 5,
                        plugin="active")
    assert f.kind == "ExitedAfterEngineDeath" and "code 0" in f.message
    # an exit before the death line, or with no death seen, is not this finding
    assert pod_findings(pod(last=last), now=T0 + 20, engine_dead_at=T0 + 11,
                        plugin="active") == []
    assert pod_findings(pod(last=last), now=T0 + 20, engine_dead_at=None, plugin="active") == []


def test_crashloop_finding():
    (f,) = pod_findings(pod(ready=False, waiting="CrashLoopBackOff", restarts=4), now=T0,
                        engine_dead_at=None, plugin=None)
    assert f.kind == "CrashLoopBackOff" and f.key == "p0/crashloop"


@pytest.mark.parametrize("ready,age,plugin,unpatched", [
    (True, 61, None, True),
    (True, 59, None, False),  # within the grace period
    (False, 600, None, False),  # not ready yet: the line may still come
    (True, 600, "active", False),
    (True, 1, "inactive: reason=HfRenderer not found", True),
])
def test_unpatched(ready, age, plugin, unpatched):
    found = pod_findings(pod(ready=ready), now=T0 + age, engine_dead_at=None, plugin=plugin)
    assert any(f.kind == "Unpatched" for f in found) == unpatched
    report = unpatched_report({"p0": found})
    assert report.type == "Unpatched" and report.status == ("True" if unpatched else "False")


def test_unpatched_report_needs_pods():
    assert unpatched_report({}) is None


@pytest.mark.parametrize("age,plugin,log_off,log_unread,kind", [
    # a log with vLLM's header and no startup line: the plugin is missing
    (61, None, None, None, "Unpatched"),
    # no line in vLLM's format by then: the log cannot be read, which says nothing of the plugin
    (61, None, None, "no line in vLLM's log format was seen", "LogDetectionOff"),
    (59, None, None, "no line in vLLM's log format was seen", None),  # within the grace
    # a prefix that cannot be known: off at once
    (1, None, "its VLLM_LOGGING_PREFIX comes from valueFrom", None, "LogDetectionOff"),
    # an inactive line was read, so the log can be read: the plugin failed
    (1, "inactive: HfRenderer not found", None, None, "Unpatched"),
])
def test_an_unreadable_log_is_log_detection_off_never_unpatched(age, plugin, log_off,
                                                                log_unread, kind):
    from vlm_operator.remediation.findings import log_detection_report

    found = pod_findings(pod(), now=T0 + age, engine_dead_at=None, plugin=plugin,
                         log_off=log_off, log_unread=log_unread)
    assert [f.kind for f in found] == ([kind] if kind else [])
    report = log_detection_report({"p0": found})
    assert report.status == ("True" if kind == "LogDetectionOff" else "False")
    if kind == "LogDetectionOff":
        assert report.reason == "LogUnreadable" and "p0: log detection off: " in report.message
        assert found[0].key == "p0/logoff/0"
    assert log_detection_report({}) is None


def test_the_startup_line_grace_counts_from_when_the_log_began_to_be_read():
    """A fresh operator process sees pods ready for hours before its followers have read a
    line: it reported them Unpatched (an Event each) at once, then took it back."""
    assert pod_findings(pod(), now=T0 + 3600, engine_dead_at=None, plugin=None,
                        reading_since=None) == []
    assert pod_findings(pod(), now=T0 + 3600, engine_dead_at=None, plugin=None,
                        reading_since=T0 + 3590) == []
    (f,) = pod_findings(pod(), now=T0 + 3600, engine_dead_at=None, plugin=None,
                        reading_since=T0 + 3500)
    assert f.kind == "Unpatched"
