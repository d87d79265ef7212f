"""The cluster's GPU budget, as nodes and pods show it: what each node offers (readiness,
labels, taints, extended resources), what the pods bound to it hold, whether it is leaving, and
which nodes a pod may go to (how free GPUs are shared: k8s/gpu_plan.py). Pure: node and pod
objects in.

k8s/caches.py keeps the nodes and GPU pods this reads; the Builtin autoscaler
(autoscaling/autoscaler.py) asks it where replicas fit.
"""

from __future__ import annotations

from typing import NamedTuple

from vlm_operator.k8s.pods import is_ready
from vlm_operator.k8s.views import Body, Pod

# A replica needs gpusPerReplica units of its GPU resource (spec.gpuResourceName: nvidia.com/gpu,
# a MIG profile such as nvidia.com/mig-1g.10gb, amd.com/gpu, ...) on ONE node, and only on nodes
# its pods may go to: their nodeSelector, required node affinity and tolerations (the pod
# template's, desired/children.get_pod_template). Two nodes with one free GPU each hold no 2-GPU
# replica.
# A required pod affinity to the replica's own pods by hostname (the one desired/children.py adds
# for a ReadWriteOnce cache claim: every replica on the claim's node) is predicted: replicas go
# only to nodes that hold one of its pods, and all to one node while none is bound (see
# `affinity_nodes`). Other inter-pod (anti-)affinity and topology spread are not predicted:
# replicas they keep out stay Pending, are seen as such and hold their claim.

class Taint(NamedTuple):
    key: str
    value: str
    effect: str


class Node(NamedTuple):
    """A Ready, schedulable Node as the budget sees it."""

    name: str
    labels: dict[str, str]
    taints: tuple[Taint, ...]
    allocatable: dict[str, int]  # extended resources (a domain-prefixed name) only


class PodUse(NamedTuple):
    """Extended resources a pod bound to `node` holds, with what a pod affinity may select it
    by: its namespace and its app.kubernetes.io/ labels (at most LABELS_KEPT of them)."""

    node: str
    requests: dict[str, int]
    namespace: str = ""
    labels: tuple[tuple[str, str], ...] = ()


LABEL_PREFIX = "app.kubernetes.io/"  # the labels the operator's own pod affinity selects by
LABELS_KEPT = 8


def _extended(name: str) -> bool:
    """Extended resources (GPUs and other devices) are domain-prefixed and count in units;
    cpu, memory, hugepages-* and ephemeral-storage are not, nor is kubernetes.io's domain."""
    return "/" in name and not name.split("/", 1)[0].endswith("kubernetes.io")


