"""The thin actors: each makes the API calls of one action step through the Kube wrapper, and
decides nothing (remediation/decide.py and steps.py did).

Deletions: a pod that serves nothing, or that the operator drained itself, is deleted with a
short grace period (stopping.QUICK_GRACE_S); a pod that still serves (a Restart) with its own,
during which its preStop hook lets its requests finish.
"""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

from vlm_operator.api.names import ACTED_UNTIL, FENCE, RECOVERED_IN_PLACE, RESTART_REQUEST
from vlm_operator.desired import children, stopping
from vlm_operator.k8s.kube import Kube
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.remediation import ladder
from vlm_operator.remediation.incidents import (
    HISTORY,
    IN_FLIGHT,
    InFlight,
    history_value,
    in_flight_value,
    merged_history,
    read_in_flight,
)

CONFLICT_RETRIES = 5


def pod_uids(pods: list[dict]) -> tuple[str, ...]:
    """The pods there are before a surge (its replacement is the one not among them)."""
    return tuple(sorted(Pod(p).uid for p in pods))


def restart(kube: Kube, namespace: str, *, pod: str, uid: str, serves: bool) -> bool:
    """Delete the pod for its ReplicaSet to make a fresh one; one that still serves keeps its
    grace period (its preStop drains it). False: it was gone already."""
    return kube.delete("v1", "Pod", namespace, pod, uid=uid,
                       grace_s=None if serves else stopping.QUICK_GRACE_S)


def delete_quickly(kube: Kube, namespace: str, *, pod: str, uid: str) -> bool:
    """Delete a pod that serves nothing, or was drained: a short grace period."""
    return kube.delete("v1", "Pod", namespace, pod, uid=uid, grace_s=stopping.QUICK_GRACE_S)


def take_out_of_service(kube: Kube, namespace: str, pod: dict | None) -> None:
    """Out of the Service (again: an autoscaler that took it out may have put it back)."""
    if pod is not None and Pod(pod).labels.get(
            children.IN_SERVICE_LABEL) != "false":
        kube.patch_pod(namespace, Pod(pod).name,
                       labels={children.IN_SERVICE_LABEL: "false"})


def fence(kube: Kube, namespace: str, pod: str, fence: ladder.Fence, *,
          request: bool = False) -> None:
    """Out of the Service with the fence recorded, in one patch; with `request`, the in-place
    restart request for the engine plugin too."""
    annotations = {FENCE: ladder.fence_value(fence)}
    if request:
        annotations[RESTART_REQUEST] = f"{fence.signature}@{fence.incident:.3f}"
    kube.patch_pod(namespace, pod, labels={children.IN_SERVICE_LABEL: "false"},
                   annotations=annotations)


def unfence(kube: Kube, namespace: str, pod: str, *, now: float, recovered: str) -> None:
    """Back into the Service after an in-place recovery; what was detected until now was
    acted on (the restart request stays: the plugin acts only on a new one); `recovered`: the
    pod's in-place recoveries with this one (remediation/suspect.py)."""
    kube.patch_pod(namespace, pod, labels={children.IN_SERVICE_LABEL: "true"},
                   annotations={FENCE: None, ACTED_UNTIL: f"{now:.3f}",
                                RECOVERED_IN_PLACE: recovered})


def record_remediation(kube: Kube, namespace: str, name: str, history: list[float], *,
                       now: float) -> list[float]:
    """One more remediation in the last hour, kept on the VLMDeployment for the budget; the
    history with it."""
    history = merged_history(history, [now], now=now)
    kube.patch_vlmd_annotations(namespace, name, {HISTORY: history_value(history)})
    return history


def write_in_flight(kube: Kube, namespace: str, name: str, *, add: InFlight | None = None,
                    remove: str | None = None) -> dict[str, InFlight] | None:
    """Add or drop one record, read-modify-write on the current object (409: read again); the
    records written (None: the VLMDeployment is gone)."""
    for attempt in range(CONFLICT_RETRIES):
        body = kube.get_vlmd(namespace, name)
        if body is None:
            return None
        read = read_in_flight(Body(body).annotations)
        records = read.records
        if add is not None:
            records[add.uid] = add
        if remove is not None:
            records.pop(remove, None)
        try:
            kube.patch_vlmd_annotations(
                namespace, name, {IN_FLIGHT: in_flight_value(records, read.unknown)},
                resource_version=Body(body).resource_version)
        except ApiException as exc:
            if exc.status == 409 and attempt < CONFLICT_RETRIES - 1:
                continue
            raise
        return records
    return None
