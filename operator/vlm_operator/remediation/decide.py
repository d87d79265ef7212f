"""What to do about a pod whose log (or the stall watch) shows a failure: one pure call from
everything gathered about it (a PlanRequest) to a RemediationPlan (act, with which action, on
which pod, or hold back, and why, as a Reason). remediation/remediator.py gathers the inputs
once, asks, and carries the plan out. Pure: no I/O, times passed in.

Guards, in the order they are checked (the first that holds wins, so a skip names one reason):
below the threshold, the policy says Ignore, the incident is older than its window (a replayed
or long-held line), it was already acted on (an action in flight names it), it was logged by a
container the kubelet has restarted in place since (the line's time is before the end of the
second the current container started in: a late line, one read from the previous log), the pod
is already going away or being acted on, /health answers 200 for an engine said to be dead (log
lines are evidence, not proof: see logs/matcher.py), the pod's back-off after a failed attempt,
the VLMDeployment's restart budget, and minAvailable (remediation/guards.py). When the pod still
serves and removing it would break minAvailable, it is replaced instead: one extra replica is
surged (if a GPU is free once the VLMDeployment's pending claims took theirs), and the sick pod
is drained and deleted once the replacement is ready (remediation/steps.py).

Held-back incidents stay open and are decided again when the blocking condition may have changed
(pod events, spec changes, a short timer), until acted on, gone or older than their window.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vlm_operator.api.actions import Action
from vlm_operator.api.reports import Report
from vlm_operator.remediation.guards import Standing, needs_replacement, others_ready
from vlm_operator.remediation.incidents import NODE_DRAIN, Incident, InFlight, restarts_in_hour
from vlm_operator.remediation.policy import HealthPolicy, Rule
from vlm_operator.remediation.steps import NODE_DRAIN_WAIT_S, UNSCHEDULABLE_S

STARTED_AT_S = 1.0  # the resolution of a container's startedAt


class Reason(enum.StrEnum):
    """Why a plan acts or holds back (the skipped-actions metric's label)."""

    ACT = "act"
    BELOW_THRESHOLD = "below_threshold"
    IGNORED = "ignored"  # the policy says Ignore
    EXPIRED = "expired"  # the last detection is outside the rule's window
    ALREADY_ACTED = "already_acted"  # an action already covered this incident's last detection
    RECOVERED_IN_PLACE = "recovered_in_place"  # logged by a container restarted since
    IN_PROGRESS = "in_progress"  # the pod is already being removed or replaced
    HEALTH_OK = "health_ok"  # engine death logged, but /health answers 200
    BACKOFF = "backoff"  # the pod backs off after a failed attempt
    BUDGET_EXHAUSTED = "budget_exhausted"  # spec.health.maxRestartsPerHour is spent
    MIN_AVAILABLE = "min_available"  # no GPU for the replacement minAvailable asks for
    PEER_ACTIVE = "peer_active"  # not the plan's: this operator replica may not act


# Skip reasons that are guards (counted in the skipped-actions metric).
GUARDS = (Reason.EXPIRED, Reason.ALREADY_ACTED, Reason.RECOVERED_IN_PLACE, Reason.IN_PROGRESS,
          Reason.HEALTH_OK, Reason.BACKOFF, Reason.BUDGET_EXHAUSTED, Reason.MIN_AVAILABLE)
# Guards that hold an incident open (it is decided again later), with the reason the
# Remediating condition gives while they do.
HOLDING = {Reason.HEALTH_OK: "HealthCheckPassing", Reason.BACKOFF: "BackingOff",
           Reason.BUDGET_EXHAUSTED: "RestartBudgetExhausted",
           Reason.MIN_AVAILABLE: "WaitingForCapacity"}


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """Everything the plan for one incident depends on, gathered once.

    history: times of this VLMDeployment's remediations; acted_until: the newest incident time
    already acted on for this pod (persisted); container_since: when the pod's newest vllm
    container started (remediation/ladder.container_since; None: none yet, or the pod's first,
    which has no earlier container); backoff_until:
    the end of the pod's back-off; health: "ok" (GET /health said 200), "failing",
    "unreachable" or None (not asked); spare_gpus: whether one more replica fits the free GPUs
    (None: not known), asked only when guards.needs_replacement() says so."""

    incident: Incident
    rule: Rule
    now: float
    pods: tuple[Standing, ...]
    history: tuple[float, ...]
    policy: HealthPolicy
    acted_until: float | None = None
    container_since: float | None = None
    backoff_until: float | None = None
    health: str | None = None
    spare_gpus: bool | None = None


@dataclass(frozen=True, slots=True)
class RemediationPlan:
    action: str | None  # Restart | ScaleDown | Replace; None: hold back or nothing to do
    reason: Reason
    message: str
    pod: str = ""  # the pod it is about
    uid: str = ""

    @property
    def act(self) -> bool:
        return self.action is not None

    @property
    def holds(self) -> bool:
        """Held back by something that may clear: decide again later."""
        return self.reason in HOLDING


def decide(request: PlanRequest) -> RemediationPlan:
    """Act on the incident's pod or say why not: the first guard that holds names the reason."""
    r = request
    incident, rule, now, policy = r.incident, r.rule, r.now, r.policy
    pod, signature, count = incident.pod, incident.signature, incident.count

    def skip(reason: Reason, message: str) -> RemediationPlan:
        return RemediationPlan(None, reason, message, incident.pod, incident.uid)

    if count < rule.threshold:
        return skip(Reason.BELOW_THRESHOLD, f"{count}/{rule.threshold} {signature} in "
                    f"{rule.window_s:g} s")
    if rule.action == Action.IGNORE:
        return skip(Reason.IGNORED, f"{signature} on {pod}: the policy says Ignore")
    if now - incident.last >= rule.window_s:
        return skip(Reason.EXPIRED, f"{signature} on {pod}: the last detection is "
                    f"{now - incident.last:.0f} s old, outside the {rule.window_s:g} s window")
    if r.acted_until is not None and incident.last <= r.acted_until:
        return skip(Reason.ALREADY_ACTED, f"{signature} on {pod} at {incident.last:.3f} was "
                    "already acted on")
    # startedAt has whole seconds: the container started within [since, since + 1), and a line
    # stamped in that second may be the previous container's (its last lines are read and
    # stamped while the next one starts). No engine dies within its container's first second;
    # a pod's first container has no predecessor (container_since is None then).
    if r.container_since is not None and incident.last < r.container_since + STARTED_AT_S:
        return skip(Reason.RECOVERED_IN_PLACE, f"{signature} on {pod} at {incident.last:.3f} "
                    "was logged by a container the kubelet has restarted in place since (the "
                    f"current one started at {r.container_since:.0f})")
    standings = list(r.pods)
    target = next((p for p in standings if p.name == pod), None)
    if target is not None and (target.deleting or not target.in_service or target.in_flight):
        return skip(Reason.IN_PROGRESS, f"{pod} is already being removed or replaced")
    if signature == "engine_dead" and r.health == "ok":
        return skip(Reason.HEALTH_OK, f"{pod} logged engine death but /health answers 200")
    if r.backoff_until is not None and now < r.backoff_until:
        return skip(Reason.BACKOFF, f"{pod} is backing off for {r.backoff_until - now:.0f} s "
                    "after a failed attempt")
    spent = restarts_in_hour(r.history, now)
    if spent >= policy.max_restarts_per_hour:
        return skip(Reason.BUDGET_EXHAUSTED, f"{spent} remediations in the last hour, the "
                    "most spec.health.maxRestartsPerHour allows "
                    f"({policy.max_restarts_per_hour})")
    what = (f"{signature} on {pod}: {incident.detail}" if incident.detail else
            f"{count} {signature} in {rule.window_s:g} s on {pod} (threshold {rule.threshold})")
    if needs_replacement(standings, pod, policy, signature):
        others = others_ready(standings, pod)
        if r.spare_gpus:
            return RemediationPlan(
                Action.REPLACE, Reason.ACT, f"{what}: Replace (it still serves and only "
                f"{others} other pods are ready, spec.health.minAvailable="
                f"{policy.min_available}): a replacement comes up first", pod, incident.uid)
        why = ("no GPU is free for a replacement on a node its pods may use"
               if r.spare_gpus is False else "the free GPUs could not be read")
        return skip(Reason.MIN_AVAILABLE, f"removing {pod} would leave {others} ready pods, "
                    f"fewer than spec.health.minAvailable ({policy.min_available}), and {why}")
    return RemediationPlan(rule.action, Reason.ACT, f"{what}: {rule.action}", pod,
                           incident.uid)


def remediating_report(in_flight: Mapping[str, InFlight],
                       held: Iterable[tuple[Incident, RemediationPlan]], now: float | None = None,
                       node_drain_wait_s: float = NODE_DRAIN_WAIT_S,
                       unschedulable_limit_s: float = UNSCHEDULABLE_S) -> Report:
    """Remediating: True while an action is under way or an incident is held back (and why),
    so `kubectl describe` says what the operator is waiting for; a surge that may wait longer
    than UNSCHEDULABLE_S for its node (a node autoscaler's, `unschedulable_limit_s`) says so."""
    parts, reason = [], None
    for record in sorted(in_flight.values(), key=lambda r: r.pod):
        why = (f"its node {record.node} is being drained" if record.signature == NODE_DRAIN
               else record.signature)
        if record.action == Action.REPLACE and record.drain_since is not None:
            reason = reason or "DrainingPod"
            parts.append(f"draining {record.pod} ({why}) before removing it")
        elif record.action == Action.REPLACE and not record.surge:
            reason = reason or "WaitingForCapacity"
            left = "; a cordon alone never lets it go" if record.node_since is None else ""
            if now is not None and record.node_since is not None:
                left = (f"; it is let go in "
                        f"{max(0.0, record.node_since + node_drain_wait_s - now):.0f} s")
            parts.append(f"{record.pod} keeps serving on leaving node {record.node} "
                         f"(minAvailable protects it) while no GPU is free elsewhere for a "
                         f"replacement{left}")
        elif record.action == Action.REPLACE:
            reason = reason or "ReplacingPod"
            parts.append(f"replacing {record.pod} ({why}): waiting for a replacement to "
                         "become ready" + (
                             f" (or, where no node has a GPU free, up to "
                             f"{unschedulable_limit_s:g} s for a node the node autoscaler adds)"
                             if unschedulable_limit_s > UNSCHEDULABLE_S else ""))
        else:
            reason = reason or "DrainingPod"
            parts.append(f"draining {record.pod} ({record.signature}) before removing it")
    for _, plan in sorted(held, key=lambda h: (h[0].pod, h[0].key)):
        reason = reason or HOLDING.get(plan.reason, "HeldBack")
        parts.append(f"held back: {plan.message}")
    if not parts:
        return Report("Remediating", "False", "NoOpenIncidents",
                      "no failure is waiting for an action")
    return Report("Remediating", "True", reason, "; ".join(parts))
