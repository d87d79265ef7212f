"""Rows about where a replacement can go: a ReadWriteOnce cache claim's node that is full, and
a node a node autoscaler adds (vlm_testbed.nodeautoscaler) for a replacement left Pending."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vlm_testbed.nodeautoscaler import NodeAutoscaler

from .bed import instance
from .engine_faults import storm_on_a_full_node

if TYPE_CHECKING:
    from .bed import Bed, Observed

WATCH_S = 30.0  # after the hold: a surge would show as a second pod well within this
NODE_DELAY_S = 10.0  # the stand-in's provisioning delay
PROVISIONING_TIMEOUT_S = 120  # --node-autoscaler-timeout-seconds of the row's operator


def node_autoscaler(bed: Bed, delay_s: float = NODE_DELAY_S) -> tuple[NodeAutoscaler, list[str]]:
    """The stand-in node autoscaler for the bed's namespace, started (stopped with the bed): a
    one-GPU node `delay_s` after the scheduler refuses a GPU pod; and the names of the nodes
    it added, as it adds them."""
    added: list[str] = []

    def pods() -> list[dict]:
        return [bed.api.sanitize_for_serialization(p)
                for p in bed.core.list_namespaced_pod(bed.ns).items]

    def add_node(index: int) -> None:
        added.extend(bed.nodes(gpus_per_node=1, tag=f"auto{index}").node_names)

    scaler = NodeAutoscaler(pods, add_node, delay_s=delay_s).start()
    bed._stack.callback(scaler.stop)
    return scaler, added


def claim_node_full(bed: Bed, health: dict | None) -> Observed:
    """Two nodes of one GPU; the only replica mounts the ReadWriteOnce cache claim the operator
    creates, so every replica must go to its node (pod affinity), which is full; the other
    node's GPU is free. A retry storm on the replica is held (WaitingForCapacity): no
    replacement is surged to stay Pending beside it, no restart budget is spent."""
    sim = bed.nodes(gpus_per_node=1, nodes=2)
    bed.create("row", replicas=1, health=health, modelCache={"size": "1Gi"})
    (pod,) = bed.wait_ready("row", 1)
    start = time.time()
    bed.fault(pod, {"fault": "tokenizer_retry", "rate": 20})
    seen = bed.follow("row", 1, {instance(pod)}, start, until=lambda: bed.condition(
        "row", "Remediating").get("reason") == "WaitingForCapacity", timeout=30, settle=2)
    seen.notes["held_condition"] = bed.condition("row", "Remediating")
    names, deadline = set(), time.monotonic() + WATCH_S
    while time.monotonic() < deadline:
        names |= {p.metadata.name for p in bed.pods("row")}
        time.sleep(0.5)
    seen.notes.update(pod=pod.metadata.name, pods_seen=sorted(names),
                      free_node=next(n for n in sim.node_names if n != pod.spec.node_name),
                      events_after=dict(bed.events("row")))
    return seen


def node_added_by_autoscaler(bed: Bed, health: dict | None) -> Observed:
    """The only replica storms on a full node and no other node exists; the operator may leave
    one GPU Pending for a node autoscaler (--node-autoscaler-pending-gpus 1). The replacement
    is created Pending, the stand-in registers a one-GPU node NODE_DELAY_S after the scheduler
    refused it, and the Replace finishes there."""
    bed.operator("--standalone", "--node-autoscaler-pending-gpus", "1",
                 "--node-autoscaler-timeout-seconds", str(PROVISIONING_TIMEOUT_S))
    scaler, added = node_autoscaler(bed)
    pod, start = storm_on_a_full_node(bed, health)
    waiting = bed.wait("the surge waiting for a node", lambda: (
        c := bed.condition("row", "Remediating")).get("reason") == "ReplacingPod" and c,
        timeout=30)
    seen = bed.follow("row", 1, {instance(pod)}, start)
    scaler.stop()
    seen.notes.update(waiting_condition=waiting, nodes_added=added, pod_nodes=sorted(
        p.spec.node_name or "" for p in bed.pods("row") if p.metadata.deletion_timestamp is None),
        leaving=sorted(p.spec.node_name or "" for p in bed.pods("row")
                       if p.metadata.deletion_timestamp is not None))
    return seen
