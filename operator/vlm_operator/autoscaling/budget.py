"""The GPU budget: what is free on the nodes a VLMDeployment's pods may use, read from the
watch-fed caches of Nodes and GPU-holding pods (k8s/caches.py), never from a LIST per round.

Two parts ask it: the Builtin autoscaler, before it grants a scale-up (autoscaler.py), and
remediation, before it surges a replacement (remediation/remediator.py's `replica_fits`). It
holds no state of either, so runner.py builds it first and hands it to both. A budget the
caches cannot vouch for raises Stale: unknown is neither free nor full.
"""

from __future__ import annotations

from vlm_operator import metrics
from vlm_operator.api.validation import VLMDeployment
from vlm_operator.desired import children
from vlm_operator.k8s.caches import ClusterCache
from vlm_operator.k8s.nodes import Claim, Node, share_gpus


def placement(vlmd: VLMDeployment) -> dict:
    """What decides which nodes the VLMDeployment's pods may go to."""
    template = children.get_pod_template(vlmd)["spec"]
    return {k: template.get(k) for k in ("nodeSelector", "affinity", "tolerations")}


class GpuBudget:
    def __init__(self, cluster: ClusterCache) -> None:
        self.cluster = cluster

    def start(self) -> None:
        """Start the caches the budget reads (without waiting for them)."""
        self.cluster.start_budget()

    def read(self) -> tuple[list[Node], dict[str, dict[str, int]]]:
        """Schedulable nodes and what is free on each (raises Stale)."""
        nodes, free = self.cluster.budget()
        metrics.AUTOSCALER_FREE_GPUS.set(sum(f.get(children.GPU_RESOURCE, 0)
                                             for f in free.values()))
        return nodes, free

    def replica_fits(self, vlmd: VLMDeployment, pending: int = 0) -> bool:
        """For surge replacements (remediation/remediator.py): whether one more replica fits on
        one node its pods may use, in its GPU resource, once `pending` replicas of it that no
        node holds yet took theirs (placed as share_gpus places a scale-up); raises Stale when
        the budget is unknown."""
        nodes, free = self.read()
        key = (vlmd.namespace, vlmd.name)
        want = max(0, pending) + 1
        claim = Claim(key, 0, vlmd.spec["gpusPerReplica"], 0, 0, want,
                      vlmd.spec["gpuResourceName"], placement(vlmd))
        return share_gpus(nodes, free, [claim])[key] >= want
