"""Two operator replicas on one KopfPeering, on the real apiserver: kopf pauses the one with the
lower priority, and its log followers (our threads, started while it was active) leave the
incident to the active replica, so one failure gets one remediation."""

from __future__ import annotations

from kube_helpers import (
    cr,
    create,
    events,
    make_namespace,
    metric,
    pod_gone,
    sim_post,
    wait_for,
    wait_ready_pods,
)
from kubernetes import client

from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess

HEALTH = {"tokenizerRetry": {"threshold": 3, "windowSeconds": 60, "action": "Restart"},
          "maxRestartsPerHour": 20, "minAvailable": 0}


def test_a_paused_replica_leaves_the_incident_to_the_active_one(api, cluster):
    ns = make_namespace(api, "peer-")  # not the session operator's e2e-op-* namespaces
    peering = ("-n", ns, "--peering", "vlm-operator")
    try:
        with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=2, backoff_base=1.0,
                           name_prefix=f"sim-{ns}"), \
                OperatorProcess(cluster.kubeconfig, *peering, "--priority", "5") as low:
            create(api, ns, cr("pe", health=HEALTH))
            (pod,) = wait_ready_pods(api, ns, "pe", 1)
            wait_for("the low-priority replica following the pod's log",
                     lambda: metric(low.metrics(), "vlm_operator_log_lines_total") > 0)
            with OperatorProcess(cluster.kubeconfig, *peering, "--priority", "10") as high:
                wait_for("the low-priority replica paused by kopf",
                         lambda: "Pausing operations in favour of" in low.log(), timeout=60)
                wait_for("the high-priority replica following the pod's log",
                         lambda: metric(high.metrics(), "vlm_operator_log_lines_total") > 0)
                sim_post(pod.status.pod_ip, "/sim/fault",
                         {"fault": "tokenizer_retry", "rate": 20, "count": 3})
                wait_for("the pod restarted", lambda: pod_gone(api, ns, pod), timeout=30)
                try:
                    low_metrics = wait_for("the paused replica seeing the incident", lambda: (
                        m := low.metrics()) and metric(
                            m, "vlm_operator_remediations_skipped_total", reason="peer_active")
                        and m)
                except AssertionError:
                    print("low-priority replica:", low.log()[-6000:], sep="\n")
                    raise
                assert metric(low_metrics, "vlm_operator_detections_total",
                              signature="tokenizer_retry") >= 3
                assert not any(metric(low_metrics, "vlm_operator_remediations_total", action=a)
                               for a in ("Restart", "ScaleDown"))
                assert metric(high.metrics(), "vlm_operator_remediations_total",
                              action="Restart") == 1
                assert len(events(api, ns, "pe", "PodRestarted")) == 1
    finally:
        client.CoreV1Api(api).delete_namespace(ns)
