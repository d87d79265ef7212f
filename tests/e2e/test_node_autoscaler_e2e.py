"""Builtin autoscaling where a node autoscaler adds GPU nodes (the test bed's stand-in,
vlm_testbed.nodeautoscaler): a scale-up that fits no node is granted Pending, says it waits for
a node, and serves on the node that comes. The operator is its own process, started with
--node-autoscaler-pending-gpus, in a namespace the session operator does not watch."""

from __future__ import annotations

import uuid

from vlm_testbed.failure_matrix import Bed
from vlm_testbed.failure_matrix.capacity import PROVISIONING_TIMEOUT_S, node_autoscaler


def test_a_builtin_scale_up_waits_for_the_node_a_node_autoscaler_adds(api, cluster):
    with Bed.new(api, cluster.kubeconfig, f"e2e-solo-{uuid.uuid4().hex[:6]}") as bed:
        bed.operator("--standalone", "--node-autoscaler-pending-gpus", "1",
                     "--node-autoscaler-timeout-seconds", str(PROVISIONING_TIMEOUT_S))
        _, added = node_autoscaler(bed)
        bed.nodes(gpus_per_node=1)
        bed.create("as", replicas=1, autoscaling={"enabled": True, "minReplicas": 1,
                                                  "maxReplicas": 2, "target": 5})
        (first,) = bed.wait_ready("as", 1)
        bed.fault(first, {"fault": "load", "waiting": 8})  # need: 1.6 replicas, no GPU free
        waiting = bed.wait("the scale-up waiting for a node", lambda: (
            c := bed.condition("as", "ScalingLimited")).get("reason") == "WaitingForNode" and c,
            timeout=60)
        assert waiting["status"] == "False", waiting
        assert "wait for a node the node autoscaler adds" in waiting["message"]
        assert bed.get("as")["spec"]["replicas"] == 2
        ready = bed.wait("two ready pods", lambda: len(r := bed.ready("as")) == 2 and r,
                         timeout=120)
        assert sorted(p.spec.node_name for p in ready) == sorted([first.spec.node_name, *added])
        assert len(added) == 1
        assert bed.events("as")["WaitingForNode"] == 1
