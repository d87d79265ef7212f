"""What the Remediator tells: Events on the pod and its VLMDeployment, status.lastRemediation,
and the texts of the Events a multi-step action ends or times out with, or its records' annotation
read with findings."""

from __future__ import annotations

import logging
import time

from kubernetes.client.exceptions import ApiException

from vlm_operator.api import annotation_json
from vlm_operator.api.actions import MULTI_STEP
from vlm_operator.api.names import IN_FLIGHT
from vlm_operator.api.reports import Event
from vlm_operator.k8s.kube import Kube, now_iso
from vlm_operator.remediation.incidents import (
    MAX_IN_FLIGHT,
    NODE_DRAIN,
    Incident,
    InFlight,
    InFlightRead,
)
from vlm_operator.remediation.steps import UNSCHEDULABLE_S, Step

log = logging.getLogger(__name__)


def post(kube: Kube, namespace: str, name: str, pod: dict | None, event: Event,
         body: dict | None = None) -> None:
    """The Event on the pod (when it still exists) and on its VLMDeployment."""
    if pod is not None:
        kube.post_event({**pod, "apiVersion": "v1", "kind": "Pod"}, event)
    body = body or kube.get_vlmd(namespace, name)
    if body is not None:
        kube.post_event(body, event)


def last_remediation(kube: Kube, namespace: str, name: str, incident: Incident, *,
                     action: str, reason: str, rung: str | None = None) -> None:
    try:
        kube.patch_vlmd_status(namespace, name, {"lastRemediation": {
            "time": now_iso(), "pod": incident.pod, "signature": incident.signature,
            "action": action, "reason": reason[:1024], "rung": rung}})
    except ApiException as exc:
        log.warning("lastRemediation of %s/%s: %s", namespace, name, exc.reason)


def held(kube: Kube, namespace: str, name: str, pod: dict | None, incident: Incident,
         message: str, body: dict | None) -> None:
    """An incident held back: the Event and lastRemediation (once per reason)."""
    log.info("%s/%s: holding back: %s", namespace, name, message)
    post(kube, namespace, name, pod, Event("Warning", "RemediationSkipped", message), body)
    last_remediation(kube, namespace, name, incident, action="Skipped", reason=message)


def failed(kube: Kube, namespace: str, name: str, pod: dict | None, incident: Incident,
           exc: ApiException, until: float, body: dict | None) -> None:
    """An action's API call failed; it is retried at `until`."""
    message = (f"acting on {incident.signature} on {incident.pod} failed: {exc.status} "
               f"{exc.reason}; retrying in {until - time.time():.0f} s")
    log.warning("%s/%s: %s", namespace, name, message)
    post(kube, namespace, name, pod, Event("Warning", "RemediationFailed", message), body)


def drain_timed_out(pod: str, seconds: float, running: float | None) -> str:
    return (f"drain of {pod} timed out after {seconds:.0f} s with "
            + (f"{running:g} requests in flight" if running is not None
               else "its load unknown (/metrics unreadable)"))


def replace_ended(record: InFlight, step: Step, *, replicas: int, now: float,
                  node_drain_wait_s: float, replacement_serves: bool) -> Event | None:
    """The Event for a Replace that ended without the operator deleting its pod: it gave up,
    or the pod left by another hand (an eviction by its node's drain, once the
    PodDisruptionBudget let it through; a user's delete). None: not such a step, or the
    operator deleted the pod and said so then."""
    texts = {
        Step.FINISH: ("Normal", "PodReplaced", (
            f"{record.pod} left without the operator deleting it (evicted, as by its node's "
            "drain, or deleted by another hand)" + (
                ", once its replacement served" if replacement_serves
                else "; its ReplicaSet brings up another pod"))),
        Step.GIVE_UP: ("Warning", "ReplaceFailed", (
            f"gave up replacing {record.pod}: no replacement became ready in "
            f"{now - record.since:.0f} s or the scheduler refused it for "
            f"{UNSCHEDULABLE_S:g} s; it keeps serving")),
        Step.ABANDON: ("Warning", "ReplaceAbandoned", (
            f"gave up replacing {record.pod}: spec.replicas went from {record.replicas} to "
            f"{replicas} meanwhile (another writer owns it: an HPA, KEDA, the Builtin "
            "autoscaler or a user), so the ReplicaSet removes the replacement that was "
            "still coming up; it keeps serving")),
        Step.DROP: ("Normal", "NodeDrainCancelled", (
            f"{record.pod}: its node {record.node} is no longer leaving, or enough other "
            "pods serve for its eviction to go through; nothing left to do for it")),
    }
    if step not in texts or (step == Step.FINISH and record.deleted):
        return None
    kind, reason, text = texts[step]
    if record.signature == NODE_DRAIN and step in (Step.GIVE_UP, Step.ABANDON):
        text += ("; it waits for the node drain's limit (--node-drain-wait-seconds="
                 f"{node_drain_wait_s:g}; a cordon alone has none)")
    return Event(kind, reason, text)


def in_flight_read(read: InFlightRead, unknown: tuple[str, ...]) -> list[Event]:
    """What to say about an IN_FLIGHT annotation read with records dropped or unknown actions
    (`unknown`: their names)."""
    out = []
    if read.dropped or read.unreadable:
        out.append(Event("Warning", "InFlightRecordsDropped", (
            f"annotation {IN_FLIGHT} is unreadable (longer than {annotation_json.MAX_CHARS} "
            f"characters, nested deeper than {annotation_json.MAX_DEPTH} or not a JSON object):"
            " no action is driven from it, and the next one recorded replaces it"
            if read.unreadable else
            f"{read.dropped} record(s) of annotation {IN_FLIGHT} dropped: not a record the "
            f"operator reads, or past the first {MAX_IN_FLIGHT} per VLMDeployment")))
    if unknown:
        out.append(Event("Warning", "InFlightActionUnknown", (
            f"{len(read.unknown)} record(s) of annotation {IN_FLIGHT} name an action this "
            f"operator does not know ({', '.join(unknown)}; it knows {', '.join(MULTI_STEP)}):"
            " kept as written and not driven; an operator of a newer version wrote them?")))
    return out
