"""Two operator replicas on one KopfPeering, on the real apiserver: kopf pauses the one with the
lower priority, and its log followers (our threads, started while it was active) leave the
incident to the active replica, so one failure gets one remediation."""

from __future__ import annotations

import time

from kube_helpers import (
    cr,
    create,
    events,
    get_cr,
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


def test_a_standby_that_becomes_active_finishes_a_drain_in_flight(api, cluster):
    """The standby handled the VLMDeployment before (kopf's resume handlers will not run for it
    again), was paused while the active replica began a ScaleDown drain, and becomes active
    when that one stops: it finishes the drain from what the cluster records, though no log
    line, spec change or resume handler tells it to."""
    ns = make_namespace(api, "peer-")
    peering = ("-n", ns, "--peering", "vlm-operator")
    health = {"tokenizerRetry": {"threshold": 3, "windowSeconds": 4, "action": "ScaleDown"},
              "maxRestartsPerHour": 20, "minAvailable": 1}
    try:
        with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=3, backoff_base=1.0,
                           name_prefix=f"sim-{ns}"), \
                OperatorProcess(cluster.kubeconfig, *peering, "--priority", "5") as standby:
            create(api, ns, cr("pe", replicas=2, health=health))
            sick, _ = wait_ready_pods(api, ns, "pe", 2)
            with OperatorProcess(cluster.kubeconfig, *peering, "--priority", "10") as active:
                wait_for("the standby paused",
                         lambda: "Pausing operations in favour of" in standby.log(), timeout=60)
                wait_for("the active replica following the pod's log",
                         lambda: metric(active.metrics(), "vlm_operator_log_lines_total") > 0)
                sim_post(sick.status.pod_ip, "/sim/fault", {"fault": "load", "running": 1})
                sim_post(sick.status.pod_ip, "/sim/fault",
                         {"fault": "tokenizer_retry", "rate": 20, "count": 3})
                wait_for("draining", lambda: events(api, ns, "pe", "ScaleDownStarted"),
                         timeout=30)
                time.sleep(5)  # the storm is past its window: no detection acts any more
            wait_for("the standby active again", lambda: "Resuming operations after the pause"
                     in standby.log(), timeout=90)
            sim_post(sick.status.pod_ip, "/sim/fault", {"fault": "load", "running": 0})
            try:
                wait_for("the standby finished the drain", lambda: pod_gone(
                    api, ns, sick) and get_cr(api, ns, "pe")["spec"]["replicas"] == 1
                    and events(api, ns, "pe", "ScaledDown"), timeout=60)
            except AssertionError:
                print("standby:", standby.log()[-6000:], sep="\n")
                raise
            assert len(events(api, ns, "pe", "ScaledDown")) == 1
            assert len(events(api, ns, "pe", "ScaleDownStarted")) == 1
    finally:
        client.CoreV1Api(api).delete_namespace(ns)
