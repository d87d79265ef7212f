"""How free GPUs are shared between replicas (pure): each VLMDeployment's claim in, its share
out, one replica at a time onto the nodes its pods may go to (k8s/nodes.py: node_fits and the
claim's pod affinity), and, where the admin allows it, replicas left Pending for the nodes a
node autoscaler adds. autoscaling/budget.py asks it for the Builtin autoscaler and surges."""

from __future__ import annotations

from typing import NamedTuple

from vlm_operator.api.names import GPU_RESOURCE
from vlm_operator.k8s.nodes import Node, node_fits


class Claim(NamedTuple):
    """One VLMDeployment's ask for GPUs; `bound` replicas already hold theirs."""

    key: tuple[str, str]
    priority: int
    gpus_per_replica: int
    current: int
    bound: int
    desired: int
    resource: str = GPU_RESOURCE
    pod_spec: dict | None = None  # nodeSelector, affinity, tolerations of its pods
    beside: frozenset[str] | None = None  # affinity_nodes: None, any; empty, all on one node


class Growth(NamedTuple):
    """GPU capacity a node autoscaler adds (`vlm-operator run --node-autoscaler-*`): replicas
    no node holds now may still be granted and left Pending for a node to come, while the GPUs
    so left stay within `per_deployment` per VLMDeployment and `total` in all; such a replica
    waits for its node at most `timeout_s`."""

    per_deployment: int
    total: int
    timeout_s: float


class Share(NamedTuple):
    """A claim's grant: replicas granted, and how many of those no node holds now, left
    Pending for a node the node autoscaler adds (0 without Growth)."""

    granted: int
    to_come: int


def _together(c: Claim, eligible: list[str], left: dict[str, dict[str, int]], want: int,
              need: int) -> list[str]:
    """The one node a claim whose pods all go together (a pod affinity to its own pods, none
    bound yet) is placed on: the one holding the most of `want`, then the least room."""
    if not eligible or not want:
        return eligible
    room = {n: left[n].get(c.resource, 0) for n in eligible}
    return [max(eligible, key=lambda n: (min(want, room[n] // need), -room[n], n))]


def plan_gpus(nodes: list[Node], free: dict[str, dict[str, int]], claims: list[Claim],
              growth: Growth | None = None, pending_elsewhere: int = 0) -> dict[
                  tuple[str, str], Share]:
    """Each claim's Share: free GPUs go to higher priority first (ties by name), one replica at
    a time onto the eligible node with the least room that still holds it (so large replicas
    keep the large gaps). Eligible: a node its pods may go to (node_fits) and, with a pod
    affinity to its own pods (Claim.beside), one that holds one of them, or one node for all.

    Scale-downs and holds are always granted; a scale-up gets only replicas that fit, never
    below the current count (pods already asked for are left to the scheduler, and placed
    first: they take their GPUs when they bind).

    With `growth`, the replicas that fit no node (pods already Pending first) are granted as
    well, while the GPUs they leave Pending stay within growth.per_deployment for the claim and
    growth.total for all, `pending_elsewhere` (GPUs Pending for VLMDeployments not among the
    claims) included. A claim pinned by its pod affinity never grows: a new node holds none of
    its pods.
    """
    left = {name: dict(res) for name, res in free.items()}
    grow_left = growth.total - pending_elsewhere if growth is not None else 0
    shares = {}
    for c in sorted(claims, key=lambda c: (-c.priority, c.key)):
        need = max(1, c.gpus_per_replica)
        eligible = [n.name for n in nodes if n.name in left and node_fits(c.pod_spec or {}, n)
                    and (not c.beside or n.name in c.beside)]
        want, take = max(0, max(c.desired, c.current) - c.bound), 0
        if c.beside is not None and not c.beside:
            eligible = _together(c, eligible, left, want, need)
        while take < want:
            room = [(left[n].get(c.resource, 0), n) for n in eligible
                    if left[n].get(c.resource, 0) >= need]
            if not room:
                break
            left[min(room)[1]][c.resource] -= need
            take += 1
        to_come = 0
        if growth is not None and c.beside is None and want > take:
            to_come = min(want - take, growth.per_deployment // need, max(0, grow_left) // need)
            grow_left -= to_come * need
        fits = c.bound + take
        if c.desired <= c.current:
            shares[c.key] = Share(c.desired, min(to_come, max(0, c.desired - fits)))
        else:
            granted = max(c.current, min(c.desired, fits + to_come))
            shares[c.key] = Share(granted, max(0, min(to_come, granted - fits)))
    return shares


def largest_free(nodes: list[Node], free: dict[str, dict[str, int]], resource: str = GPU_RESOURCE,
                 pod_spec: dict | None = None, beside: frozenset[str] | None = None) -> int:
    """The most units of `resource` free on one node a pod of `pod_spec` may go to (and, with
    `beside`, that holds one of its pods): the largest replica that fits anywhere."""
    return max((free.get(n.name, {}).get(resource, 0) for n in nodes
                if node_fits(pod_spec or {}, n) and (not beside or n.name in beside)),
               default=0)
