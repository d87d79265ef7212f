"""The VLMDeployment's status and the Events worth telling users about. Pure.

Conditions follow the Kubernetes convention: lastTransitionTime only moves when status flips, so
`kubectl describe` shows how long a state has lasted.
"""

from __future__ import annotations

from typing import Any

from vlm_operator.api.reports import Event, Report
from vlm_operator.api.validation import VLMDeployment
from vlm_operator.desired import children
from vlm_operator.k8s.views import Pod


def set_condition(conditions: list[dict], type_: str, status: str, reason: str, message: str,
                  now: str, generation: int | None = None) -> list[dict]:
    """A new list with condition `type_` set, keeping lastTransitionTime if status is unchanged."""
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else None
    new = {"type": type_, "status": status, "reason": reason, "message": message,
           "lastTransitionTime": since or now}
    if generation is not None:
        new["observedGeneration"] = generation
    return [*(c for c in conditions if c.get("type") != type_), new]


def get_condition(status: dict | None, type_: str) -> dict | None:
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == type_),
                None)


def _waiting_reason(pod: dict) -> str | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        reason = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
        if reason:
            return reason
    return None


def get_status(*, name: str, generation: int | None, old: dict | None,
               vlmd: VLMDeployment | None, problems: list[str],
               deployment: dict | None, pods: list[dict], now: str,
               reports: list[Report] = (), surge: int = 0) -> dict:
    """Status from the spec's validity, the Deployment's rollout and the pods' states.

    With an invalid spec the children are left as they are, so their readiness is still reported.
    `surge`: Deployment replicas added while sick pods are replaced (incidents.surge).
    """
    old = old or {}
    conditions = list(old.get("conditions") or [])
    status: dict[str, Any] = {"observedGeneration": generation,
                              "selector": children.get_selector(name)}
    if problems:
        conditions = set_condition(conditions, "SpecValid", "False", "InvalidSpec",
                                   "; ".join(problems), now, generation)
    else:
        conditions = set_condition(conditions, "SpecValid", "True", "Valid",
                                   "the spec is valid", now, generation)
    if vlmd is not None:
        status["tokenizerPoolSize"] = vlmd.pool_size
        status["vllmVersion"] = str(vlmd.version)

    dep_status = (deployment or {}).get("status") or {}
    desired = (deployment or {}).get("spec", {}).get("replicas", 0) if deployment else 0
    ready = dep_status.get("readyReplicas") or 0
    updated = dep_status.get("updatedReplicas") or 0
    status["replicas"] = dep_status.get("replicas") or 0
    status["readyReplicas"] = ready
    rollout_seen = (deployment is not None and
                    dep_status.get("observedGeneration", 0) >=
                    deployment["metadata"].get("generation", 0))
    dep_progress = next((c for c in dep_status.get("conditions") or []
                         if c.get("type") == "Progressing"), {})
    crashing = sorted(Pod(p).name for p in pods
                      if _waiting_reason(p) == "CrashLoopBackOff")

    if deployment is None:
        ready_c = ("False", "NoDeployment", "the Deployment does not exist yet")
        progress_c = ("True", "Creating", "creating the Deployment") if vlmd else \
            ("False", "InvalidSpec", "nothing is rolled out until the spec is fixed")
    elif desired == 0:
        ready_c = ("False", "ScaledToZero", "replicas is 0")
        progress_c = ("False", "ScaledToZero", "replicas is 0")
    else:
        done = rollout_seen and ready >= desired and updated >= desired and \
            status["replicas"] == desired
        wanted = max(desired - surge, 0)  # a surge replacement adds no requirement
        text = f"{ready}/{wanted} replicas ready"
        ready_c = ("True", "AllReplicasReady", text) if ready >= wanted else \
            ("False", "ReplicasNotReady", text)
        if dep_progress.get("reason") == "ProgressDeadlineExceeded":
            progress_c = ("False", "ProgressDeadlineExceeded", dep_progress.get("message", ""))
        elif done:
            progress_c = ("False", "RolloutComplete", text)
        else:
            progress_c = ("True", "RollingOut", f"{updated}/{desired} updated, {text}")
    conditions = set_condition(conditions, "Ready", *ready_c, now, generation)
    conditions = set_condition(conditions, "Progressing", *progress_c, now, generation)

    apply_failed = next((r for r in reports if r.reason in ("ApplyFailed", "ObjectNotOwned")),
                        None)
    if apply_failed:
        degraded_c = ("True", apply_failed.reason, apply_failed.message)
    elif crashing:
        degraded_c = ("True", "CrashLoopBackOff", "pods crash-looping: " + ", ".join(crashing))
    elif progress_c[1] == "ProgressDeadlineExceeded":
        degraded_c = ("True", "ProgressDeadlineExceeded", progress_c[2])
    else:
        degraded_c = next(((r.status, r.reason, r.message) for r in reports
                           if r.type == "Degraded" and r.status == "True"),
                          ("False", "AsExpected", "no problem detected"))
    conditions = set_condition(conditions, "Degraded", *degraded_c, now, generation)
    for report in reports:
        if report.type != "Degraded":
            conditions = set_condition(conditions, report.type, report.status, report.reason,
                                       report.message, now, generation)
    if vlmd is not None:  # a feature turned off takes its condition with it
        conditions = [c for c in conditions
                      if FEATURE_CONDITIONS.get(c.get("type"), lambda spec: True)(vlmd.spec)]
    status["conditions"] = conditions
    return status


