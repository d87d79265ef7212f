"""The capacity guards, pure: which pods serve, which count as capacity, whether removing one
would break spec.health.minAvailable (then it is replaced rather than removed), what a pod on a
leaving node needs, and the restart budget of the last hour.

minAvailable only protects capacity: removing a pod that serves nothing (engine dead, not
ready) never lowers it, so a single dead replica, or every replica dead at once, is restarted.
A pod an action is already removing is not counted as capacity.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vlm_operator.api.actions import Action
from vlm_operator.api.health_signals import NOT_SERVING
from vlm_operator.api.reports import Report
from vlm_operator.desired import children
from vlm_operator.k8s.pods import is_ready
from vlm_operator.k8s.views import Pod
from vlm_operator.remediation.incidents import restarts_in_hour
from vlm_operator.remediation.policy import HealthPolicy
from vlm_operator.remediation.steps import Step


@dataclass(frozen=True, slots=True)
class Standing:
    """Where a pod stands for the guards and the decision: ready, going, in the Service, its
    engine dead, an action on it in flight."""

    name: str
    ready: bool
    deleting: bool = False
    in_service: bool = True
    engine_dead: bool = False  # the log says so: not ready capacity whatever the probe says
    in_flight: bool = False  # an action on it (drain, replacement) is under way

    @property
    def serves(self) -> bool:
        """It may hold requests: ready, not going away, its engine alive (in the Service or
        taken out of it to drain: requests already sent still finish there)."""
        return self.ready and not self.deleting and not self.engine_dead

    @property
    def capacity(self) -> bool:
        """It serves and takes new requests (the Service selects it)."""
        return self.serves and self.in_service


def standing(pod: Mapping, engine_dead: bool = False, in_flight: bool = False) -> Standing:
    meta = Pod(pod)
    return Standing(meta.name, is_ready(pod), meta.deleting,
                    meta.labels.get(children.IN_SERVICE_LABEL, "true") != "false", engine_dead,
                    in_flight)


def others_ready(pods: Iterable[Standing], pod: str) -> int:
    """Pods other than `pod` that take requests and stay: one an action in flight is about to
    remove (a Replace's sick pod, a drain) is not counted, so its replacement is not taken for
    spare capacity by another removal."""
    return sum(1 for p in pods if p.capacity and not p.in_flight and p.name != pod)


def needs_replacement(pods: Iterable[Standing], pod: str, policy: HealthPolicy,
                      signature: str = "") -> bool:
    """Removing `pod` would take ready capacity below minAvailable: it serves, and too few
    others do. A pod that serves nothing can always go: not ready, its engine dead, or proven
    mute by the signal itself (a stalled engine, an API server that answers nothing)."""
    standings = list(pods)
    target = next((p for p in standings if p.name == pod), None)
    if target is None or not target.capacity or signature in NOT_SERVING:
        return False
    return others_ready(standings, pod) < policy.min_available


def node_drain_action(pod: Standing, pods: Iterable[Standing], policy: HealthPolicy,
                      always_allow: bool) -> str | None:
    """What a pod on a leaving node needs from the operator, or None where its eviction goes
    through by itself.

    The PodDisruptionBudget (minAvailable ready pods) refuses the eviction of a ready pod when
    the others ready are fewer than minAvailable, and, unless it allows the eviction of
    unhealthy pods (unhealthyPodEvictionPolicy AlwaysAllow), of a pod that is not ready while
    fewer than minAvailable are. Action.REPLACE: the pod serves and minAvailable protects it: a
    replacement comes up elsewhere first (or it waits for capacity, for a bounded time).
    DELETE: it serves nothing and the budget would refuse its eviction: nothing is lost by
    deleting it, and the drain goes on."""
    standings = list(pods)
    if pod.deleting:
        return None
    ready = sum(1 for p in standings if p.ready and not p.deleting)
    if pod.serves and pod.in_service:
        return Action.REPLACE if needs_replacement(standings, pod.name, policy) else None
    if pod.ready:  # out of the Service: another action is draining it
        return None
    return Step.DELETE if not always_allow and ready < policy.min_available else None


def budget_report(history: Iterable[float], now: float, policy: HealthPolicy) -> Report | None:
    """Degraded while the restart budget of the last hour is spent: the operator stops acting
    rather than flapping, and says so."""
    spent = restarts_in_hour(history, now)
    if spent < policy.max_restarts_per_hour:
        return None
    return Report("Degraded", "True", "RestartBudgetExhausted",
                  f"{spent} remediations in the last hour (spec.health.maxRestartsPerHour="
                  f"{policy.max_restarts_per_hour}); further failures are only reported")
