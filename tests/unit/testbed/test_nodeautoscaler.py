"""nodeautoscaler.NodeAutoscaler, the test bed's stand-in for a node autoscaler: a GPU pod the
scheduler refused makes one node appear after the delay; pods refused meanwhile wait for it;
nothing else starts one, and never more than max_nodes."""

from vlm_testbed.nodeautoscaler import NodeAutoscaler, refused_gpu_pods


def pod(uid, gpus=1, refused=True, node=None, phase="Pending"):
    conditions = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                   "lastTransitionTime": "2026-01-01T00:00:00Z"}] if refused else []
    spec = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"uid": uid, "namespace": "ns"}, "spec": spec,
            "status": {"phase": phase, "conditions": conditions}}


def test_only_unbound_gpu_pods_the_scheduler_refused_count():
    pods = [pod("a"), pod("cpu", gpus=0), pod("waiting", refused=False),
            pod("bound", node="n"), pod("done", phase="Failed")]
    assert refused_gpu_pods(pods) == ["a"]


def test_a_refused_gpu_pod_brings_one_node_after_the_delay():
    now, pods, added = [0.0], [pod("a")], []
    scaler = NodeAutoscaler(lambda: pods, added.append, delay_s=10.0, max_nodes=2,
                            clock=lambda: now[0])
    scaler.tick()
    pods.append(pod("b"))  # refused while the node is coming: waits for it
    now[0] = 9.0
    scaler.tick()
    assert added == []
    now[0] = 10.0
    scaler.tick()
    assert added == [0]
    now[0] = 30.0
    scaler.tick()  # a and b are covered: no second node for them
    assert added == [0]
    pods.append(pod("c"))
    scaler.tick()
    now[0] = 40.0
    scaler.tick()
    assert added == [0, 1]
    pods.append(pod("d"))
    now[0] = 100.0
    scaler.tick()
    scaler.tick()
    assert added == [0, 1] and scaler.due == []  # max_nodes reached