def _scaling(spec: dict, mode: str) -> bool:
    scaling = spec.get("autoscaling") or {}
    return bool(scaling.get("enabled")) and scaling.get("mode", "Builtin") == mode


# Conditions that only mean something while a feature is on (their providers go quiet when it
# is turned off, so they are dropped here rather than left with an old observedGeneration).
FEATURE_CONDITIONS = {
    "ScalingLimited": lambda spec: _scaling(spec, "Builtin"),
    "AutoscalerReady": lambda spec: _scaling(spec, "KEDA"),
    "StallDetection": lambda spec: spec["health"]["engineStalled"]["action"] != "Ignore",
}


# (condition type, status, reason or None for any) -> Event type, for transitions worth an Event.
_NOTABLE = [
    ("SpecValid", "False", None, "Warning"),
    ("Ready", "True", None, "Normal"),
    ("Degraded", "True", None, "Warning"),
    ("Progressing", "False", "RolloutComplete", "Normal"),
    ("Progressing", "False", "ProgressDeadlineExceeded", "Warning"),
    ("PodsReachable", "False", None, "Warning"),
    ("PodsReadable", "False", None, "Warning"),
]
# Conditions whose return to True is worth a Normal Event (its reason and message) too.
_RECOVERED = ("PodsReachable", "PodsReadable")


def get_events(old: dict | None, new: dict) -> list[Event]:
    """Events for condition changes users care about (not for every status write)."""
    events = []
    for type_, status, reason, kind in _NOTABLE:
        before, after = get_condition(old, type_), get_condition(new, type_)
        if after is None or after.get("status") != status or \
                reason not in (None, after.get("reason")):
            continue
        if before and before.get("status") == status and \
                before.get("message") == after.get("message"):
            continue
        events.append(Event(kind, after["reason"], after.get("message", "")))
    was, now = get_condition(old, "SpecValid"), get_condition(new, "SpecValid")
    if was and was.get("status") == "False" and now and now.get("status") == "True":
        events.append(Event("Normal", "SpecFixed", "the spec is valid again"))
    for type_ in _RECOVERED:
        was, now = get_condition(old, type_), get_condition(new, type_)
        if was and was.get("status") == "False" and now and now.get("status") == "True":
            events.append(Event("Normal", now["reason"], now.get("message", "")))
    return events
