"""How the Builtin autoscaler sees a pod (pure: the pod object in): its load state, whether
remediation fenced it (recovering in place: capacity on its way back), or is removing it."""

from __future__ import annotations

from vlm_operator.autoscaling import recommend as a
from vlm_operator.desired import children
from vlm_operator.k8s.pods import is_ready
from vlm_operator.k8s.views import Pod
from vlm_operator.remediation import ladder


def pod_state(pod: dict) -> str:
    """READY: its /metrics say its load (an unreadable one is UNKNOWN). That includes a pod
    whose container started and runs but is not Ready (a failing readiness probe, the node
    controller marking an unreachable node's pods): requests may be in flight there, so it is
    never "loading", which a drain would count as drained at once."""
    st = pod.get("status") or {}
    ready = is_ready(pod)
    started = any(c.get("started") and "running" in (c.get("state") or {})
                  for c in st.get("containerStatuses") or [])
    if st.get("podIP") and (ready or started):
        return a.READY
    return a.LOADING if Pod(pod).node_name else a.PENDING


def fenced(pod: dict) -> bool:
    return ladder.parse_fence(Pod(pod).annotations) is not None


def removed_elsewhere(pod: dict) -> bool:
    """Out of the Service, but not by this autoscaler nor fenced: remediation is removing it."""
    labels = Pod(pod).labels
    return labels.get(children.IN_SERVICE_LABEL) == "false" and \
        a.draining_since(pod) is None and not fenced(pod)
