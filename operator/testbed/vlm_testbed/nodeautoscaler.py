"""A stand-in for a node autoscaler (cluster-autoscaler, Karpenter) on the test bed.

What it models is the one behaviour the operator relies on: a pod the scheduler refused
(PodScheduled=False, reason Unschedulable) that asks for GPUs makes a node with GPUs appear,
after a provisioning delay. Each refused GPU pod not yet covered starts one provisioning; the
pods refused while it runs wait for that node, as a node group's scale-up of one would. At most
`max_nodes` are added. Not modelled: node groups and instance types, a pod's own constraints
(the node added is a plain GPU node), nodes that fail to come, and removing empty nodes.

`add_node(index)` registers the node (vlm_testbed.nodesim: a NodeSimulator with that many
GPUs); the stand-in only decides when.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from vlm_operator.api.names import GPU_RESOURCE
from vlm_operator.k8s.nodes import pending_use

POLL_S = 0.5


def refused_gpu_pods(pods: list[dict], resource: str = GPU_RESOURCE) -> list[str]:
    """Uids of the unbound pods the scheduler refused that ask for `resource`."""
    return [p["metadata"]["uid"] for p in pods
            if (use := pending_use(p)) is not None and use.requests.get(resource, 0) > 0
            and any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
                    and c.get("status") == "False"
                    for c in (p.get("status") or {}).get("conditions") or [])]


class NodeAutoscaler:
    def __init__(self, list_pods: Callable[[], list[dict]], add_node: Callable[[int], Any], *,
                 delay_s: float = 10.0, max_nodes: int = 1, resource: str = GPU_RESOURCE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`list_pods()`: the pods it looks at, as plain dicts (one namespace's, in the bed);
        `delay_s`: from the first refusal seen to the node's registration."""
        self.list_pods, self.add_node = list_pods, add_node
        self.delay_s, self.max_nodes, self.resource, self.clock = (delay_s, max_nodes,
                                                                   resource, clock)
        self.covered: set[str] = set()  # pods a node was (or is being) provisioned for
        self.due: list[float] = []  # when each provisioning in progress registers its node
        self.added: list[float] = []  # when each node was registered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="node-autoscaler")

    def tick(self) -> None:
        """One look: start a provisioning for refused GPU pods no node is coming for, and
        register the nodes whose delay has passed."""
        now = self.clock()
        refused = [uid for uid in refused_gpu_pods(self.list_pods(), self.resource)
                   if uid not in self.covered]
        if refused and self.due:  # a node is coming: they wait for it
            self.covered.update(refused)
        elif refused and len(self.added) < self.max_nodes:
            self.due.append(now + self.delay_s)
            self.covered.update(refused)
        for at in [t for t in self.due if t <= now]:
            self.due.remove(at)
            self.add_node(len(self.added))
            self.added.append(self.clock())

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.tick()

    def start(self) -> NodeAutoscaler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
