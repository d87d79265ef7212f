"""The GPU budget: what is free on the nodes a VLMDeployment's pods may use, read from the
watch-fed caches of Nodes and GPU-holding pods (k8s/caches.py), never from a LIST per round.

Two parts ask it: the Builtin autoscaler, before it grants a scale-up (autoscaler.py), and
remediation, before it surges a replacement (remediation/remediator.py's `replica_fits`). It
holds no state of either, so runner.py builds it first and hands it to both. A budget the
caches cannot vouch for raises Stale: unknown is neither free nor full.

A replica goes only where its pods may go: nodeSelector, node affinity and tolerations, and
the pod affinity a ReadWriteOnce cache claim adds (desired/children.one_node_cache): beside the
pods already bound, on the claim's node (k8s/nodes.affinity_nodes). With `growth` (the admin's
`--node-autoscaler-*` flags), a replica that fits no node may still be granted and left
Pending for a node autoscaler to add a node, within growth's bounds on Pending GPUs.
"""

from __future__ import annotations

from typing import NamedTuple

from vlm_operator import metrics
from vlm_operator.api.names import INSTANCE_LABEL
from vlm_operator.api.validation import VLMDeployment
from vlm_operator.desired import children
from vlm_operator.k8s.caches import ClusterCache
from vlm_operator.k8s.gpu_plan import Claim, Growth, largest_free, plan_gpus
from vlm_operator.k8s.nodes import Node, affinity_nodes


def placement(vlmd: VLMDeployment) -> dict:
    """What decides which nodes the VLMDeployment's pods may go to."""
    template = children.get_pod_template(vlmd)["spec"]
    return {k: template.get(k) for k in ("nodeSelector", "affinity", "tolerations")}


class Grant(NamedTuple):
    """A claim's grant: replicas, how many of them wait for a node to come (growth), and the
    most GPUs free on one node its pods may use (for the message when it falls short)."""

    granted: int
    to_come: int
    most: int


class GpuBudget:
    def __init__(self, cluster: ClusterCache, growth: Growth | None = None) -> None:
        """`growth`: the capacity a node autoscaler may add (None: existing nodes only)."""
        self.cluster = cluster
        self.growth = growth

    def start(self) -> None:
        """Start the caches the budget reads (without waiting for them)."""
        self.cluster.start_budget(unbound=self.growth is not None)

    def read(self) -> tuple[list[Node], dict[str, dict[str, int]]]:
        """Schedulable nodes and what is free on each (raises Stale)."""
        nodes, free = self.cluster.budget()
        metrics.AUTOSCALER_FREE_GPUS.set(sum(f.get(children.GPU_RESOURCE, 0)
                                             for f in free.values()))
        return nodes, free

    def claim(self, vlmd: VLMDeployment, priority: int, current: int, bound: int,
              desired: int) -> Claim:
        """The VLMDeployment's ask, with the nodes its pod affinity lets its replicas join
        (raises Stale)."""
        pod_spec, beside = placement(vlmd), None
        if (pod_spec.get("affinity") or {}).get("podAffinity"):
            beside = affinity_nodes(pod_spec, vlmd.namespace,
                                    children.get_selector_labels(vlmd.name),
                                    self.cluster.pod_uses())
        return Claim((vlmd.namespace, vlmd.name), priority, vlmd.spec["gpusPerReplica"], current,
                     bound, desired, vlmd.spec["gpuResourceName"], pod_spec, beside)

    def grant(self, claims: list[Claim], key: tuple[str, str], grow: bool = True) -> Grant:
        """The claim `key`'s grant when `claims` share the free GPUs, with growth unless `grow`
        is False (raises Stale)."""
        nodes, free = self.read()
        growth, elsewhere = (self.growth if grow else None), 0
        if growth is not None:
            keys, resources = {c.key for c in claims}, {c.resource for c in claims}
            elsewhere = sum(n for use in self.cluster.unbound_uses()
                            if (use.namespace, dict(use.labels).get(INSTANCE_LABEL))
                            not in keys
                            for r, n in use.requests.items() if r in resources)
        share = plan_gpus(nodes, free, claims, growth, elsewhere)[key]
        claim = next(c for c in claims if c.key == key)
        return Grant(share.granted, share.to_come, largest_free(
            nodes, free, claim.resource, claim.pod_spec, claim.beside))

    def replica_fits(self, vlmd: VLMDeployment, pending: int = 0) -> bool:
        """For surge replacements (remediation/remediator.py): whether one more replica fits on
        one node its pods may use, in its GPU resource, once `pending` replicas of it that no
        node holds yet took theirs (placed as plan_gpus places a scale-up), or, with growth,
        may wait for a node to come; raises Stale when the budget is unknown."""
        want = max(0, pending) + 1
        claim = self.claim(vlmd, 0, 0, 0, want)
        return self.grant([claim], claim.key).granted >= want
