"""What the operator's reads of a pod say, on the real control plane with the session operator:
a pod that accepts the operator's connections and then answers nothing, while the kubelet's
probes pass (Ready), is evidence the kubelet does not share: api_unresponsive is not acted on
(the default spec: 1 replica, minAvailable 1); a pod being drained whose /metrics the operator
cannot connect to is not drained until its load can be read (unknown is not zero)."""

from __future__ import annotations

import time
import uuid

import pytest
from kube_helpers import SESSION_NS_PREFIX, metric

from vlm_operator.remediation.steps import DRAIN_MIN_S
from vlm_testbed.failure_matrix import Bed, instance
from vlm_testbed.firewall import Firewall


@pytest.fixture
def bed(api, cluster, operator):
    assert operator.gid is not None, "the session operator runs in the firewall's group as root"
    with Bed.new(api, cluster.kubeconfig, f"{SESSION_NS_PREFIX}{uuid.uuid4().hex[:6]}") as b:
        b.nodes(gpus_per_node=2)
        yield b


def test_a_pod_silent_to_the_operator_alone_is_not_restarted(bed, operator):
    """Connections accepted, then nothing: /metrics and /health time out for the operator in
    check after check (main restarted the only replica after 3), but the kubelet's readiness
    probe passes, so the pod is left alone and reported (PodsReadable=False, ReadTimeout)."""
    bed.create("quiet", replicas=1)
    (pod,) = bed.wait_ready("quiet", 1)
    before = operator.metrics()
    with Firewall() as firewall:
        firewall.silence(pod.status.pod_ip)
        seen = bed.follow("quiet", 1, set(), time.time(), until=lambda: False, timeout=35,
                          settle=0)
        readable = bed.condition("quiet", "PodsReadable")
    after = operator.metrics()
    assert seen.touched == [] and seen.lowest_ready == 1, "the pod was touched"
    assert not {"PodRestarted", "PodReplacing", "ScaleDownStarted"} & set(seen.events)
    assert (readable["status"], readable["reason"]) == ("False", "ReadTimeout"), readable
    labels = {"vlmdeployment_namespace": bed.ns, "vlmdeployment": "quiet"}
    assert metric(after, "vlm_operator_pod_read_errors_total", kind="timeout", **labels) >= 3
    assert metric(after, "vlm_operator_detections_total", signature="api_unresponsive",
                  **labels) == metric(before, "vlm_operator_detections_total",
                                      signature="api_unresponsive", **labels) == 0
    assert f"{pod.metadata.name}: /metrics and /health both timed out" in operator.log()
    assert "not acted on while the kubelet does not agree" in operator.log()


def test_a_drain_waits_for_a_pod_whose_metrics_are_refused(bed):
    """ScaleDown of a pod whose /metrics the operator's connections are refused at (the kubelet
    still reaches it: it serves): its requests in flight are unknown, so the drain waits (main
    took the refusal for 0 and deleted it at once); once the operator can read it again, the
    drain finishes."""
    bed.create("drain", replicas=2, health={"tokenizerRetry": {"action": "ScaleDown"}})
    sick, _ = bed.wait_ready("drain", 2)
    with Firewall() as firewall:
        firewall.reject(sick.status.pod_ip)
        bed.fault(sick, {"fault": "tokenizer_retry", "rate": 20})
        bed.wait("the drain", lambda: bed.events("drain")["ScaleDownStarted"], timeout=60)
        seen = bed.follow("drain", 2, set(), time.time(), until=lambda: False,
                          timeout=DRAIN_MIN_S + 8, settle=0)
        assert instance(sick) in {instance(p) for p in bed.pods("drain")
                                  if p.metadata.deletion_timestamp is None}, \
            "deleted as drained: a refused read was taken for no requests in flight"
        assert not seen.events["ScaledDown"]
    bed.wait("drained once readable", lambda: bed.events("drain")["ScaledDown"], timeout=60)
    assert bed.get("drain")["spec"]["replicas"] == 1
