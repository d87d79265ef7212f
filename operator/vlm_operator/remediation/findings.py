"""What a pod's status alone shows (with what its log said), pure: Events and the Unpatched and
LogDetectionOff conditions.

Pods with the tokenizer pool's startup line missing get their own condition, `Unpatched`, not
`Degraded`: an unpatched engine still serves (it may log retries or answer some requests with
400), while Degraded is kept for "the operator cannot keep this healthy" (restart budget spent,
crash loops). A pod whose log the operator cannot read (no line with vLLM's header by the time
the startup line would be due, or a logging prefix it cannot know) is reported with
`LogDetectionOff` instead: a missing line there says nothing about the plugin, and log-based
detection (engine death, tokenizer retries) is off for that pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vlm_operator.api.reports import Report
from vlm_operator.k8s.pods import parse_time, ready_condition
from vlm_operator.k8s.views import Pod

UNPATCHED_GRACE_S = 60.0
LOG_DETECTION_OFF = "LogDetectionOff"


@dataclass(frozen=True, slots=True)
class Finding:
    """Something a pod's status (with what its log said) shows; reported with one Event."""

    kind: str  # ExitedAfterEngineDeath | CrashLoopBackOff | Unpatched | LogDetectionOff
    message: str
    key: str  # identity for "Event once"


def pod_findings(pod: Mapping, *, now: float, engine_dead_at: float | None,
                 plugin: str | None, grace_s: float = UNPATCHED_GRACE_S,
                 log_off: str | None = None, log_unread: str | None = None,
                 reading_since: float | None = 0.0) -> list[Finding]:
    """Findings from one pod. engine_dead_at: time of the last engine_dead incident its log
    showed; plugin: "active", "inactive: <reason>" or None (no startup line seen in the
    current container); log_off: why its log cannot be read whatever it holds (None: it can);
    log_unread: while no line with vLLM's header was seen in the current container, what the
    log looks like (None: one was); reading_since: see unpatched_due."""
    name = Pod(pod).name
    cs = Pod(pod).container
    out = []
    last = (cs.get("lastState") or {}).get("terminated") or {}
    finished = parse_time(last.get("finishedAt"))
    if engine_dead_at is not None and finished is not None and finished >= engine_dead_at:
        code = last.get("exitCode")
        out.append(Finding("ExitedAfterEngineDeath",
                           f"{name}: the vllm container exited with code {code} after its engine "
                           "died" + (" (exit code 0 hides the crash)" if code == 0 else ""),
                           f"{name}/exited/{cs.get('restartCount', 0)}"))
    waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
    if waiting == "CrashLoopBackOff":
        out.append(Finding("CrashLoopBackOff", f"{name}: the vllm container is crash-looping "
                           f"({cs.get('restartCount', 0)} restarts)", f"{name}/crashloop"))
    due = unpatched_due(pod, plugin=plugin, grace_s=grace_s, reading_since=reading_since)
    off = f"{name}/logoff/{cs.get('restartCount', 0)}"
    if plugin is not None and plugin.startswith("inactive"):
        out.append(Finding("Unpatched", f"{name}: tokenizer pool plugin {plugin}",
                           f"{name}/unpatched/{cs.get('restartCount', 0)}"))
    elif log_off is not None:
        out.append(Finding(LOG_DETECTION_OFF, f"{name}: log detection off: {log_off}", off))
    elif due is not None and now > due and log_unread is not None:
        out.append(Finding(LOG_DETECTION_OFF, f"{name}: log detection off: ready for "
                           f"{now - due + grace_s:.0f} s and {log_unread}", off))
    elif due is not None and now > due:
        out.append(Finding("Unpatched", f"{name}: ready for {now - due + grace_s:.0f} s without "
                           "the tokenizer pool plugin's startup line",
                           f"{name}/unpatched/{cs.get('restartCount', 0)}"))
    return out


def unpatched_due(pod: Mapping, *, plugin: str | None, grace_s: float = UNPATCHED_GRACE_S,
                  reading_since: float | None = 0.0) -> float | None:
    """When a ready pod without the plugin's startup line becomes Unpatched, or LogDetectionOff
    if no line of its log could be read (None: it cannot yet). reading_since: when the
    operator began reading the current container's log (None: not yet); the grace counts from
    the later of that and readiness, so a fresh operator process never reports a long-ready
    pod before it has read its log."""
    ready = ready_condition(pod)
    since = parse_time(ready.get("lastTransitionTime"))
    if plugin is not None or ready.get("status") != "True" or since is None or \
            reading_since is None:
        return None
    return max(since, reading_since) + grace_s


def unpatched_report(findings_by_pod: Mapping[str, list[Finding]]) -> Report | None:
    """The Unpatched condition over the pods seen so far (None: no pod seen)."""
    if not findings_by_pod:
        return None
    bad = sorted(p for p, fs in findings_by_pod.items() if any(f.kind == "Unpatched" for f in fs))
    if bad:
        return Report("Unpatched", "True", "PluginMissing",
                      "pods without an active tokenizer pool: " + ", ".join(bad))
    return Report("Unpatched", "False", "AllPodsPatched",
                  "every pod logged the tokenizer pool's startup line or is within its grace")


def log_detection_report(findings_by_pod: Mapping[str, list[Finding]]) -> Report | None:
    """The LogDetectionOff condition over the pods seen so far (None: no pod seen): True names
    the pods whose log the operator cannot read, and why."""
    if not findings_by_pod:
        return None
    off = [f.message for _, fs in sorted(findings_by_pod.items()) for f in fs
           if f.kind == LOG_DETECTION_OFF]
    if off:
        more = f"; and {len(off) - 3} more pods" if len(off) > 3 else ""
        return Report(LOG_DETECTION_OFF, "True", "LogUnreadable",
                      "engine death, tokenizer retries and the tokenizer pool's startup line "
                      "cannot be read from the log of: " + "; ".join(off[:3]) + more)
    return Report(LOG_DETECTION_OFF, "False", "LogsReadable",
                  "every pod's log is read (or its pod is within the startup grace)")
