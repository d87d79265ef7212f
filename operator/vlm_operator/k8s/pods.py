"""Pure reads of objects that need more than a view's accessor (k8s/views.py): the Ready
condition pods and nodes share, owners, RFC3339 times, and the part of a pod the operator
keeps. No API calls."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from vlm_operator.api.names import (
    ACTED_UNTIL,
    DRAIN_SINCE,
    FENCE,
    GROUP,
    IN_SERVICE_LABEL,
    INSTANCE_LABEL,
    KIND,
    LOG_MARK,
    RECOVERED_IN_PLACE,
    RESTART_REQUEST,
)

# What of a pod's metadata the operator keeps (kept_pod). The tenant may write labels and
# annotations on the pods of its namespace, up to 256 KiB of annotations per pod: none of that
# is held beyond what the operator reads.
KEPT_ANNOTATIONS = frozenset({LOG_MARK, FENCE, DRAIN_SINCE, ACTED_UNTIL, RECOVERED_IN_PLACE,
                              RESTART_REQUEST})  # the operator's own pod annotations
MAX_KEPT_ANNOTATION = 4096  # characters of one; the operator writes far less (a mark: 4 KiB)
KEPT_LABELS = frozenset({INSTANCE_LABEL, "app.kubernetes.io/name", "app.kubernetes.io/component",
                         "app.kubernetes.io/managed-by", IN_SERVICE_LABEL})  # the ones it sets
MAX_KEPT_OWNER_REFS = 4  # the controller, and references to a VLMDeployment
_KEPT_META = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
              "deletionTimestamp", "deletionGracePeriodSeconds")


def ready_condition(obj: Mapping) -> Mapping:
    """The object's (pod's, node's) Ready condition; {} when it has none."""
    return next((c for c in (obj.get("status") or {}).get("conditions") or []
                 if c.get("type") == "Ready"), {})


def is_ready(obj: Mapping) -> bool:
    """Its Ready condition is True (a pod's readiness probe passes, a node is Ready)."""
    return ready_condition(obj).get("status") == "True"


def controller_of(obj: Mapping) -> dict | None:
    """`obj`'s controller ownerReference, if it has one."""
    return next((ref for ref in (obj.get("metadata") or {}).get("ownerReferences") or []
                 if ref.get("controller")), None)


def vlmd_name(obj: Mapping) -> str | None:
    """The VLMDeployment a child belongs to: its controller ownerReference, else the label."""
    meta = obj.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(GROUP):
            return ref.get("name")
    return (meta.get("labels") or {}).get(INSTANCE_LABEL)


def rfc3339(t: float) -> str:
    """Epoch seconds as the API's RFC3339 time to the second (UTC), as parse_time reads it."""
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> float | None:
    """An RFC3339 time (metadata.creationTimestamp, a condition's lastTransitionTime) as epoch
    seconds; None when absent or unreadable."""
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def kept_pod(pod: Mapping) -> dict:
    """The pod as the operator holds it (the pod cache, a log follower): spec and status as they
    are (the operator's template and the kubelet write those), metadata cut to what is read:
    no managedFields, only the operator's own labels and annotations (an annotation longer than
    MAX_KEPT_ANNOTATION is none the operator wrote and is dropped), the controller and
    VLMDeployment owner references (at most MAX_KEPT_OWNER_REFS)."""
    meta = pod.get("metadata") or {}
    kept = {k: meta[k] for k in _KEPT_META if k in meta}
    labels = meta.get("labels") or {}
    kept["labels"] = {k: labels[k] for k in KEPT_LABELS if k in labels}
    annotations = meta.get("annotations") or {}
    kept["annotations"] = {k: v for k in KEPT_ANNOTATIONS
                           if isinstance(v := annotations.get(k), str)
                           and len(v) <= MAX_KEPT_ANNOTATION}
    refs = [r for r in meta.get("ownerReferences") or [] if isinstance(r, Mapping) and (
        r.get("controller") or r.get("kind") == KIND)]
    if refs:
        kept["ownerReferences"] = refs[:MAX_KEPT_OWNER_REFS]
    return {**pod, "metadata": kept}