def _units(value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0  # extended resources are whole numbers; anything else holds no device


def _container_requests(container: dict) -> dict[str, int]:
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    # an extended resource's request defaults to its limit (they must be equal)
    return {k: _units(v) for k, v in {**limits, **requests}.items() if _extended(k)}


def pod_requests(pod_spec: dict) -> dict[str, int]:
    """Extended resources a pod requests: its containers' sum, or its largest init container."""
    total: dict[str, int] = {}
    for container in pod_spec.get("containers") or []:
        for name, n in _container_requests(container).items():
            total[name] = total.get(name, 0) + n
    for container in pod_spec.get("initContainers") or []:
        for name, n in _container_requests(container).items():
            total[name] = max(total.get(name, 0), n)
    return {k: v for k, v in total.items() if v > 0}


def pod_use(pod: dict) -> PodUse | None:
    """What a pod holds: bound, not finished, requesting an extended resource; else None."""
    node = Pod(pod).node_name
    if not node or Pod(pod).phase in ("Succeeded", "Failed"):
        return None
    return _use(pod, node)


def pending_use(pod: dict) -> PodUse | None:
    """What a pod no node holds yet asks for (node ""): Pending, unbound, not being deleted,
    requesting an extended resource; else None."""
    meta = Pod(pod)
    if meta.node_name or meta.deleting or (meta.phase or "Pending") != "Pending":
        return None
    return _use(pod, "")


def _use(pod: dict, node: str) -> PodUse | None:
    requests = pod_requests(pod.get("spec") or {})
    if not requests:
        return None
    meta = Pod(pod)
    labels = sorted((k, v) for k, v in meta.labels.items()
                    if isinstance(k, str) and isinstance(v, str) and k.startswith(LABEL_PREFIX))
    return PodUse(node, requests, str(meta.namespace), tuple(labels[:LABELS_KEPT]))


def node_of(node: dict) -> Node | None:
    """The budget's view of a Node; None for one that takes no new pods (not Ready, cordoned)."""
    spec, status = node.get("spec") or {}, node.get("status") or {}
    if spec.get("unschedulable") or not is_ready(node):
        return None
    taints = tuple(Taint(t.get("key", ""), t.get("value", ""), t.get("effect", ""))
                   for t in spec.get("taints") or [])
    allocatable = {k: _units(v) for k, v in (status.get("allocatable") or {}).items()
                   if _extended(k)}
    return Node(Body(node).name, dict(Body(node).labels), taints,
                allocatable)


# Taints the cluster autoscaler and Karpenter (v1; `karpenter.sh/disruption` before it) put on
# nodes they are about to remove: evidence of a drain.
LEAVING_TAINTS = {"ToBeDeletedByClusterAutoscaler": "the cluster autoscaler removes it",
                  "karpenter.sh/disrupted": "Karpenter removes it",
                  "karpenter.sh/disruption": "Karpenter removes it"}
# The taint the node lifecycle controller puts on every cordoned node. Named as a drain marker
# (--node-drain-markers), it makes every cordon a drain.
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
MAX_MARKERS = 32


class Marker(NamedTuple):
    """A drain marker the admin names: a taint key or a label key, and its value if given."""

    key: str
    value: str | None = None

    def matches(self, labels: dict, taints: list[dict]) -> bool:
        """Whether a node of these labels and taints carries the marker."""
        pairs = [*((t.get("key"), t.get("value", "")) for t in taints), *labels.items()]
        return any(k == self.key and (self.value is None or v == self.value) for k, v in pairs)


def parse_markers(text: str) -> tuple[Marker, ...]:
    """`KEY[=VALUE],...`, as --node-drain-markers takes it (cli.py checks each is a label key
    or key=value); ValueError past MAX_MARKERS."""
    items = [i.strip() for i in text.split(",") if i.strip()]
    if len(items) > MAX_MARKERS:
        raise ValueError(f"{len(items)} markers, at most {MAX_MARKERS}")
    return tuple(Marker(key, value if sep else None)
                 for key, sep, value in (i.partition("=") for i in items))


class Leaving(NamedTuple):
    """Why a node is about to go, and whether it shows a drain (not just a cordon)."""

    why: str
    drain: bool


class NodeState(NamedTuple):
    """A Node as the operator's node cache keeps it."""

    name: str
    budget: Node | None  # as the GPU budget sees it (None: it takes no new pods)
    leaving: Leaving | None  # why it is about to go, if it is


def leaving(node: dict, markers: tuple[Marker, ...] = ()) -> Leaving | None:
    """Why a node is about to go; None when it is not. A drain (drain=True): a taint of the
    cluster autoscaler or Karpenter, or one of the admin's `markers` (a taint or label). A
    cordon alone (spec.unschedulable or its taint: kubectl cordon, a GPU health tool, the first
    step of kubectl drain) stops new pods, not old ones: drain=False. A refused eviction leaves
    no trace to watch: these are what is seen of a drain before it evicts."""
    spec = node.get("spec") or {}
    taints = [t for t in spec.get("taints") or [] if isinstance(t, dict)]
    labels = Body(node).labels
    cordoned = bool(spec.get("unschedulable")) or any(
        t.get("key") == UNSCHEDULABLE_TAINT for t in taints)
    for taint in taints:
        if taint.get("key") in LEAVING_TAINTS:
            return Leaving(f"{LEAVING_TAINTS[taint['key']]} (taint {taint['key']})", True)
    # the cordon's taint may lag spec.unschedulable: either matches the marker of the taint
    seen = [*taints, {"key": UNSCHEDULABLE_TAINT, "value": ""}] if cordoned else taints
    for marker in markers:
        if marker.matches(labels, seen):
            return Leaving(f"drain marker {marker.key}"
                           + ("" if marker.value is None else f"={marker.value}")
                           + (", cordoned" if cordoned else ""), True)
    if cordoned:
        return Leaving("cordoned (spec.unschedulable: kubectl cordon, or kubectl drain before "
                       "it evicts), no drain marker", False)
    return None


def node_state(node: dict, markers: tuple[Marker, ...] = ()) -> NodeState | None:
    """What the node cache keeps of a Node: its budget view, why it leaves; None when it
    neither takes pods nor is leaving (not Ready). `markers`: the admin's drain markers."""
    why = leaving(node, markers)
    budget = node_of(node) if why is None else None
    if budget is None and why is None:
        return None
    return NodeState(Body(node).name, budget, why)


def free_by_node(nodes: list[Node], uses: list[PodUse]) -> dict[str, dict[str, int]]:
    """Per node, allocatable extended resources minus what bound pods request.

    Pending (unbound) pods are not subtracted: they are what the budget is shared between.
    """
    free = {n.name: dict(n.allocatable) for n in nodes}
    for use in uses:
        left = free.get(use.node)
        if left is None:
            continue
        for name, n in use.requests.items():
            left[name] = left.get(name, 0) - n
    return {name: {k: max(0, v) for k, v in left.items()} for name, left in free.items()}


def tolerates(tolerations: list[dict], taint: Taint) -> bool:
    """Kubernetes' ToleratesTaint, for any of `tolerations`."""
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.effect:
            continue
        if tol.get("key") and tol["key"] != taint.key:
            continue
        if tol.get("operator") == "Exists" or tol.get("value", "") == taint.value:
            return True
    return False


def _expression(expr: dict, values: dict[str, str]) -> bool:
    key, op, wanted = expr.get("key", ""), expr.get("operator"), expr.get("values") or []
    have = values.get(key)
    if op == "In":
        return have is not None and have in wanted
    if op == "NotIn":
        return have is None or have not in wanted
    if op == "Exists":
        return have is not None
    if op == "DoesNotExist":
        return have is None
    if op in ("Gt", "Lt") and have is not None and len(wanted) == 1:
        try:
            a, b = int(have), int(wanted[0])
        except ValueError:
            return False
        return a > b if op == "Gt" else a < b
    return False


def _term(term: dict, node: Node) -> bool:
    exprs, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not exprs and not fields:  # an empty term matches no node
        return False
    return (all(_expression(e, node.labels) for e in exprs)
            and all(_expression(f, {"metadata.name": node.name}) for f in fields))


def node_fits(pod_spec: dict, node: Node) -> bool:
    """Whether the scheduler may put a pod of `pod_spec` on `node`: nodeSelector, required node
    affinity, and taints with effect NoSchedule or NoExecute tolerated (resources aside)."""
    if any(node.labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if required is not None and not any(_term(t, node)
                                        for t in required.get("nodeSelectorTerms") or []):
        return False
    tolerations = pod_spec.get("tolerations") or []
    return all(tolerates(tolerations, t) for t in node.taints
               if t.effect in ("NoSchedule", "NoExecute"))


HOSTNAME = "kubernetes.io/hostname"


def affinity_nodes(pod_spec: dict, namespace: str, labels: dict[str, str],
                   uses: list[PodUse]) -> frozenset[str] | None:
    """The nodes a pod of `pod_spec` (in `namespace`, labelled `labels`) may join under its
    required pod affinity by hostname to pods like itself: those holding a bound pod its
    selector matches. Empty: no such pod is bound, so the scheduler lets the first go to any
    node and the others follow it (all on one node). None: no such term to predict.

    Predicted are terms with topologyKey kubernetes.io/hostname whose selector is matchLabels
    only, on app.kubernetes.io/ labels the pod itself carries, in its own namespace; others are
    left to the scheduler."""
    allowed: frozenset[str] | None = None
    terms = (((pod_spec.get("affinity") or {}).get("podAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or [])
    for term in terms:
        selector = term.get("labelSelector") or {}
        wanted = selector.get("matchLabels") or {}
        if (term.get("topologyKey") != HOSTNAME or selector.get("matchExpressions") or not wanted
                or term.get("namespaces") not in (None, [], [namespace])
                or any(not k.startswith(LABEL_PREFIX) or labels.get(k) != v
                       for k, v in wanted.items())):
            continue
        here = frozenset(u.node for u in uses if u.namespace == namespace
                         and all(dict(u.labels).get(k) == v for k, v in wanted.items()))
        allowed = here if allowed is None else allowed & here
    return allowed
