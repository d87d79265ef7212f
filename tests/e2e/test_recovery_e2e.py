"""Recovery in place (spec.health.recovery InPlace) against the real control plane: a pod that
serves nothing leaves the Service's EndpointSlices at once, is restarted in place by the
kubelet (the node simulator) or, where its process stays up, by the engine plugin on the
operator's restart request (a downwardAPI file, refreshed 1 s after a change here), and comes
back into the Service, never deleted; an operator killed at any rung is continued by the next."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from kube_helpers import (
    cr,
    create,
    events,
    get_cr,
    make_namespace,
    pod_gone,
    sim_post,
    wait_for,
    wait_ready_pods,
)
from kubernetes import client, watch

from vlm_operator.api.names import FENCE, IN_SERVICE_LABEL, RESTART_REQUEST
from vlm_operator.remediation import ladder
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess


@pytest.fixture
def sim(cluster, ns):
    with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=2, backoff_base=1.0,
                       downward_api_lag=1.0, name_prefix=f"sim-{ns}") as s:
        yield s


def in_place(**kw):
    return {"recovery": "InPlace", "maxRestartsPerHour": 20, "minAvailable": 1, **kw}


def slice_ips(cluster, ns) -> set[str]:
    out = subprocess.run([str(cluster.kubectl), "--kubeconfig", str(cluster.kubeconfig), "-n",
                          ns, "get", "endpointslices", "-o", "json"], check=True,
                         capture_output=True, text=True).stdout
    return {a for s in json.loads(out)["items"] for e in s.get("endpoints") or []
            for a in e.get("addresses") or []}


def test_engine_death_is_fenced_then_restarted_in_place(api, ns, sim, cluster):
    create(api, ns, cr("inplace", replicas=2, health=in_place()))
    a, b = wait_ready_pods(api, ns, "inplace", 2)
    ip = a.status.pod_ip
    wait_for("both pods in the EndpointSlices", lambda: {ip, b.status.pod_ip} <= slice_ips(
        cluster, ns))
    core = client.CoreV1Api(api)
    w = watch.Watch()
    stream = w.stream(core.list_namespaced_pod, ns, timeout_seconds=60,
                      field_selector=f"metadata.name={a.metadata.name}")
    sim_post(ip, "/sim/fault", {"fault": "engine_dead", "exit_delay": 5})
    fenced = next(ev["object"] for ev in stream
                  if FENCE in (ev["object"].metadata.annotations or {}))
    w.stop()
    # fenced on the log line, out of the Service, while vLLM had not exited yet
    (cs,) = fenced.status.container_statuses
    assert cs.restart_count == 0 and cs.state.running is not None
    assert fenced.metadata.labels[IN_SERVICE_LABEL] == "false"
    fence = json.loads(fenced.metadata.annotations[FENCE])
    assert (fence["signature"], fence["rung"]) == ("engine_dead", "await-exit")
    wait_for("the fenced pod out of the EndpointSlices", lambda: ip not in slice_ips(
        cluster, ns))

    def back():
        pod = core.read_namespaced_pod(a.metadata.name, ns)
        annotations = pod.metadata.annotations or {}
        return (pod.metadata.uid == a.metadata.uid and FENCE not in annotations
                and pod.metadata.labels[IN_SERVICE_LABEL] == "true" and pod)

    pod = wait_for("recovered in place and unfenced", back, timeout=90)
    (cs,) = pod.status.container_statuses
    assert cs.restart_count == 1 and cs.ready
    assert pod.metadata.deletion_timestamp is None
    wait_for("back in the EndpointSlices", lambda: ip in slice_ips(cluster, ns))
    last = wait_for("lastRemediation", lambda: (r := get_cr(api, ns, "inplace").get(
        "status", {}).get("lastRemediation")) and r.get("rung") == "unfenced" and r)
    assert (last["pod"], last["signature"], last["action"]) == (a.metadata.name, "engine_dead",
                                                                 "Restart")
    assert events(api, ns, a.metadata.name, "PodFenced")
    assert events(api, ns, a.metadata.name, "PodRecoveredInPlace")
    assert not events(api, ns, a.metadata.name, "PodRestarted")
    assert len(json.loads(get_cr(api, ns, "inplace")["metadata"]["annotations"][
        "serving.vlm-operator.dev/remediations"])) == 1


def fence_of(core, ns, name) -> dict | None:
    raw = (core.read_namespaced_pod(name, ns).metadata.annotations or {}).get(FENCE)
    return json.loads(raw) if raw else None


def recovered_in_place(core, ns, pod):
    def back():
        p = core.read_namespaced_pod(pod.metadata.name, ns)
        return (p.metadata.uid == pod.metadata.uid and FENCE not in (p.metadata.annotations
                or {}) and p.metadata.labels[IN_SERVICE_LABEL] == "true" and p)
    return back


def test_a_hung_engine_exits_on_the_restart_request_and_restarts_in_place(api, ns, sim):
    health = in_place(engineStalled={"stallSeconds": 10, "canaryTimeoutSeconds": 4})
    create(api, ns, cr("hung", replicas=1, health=health))
    (pod,) = wait_ready_pods(api, ns, "hung", 1)
    core = client.CoreV1Api(api)
    wait_for("the engine heartbeat read", lambda: "vlm-engine-heartbeat" in
             core.read_namespaced_pod_log(pod.metadata.name, ns, container="vllm"), timeout=30)
    sim_post(pod.status.pod_ip, "/sim/fault", {"fault": "stall", "heartbeat": "stops"})
    fence = wait_for("fenced", lambda: fence_of(core, ns, pod.metadata.name), timeout=90)
    assert (fence["signature"], fence["rung"]) == ("engine_stalled", "restart-request")
    request = core.read_namespaced_pod(pod.metadata.name, ns).metadata.annotations[
        RESTART_REQUEST]
    back = wait_for("restarted in place and unfenced", recovered_in_place(core, ns, pod),
                    timeout=90)
    assert back.status.container_statuses[0].restart_count == 1
    previous = core.read_namespaced_pod_log(pod.metadata.name, ns, container="vllm",
                                            previous=True)
    assert f"vlm-restart-request {request}: exiting for an in-place container restart" in \
        previous
    assert events(api, ns, pod.metadata.name, "PodRestartRequested")
    assert not events(api, ns, pod.metadata.name, "PodRestarted")
    time.sleep(3)  # the restarted container, seeing the same request, does not exit again
    assert core.read_namespaced_pod(pod.metadata.name, ns).status.container_statuses[
        0].restart_count == 1


def test_an_engine_death_from_a_gpu_fault_gets_a_new_pod_not_an_in_place_restart(api, ns,
                                                                                 sim):
    """The engine core logs a CUDA fault before it dies: the node's GPU is suspect, so the pod
    is fenced and deleted at once (a new pod from its ReplicaSet), never restarted in place on
    the same GPU, and a NodeSuspect Event names the node; the Node is not touched."""
    create(api, ns, cr("gpu", replicas=1, health=in_place(minAvailable=0)))
    (pod,) = wait_ready_pods(api, ns, "gpu", 1)
    core = client.CoreV1Api(api)
    node_before = core.read_node(pod.spec.node_name)
    sim_post(pod.status.pod_ip, "/sim/fault", {
        "fault": "engine_dead", "exit_delay": 30,
        "gpu_error": "an illegal memory access was encountered"})
    wait_for("the pod deleted", lambda: pod_gone(api, ns, pod), timeout=60)
    (suspect,) = wait_for("NodeSuspect", lambda: events(api, ns, pod.metadata.name,
                                                        "NodeSuspect"))
    assert pod.spec.node_name in suspect.message
    assert "CUDA error: an illegal memory access was encountered" in suspect.message
    last = wait_for("lastRemediation", lambda: (r := get_cr(api, ns, "gpu").get(
        "status", {}).get("lastRemediation")) and r.get("rung") == "delete" and r)
    assert last["pod"] == pod.metadata.name and "GPU error on node" in last["reason"]
    assert not events(api, ns, pod.metadata.name, "PodRecoveredInPlace")
    node_after = core.read_node(pod.spec.node_name)
    assert node_after.spec.unschedulable == node_before.spec.unschedulable
    assert node_after.metadata.labels == node_before.metadata.labels
    wait_ready_pods(api, ns, "gpu", 1)


def test_an_operator_killed_at_each_rung_is_continued_by_the_next(api, cluster):
    """The engine dies and vLLM does not exit (its exit is delayed far beyond the await-exit
    rung): fence and await-exit, the operator killed; a fresh one climbs to the restart request
    at the deadline (from the pod's annotation) and is killed; a third sees the in-place
    restart and lifts the fence. One remediation counted in all."""
    ns = make_namespace(api, "e2e-ladder-")
    core = client.CoreV1Api(api)
    try:
        with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=1, backoff_base=1.0,
                           downward_api_lag=1.0, name_prefix=f"sim-{ns}"):
            def operator():
                return OperatorProcess(cluster.kubeconfig, "--standalone", "-n", ns)

            with operator() as op:
                create(api, ns, cr("ladder", replicas=1, health=in_place()))
                (pod,) = wait_ready_pods(api, ns, "ladder", 1)
                sim_post(pod.status.pod_ip, "/sim/fault", {"fault": "engine_dead",
                                                           "exit_delay": 3600})
                fence = wait_for("fenced", lambda: fence_of(core, ns, pod.metadata.name))
                assert fence["rung"] == "await-exit"
                op.proc.kill()
            assert fence["deadline"] - time.time() > 0  # killed before its deadline
            with operator() as op:
                climbed = wait_for("the next rung", lambda: (f := fence_of(
                    core, ns, pod.metadata.name)) and f["rung"] == "restart-request" and f,
                    timeout=ladder.EXIT_WAIT_S + 30)
                assert climbed["incident"] == fence["incident"]
                op.proc.kill()
            with operator():
                back = wait_for("restarted in place and unfenced",
                                recovered_in_place(core, ns, pod), timeout=90)
                assert back.status.container_statuses[0].restart_count == 1
                last = wait_for("lastRemediation", lambda: (r := get_cr(api, ns, "ladder").get(
                    "status", {}).get("lastRemediation")) and r.get("rung") == "unfenced" and r)
                assert last["signature"] == "engine_dead"
            history = json.loads(get_cr(api, ns, "ladder")["metadata"]["annotations"][
                "serving.vlm-operator.dev/remediations"])
            assert len(history) == 1
    finally:
        core.delete_namespace(ns)
