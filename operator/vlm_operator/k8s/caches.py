"""Watch-fed caches (informer-style) of what the operator reads across the cluster.

- Nodes, as the GPU budget sees them (k8s/nodes.py, Node: readiness, labels, taints, extended
  resources) and whether they are leaving (a drain, the cluster autoscaler, Karpenter), and
  the pods bound to them that hold extended resources such as GPUs (PodUse): the
  GPU budget of the Builtin autoscaler and of surge replacements, and the node drains every
  round looks for. With them, the managed pods no node holds yet (what the GPUs left Pending
  for a node autoscaler are counted from; only those whose owner chain leads to the operator).
- The managed vLLM pods, for every VLMDeployment's once-a-second round (runtime/rounds.py):
  only pods whose owner chain leads to a VLMDeployment (Kube.owned_pods), in the small form
  of pods.kept_pod.

The caches are Informers (k8s/informer.py): a LIST, then a WATCH; unknown is not zero.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from vlm_operator.api.names import INSTANCE_LABEL
from vlm_operator.k8s.informer import Informer, Stale, Watchdog
from vlm_operator.k8s.kube import Kube
from vlm_operator.k8s.nodes import (
    Leaving,
    Marker,
    Node,
    PodUse,
    free_by_node,
    node_state,
    pending_use,
    pod_use,
)
from vlm_operator.k8s.pods import kept_pod
from vlm_operator.k8s.views import Body, Pod

log = logging.getLogger(__name__)

IDLE_S = 600.0  # a namespace's managed-pod cache nobody asked for this long is stopped
MANAGED = "app.kubernetes.io/managed-by=vlm-operator"
BOUND_AND_RUNNING = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
UNBOUND = "spec.nodeName=,status.phase=Pending"


def _keep_unbound(pod: dict) -> dict | None:
    """An unbound managed pod: what its owner check reads, and what it asks for."""
    use = pending_use(pod)
    if use is None:
        return None
    meta = pod["metadata"]
    return {"metadata": {k: meta[k] for k in ("namespace", "name", "uid", "ownerReferences")
                         if k in meta} | {"labels": {
                             INSTANCE_LABEL: Body(pod).labels.get(INSTANCE_LABEL, "")}},
            "use": use}


def _pod_key(pod: dict) -> tuple[str, str]:
    meta = Body(pod)
    return meta.namespace, meta.labels.get(INSTANCE_LABEL, "")


def _labels(selector: str) -> dict[str, str]:
    """An equality-based label selector (builders.get_selector) as a dict."""
    return dict(term.split("=", 1) for term in selector.split(",") if term)


class ClusterCache:
    """The operator's caches, started when first needed. `namespaces`: the operator's (None:
    cluster-wide); managed pods are then watched per namespace, where the operator's
    namespaced permissions are."""

    def __init__(self, kube: Kube, namespaces: list[str] | None = None,
                 watchdog: Watchdog | None = None,
                 owns: Callable[[str, str], bool] = lambda namespace, name: True,
                 drain_markers: tuple[Marker, ...] = ()) -> None:
        """`owns(namespace, name)`: the VLMDeployments whose pods are kept (runtime/sharding.py);
        `drain_markers`: the admin's node drain markers (k8s/nodes.py, leaving)."""
        self.kube, self.namespaced, self.watchdog = kube, bool(namespaces), watchdog
        self.drain_markers = drain_markers
        self.owns = owns
        self._lock = threading.Lock()
        self._informers: dict[str, Informer] = {}
        self._swept = time.monotonic()

    def _informer(self, name: str, path: str, keep, query=(), index=None) -> Informer:
        with self._lock:
            informer = self._informers.get(name)
            if informer is None:
                informer = self._informers[name] = Informer(
                    self.kube, name, path, keep, query, index, self.watchdog).start()
            return informer

    def _nodes(self) -> Informer:
        return self._informer("nodes", "/api/v1/nodes",
                              functools.partial(node_state, markers=self.drain_markers))

    def _gpu_pods(self) -> Informer:
        return self._informer("gpu-pods", "/api/v1/pods", pod_use,
                              (("fieldSelector", BOUND_AND_RUNNING),))

    def _unbound_pods(self) -> Informer:
        return self._informer("unbound-gpu-pods", "/api/v1/pods", _keep_unbound,
                              (("fieldSelector", UNBOUND), ("labelSelector", MANAGED)))

    def start_budget(self, unbound: bool = False) -> None:
        """Start the caches the GPU budget reads (without waiting for them); `unbound`: the
        unbound managed pods too (read only where a node autoscaler adds nodes)."""
        self._nodes()
        self._gpu_pods()
        if unbound:
            self._unbound_pods()

    def pod_uses(self) -> list[PodUse]:
        """What the bound GPU pods hold, where; raises Stale."""
        return self._gpu_pods().values()

    def unbound_uses(self) -> list[PodUse]:
        """What the managed pods no node holds yet ask for, of those whose owner chain leads to
        the operator (node ""); raises Stale."""
        return [pod["use"] for pod in self.kube.owned_pods(self._unbound_pods().values())]

    def budget(self) -> tuple[list[Node], dict[str, dict[str, int]]]:
        """Schedulable nodes and the extended resources free on each; raises Stale."""
        nodes = [state.budget for state in self._nodes().values() if state.budget is not None]
        return nodes, free_by_node(nodes, self._gpu_pods().values())

    def leaving_nodes(self) -> dict[str, Leaving]:
        """Nodes about to go (k8s/nodes.py, leaving) -> why, and whether a drain; raises
        Stale."""
        return {state.name: state.leaving for state in self._nodes().values()
                if state.leaving is not None}

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        """Managed pods of `namespace` matching an equality `selector` whose owner chain leads
        to the operator, as Kube.list_pods (runtime/rounds.py reads these every second); raises
        Stale."""
        wanted = _labels(selector)
        pods = self._managed(namespace).indexed(
            (namespace, wanted.get(INSTANCE_LABEL, "")))
        return self.kube.owned_pods([p for p in pods if all(
            Pod(p).labels.get(k) == v for k, v in wanted.items())])

    def has_pods(self, namespace: str, name: str) -> bool | None:
        """Whether the VLMDeployment `name` has pods labelled as its (list_pods then checks
        their owners), without waiting and without a request: None while the cache cannot say
        (not listed yet, or stale)."""
        try:
            return bool(self._managed(namespace).indexed((namespace, name), wait=False))
        except Stale:
            return None

    def _managed(self, namespace: str) -> Informer:
        if self.namespaced:
            self._stop_idle()
            return self._informer(f"managed-pods {namespace}",
                                  f"/api/v1/namespaces/{namespace}/pods", self._keep_pod,
                                  (("labelSelector", MANAGED),), _pod_key)
        return self._informer("managed-pods", "/api/v1/pods", self._keep_pod,
                              (("labelSelector", MANAGED),), _pod_key)

    def _keep_pod(self, pod: dict) -> dict | None:
        """Only pods whose owner chain leads to a VLMDeployment of this shard, and of those
        only what the operator reads (pods.kept_pod): a tenant's pods labelled like ours, with
        big annotations, cost nothing. A pod whose owners could not be read is kept in that
        small form; list_pods asks again before anything uses it."""
        if not self.owns(*_pod_key(pod)):
            return None
        try:
            if not self.kube.owned_pods([pod]):
                return None
        except ApiException:
            pass
        return kept_pod(pod)

    def _stop_idle(self) -> None:
        """Stop per-namespace caches nobody read for IDLE_S (their VLMDeployments are gone)."""
        now = time.monotonic()
        with self._lock:
            if now - self._swept < IDLE_S / 10:
                return
            self._swept = now
            idle = [n for n, i in self._informers.items()
                    if n.startswith("managed-pods ") and now - i.used_at > IDLE_S]
            for name in idle:
                self._informers.pop(name).stop()

    def stop(self) -> None:
        with self._lock:
            for informer in self._informers.values():
                informer.stop()

