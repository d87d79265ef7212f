"""Recovery in place (spec.health.recovery InPlace) against the real control plane: a pod that
serves nothing leaves the Service's EndpointSlices at once, is restarted in place by the
kubelet (the node simulator) and comes back into the Service, never deleted."""

from __future__ import annotations

import json
import subprocess

import pytest
from kube_helpers import cr, create, events, get_cr, sim_post, wait_for, wait_ready_pods
from kubernetes import client, watch

from vlm_operator.api.names import FENCE, IN_SERVICE_LABEL
from vlm_testbed.nodesim import NodeSimulator


@pytest.fixture
def sim(cluster, ns):
    with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=2, backoff_base=1.0,
                       name_prefix=f"sim-{ns}") as s:
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
