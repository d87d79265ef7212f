"""Log watching and remediation against the real control plane, pods run by the node simulator
with the vLLM stand-in (vllmsim): faults via POST /sim/fault, raw lines via POST /sim/log."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

from kube_helpers import (
    condition,
    cr,
    create,
    deployment,
    events,
    get_cr,
    health,
    is_ready,
    make_namespace,
    managed_pods,
    metric,
    pod_gone,
    sim_post,
    wait_for,
    wait_ready_pods,
)
from kubernetes import client, watch

from vlm_operator.desired import children
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess


def test_retry_storm_restarts_the_pod(api, ns, sim, operator):
    before = operator.metrics()
    create(api, ns, cr("storm", replicas=2, health=health()))
    a, _ = wait_ready_pods(api, ns, "storm", 2)
    sim_post(a.status.pod_ip, "/sim/fault", {"fault": "tokenizer_retry", "rate": 20, "count": 3})
    wait_for("pod restarted", lambda: pod_gone(api, ns, a), timeout=30)
    last = wait_for("lastRemediation", lambda: get_cr(api, ns, "storm").get("status", {}).get(
        "lastRemediation"))
    assert (last["pod"], last["action"], last["signature"]) == (a.metadata.name, "Restart",
                                                                 "tokenizer_retry")
    assert wait_for("event on the CR", lambda: events(api, ns, "storm", "PodRestarted"))
    assert wait_for("event on the pod", lambda: events(api, ns, a.metadata.name, "PodRestarted"))
    after = operator.metrics()
    mine = {"vlmdeployment_namespace": ns, "vlmdeployment": "storm"}  # others' series come
    # and go with their VLMDeployments
    assert metric(after, "vlm_operator_detections_total", signature="tokenizer_retry",
                  **mine) - metric(before, "vlm_operator_detections_total",
                                   signature="tokenizer_retry", **mine) == 3
    assert metric(after, "vlm_operator_remediations_total", action="Restart", **mine) - \
        metric(before, "vlm_operator_remediations_total", action="Restart", **mine) == 1
    wait_ready_pods(api, ns, "storm", 2)  # the Deployment replaced it


def test_engine_death_restarts_before_the_container_exits(api, ns, sim):
    create(api, ns, cr("dead", replicas=2, health=health()))
    a, _ = wait_ready_pods(api, ns, "dead", 2)
    core = client.CoreV1Api(api)
    w = watch.Watch()
    stream = w.stream(core.list_namespaced_pod, ns, timeout_seconds=30,
                      field_selector=f"metadata.name={a.metadata.name}")
    sim_post(a.status.pod_ip, "/sim/fault", {"fault": "engine_dead", "exit_delay": 5})
    deleting = next(ev["object"] for ev in stream if ev["object"].metadata.deletion_timestamp)
    w.stop()
    # acted on the log line: vllmsim exits 5 s after it, then the kubelet would restart it
    (cs,) = deleting.status.container_statuses
    assert cs.restart_count == 0 and cs.state.running is not None
    last = wait_for("lastRemediation", lambda: get_cr(api, ns, "dead").get("status", {}).get(
        "lastRemediation"))
    assert (last["signature"], last["action"]) == ("engine_dead", "Restart")


def endpoint_ips(cluster, ns):
    out = subprocess.run([str(cluster.kubectl), "--kubeconfig", str(cluster.kubeconfig), "-n",
                          ns, "get", "endpointslices", "-o", "json"], check=True,
                         capture_output=True, text=True).stdout
    return {a for s in json.loads(out)["items"] for e in s.get("endpoints") or []
            for a in e.get("addresses") or []}


def test_scale_down_drains_then_lowers_replicas(api, ns, sim, cluster):
    create(api, ns, cr("drain", replicas=3, health=health(
        tokenizerRetry={"threshold": 2, "windowSeconds": 60, "action": "ScaleDown"})))
    a, *_ = wait_ready_pods(api, ns, "drain", 3)
    ip = a.status.pod_ip
    wait_for("pod in the endpoints", lambda: ip in endpoint_ips(cluster, ns), timeout=30)
    sim_post(ip, "/sim/fault", {"fault": "load", "running": 1})  # an in-flight request
    sim_post(ip, "/sim/fault", {"fault": "tokenizer_retry", "rate": 20, "count": 2})
    core = client.CoreV1Api(api)
    wait_for("out of service", lambda: core.read_namespaced_pod(a.metadata.name, ns).metadata
             .labels.get(children.IN_SERVICE_LABEL) == "false", timeout=30)
    wait_for("left the endpoints", lambda: ip not in endpoint_ips(cluster, ns), timeout=30)
    assert not pod_gone(api, ns, a)  # still draining its request
    sim_post(ip, "/sim/fault", {"fault": "clear"})
    wait_for("deleted after the drain", lambda: pod_gone(api, ns, a), timeout=30)
    wait_for("replicas lowered", lambda: get_cr(api, ns, "drain")["spec"]["replicas"] == 2)
    wait_for("deployment follows", lambda: deployment(api, ns, "drain").spec.replicas == 2)
    assert wait_for("ScaledDown event", lambda: events(api, ns, "drain", "ScaledDown"))


def test_storm_on_all_pods_keeps_min_available(api, ns, sim):
    create(api, ns, cr("all", replicas=3, health=health(minAvailable=2)))
    originals = wait_ready_pods(api, ns, "all", 3)
    for p in originals:
        sim_post(p.status.pod_ip, "/sim/fault", {"fault": "tokenizer_retry", "rate": 5})
    lowest = 3
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(pod_gone(api, ns, p) for p in originals):
        lowest = min(lowest, sum(1 for p in managed_pods(api, ns, "all") if is_ready(p)))
        time.sleep(0.1)
    assert all(pod_gone(api, ns, p) for p in originals), "the storm was not remediated"
    assert lowest >= 2
    # each pod was acted on once: restarted while the others kept
    # minAvailable, else replaced (surge, then delete), a GPU being free; which of the two
    # depends on how soon each replacement serves
    def acted() -> tuple[int, int, int]:
        return tuple(len(events(api, ns, "all", reason))
                     for reason in ("PodRestarted", "PodReplacing", "PodReplaced"))

    assert wait_for("every pod restarted or replaced, once", lambda: (
        (n := acted())[0] + n[1] == 3 and n[1] == n[2]), timeout=30), acted()


def _kill_operator_connections(proc: OperatorProcess, cluster) -> bool:
    """Cut every TCP connection of the operator process to the apiserver (ss -K)."""
    ss = shutil.which("ss")
    if not ss:
        return False
    port = re.search(r"server: https://[^:]+:(\d+)", cluster.kubeconfig.read_text())
    out = subprocess.run([ss, "-K", "-tnp", "dport", "=", f":{port.group(1)}"],
                         capture_output=True, text=True)
    return out.returncode == 0 and f"pid={proc.proc.pid}," in out.stdout


def test_dropped_stream_loses_and_duplicates_nothing(api, cluster):
    ns = make_namespace(api, "e2e-solo-")
    try:
        with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=1, backoff_base=1.0,
                           name_prefix=f"sim-{ns}"), \
                OperatorProcess(cluster.kubeconfig, "--standalone", "-n", ns) as op:
            create(api, ns, cr("drop", replicas=1, health=health(
                tokenizerRetry={"threshold": 1, "windowSeconds": 60, "action": "Ignore"})))
            (a,) = wait_ready_pods(api, ns, "drop", 1)
            ip = a.status.pod_ip
            n = 0
            for _ in range(6):
                sim_post(ip, "/sim/fault", {"fault": "tokenizer_retry", "rate": 50, "count": 20})
                n += 20
                time.sleep(0.3)
                assert _kill_operator_connections(op, cluster), "could not cut the connection"
                time.sleep(0.5)
            wait_for("all detections", lambda: metric(
                op.metrics(), "vlm_operator_detections_total", signature="tokenizer_retry")
                >= n, timeout=30)
            time.sleep(2)
            text = op.metrics()
            assert metric(text, "vlm_operator_detections_total", signature="tokenizer_retry") == n
            assert metric(text, "vlm_operator_log_streams_ended_total") >= 1
    finally:
        client.CoreV1Api(api).delete_namespace(ns)


def test_pods_without_the_plugin_line_are_reported_unpatched(api, ns, sim, operator):
    """Unpatched only where the log can be read: a logging prefix and level from the spec are
    read (the plugin's line comes at WARNING), a prefix from the image's own ENV makes the log
    unreadable, which is LogDetectionOff, not Unpatched."""
    env = [{"name": "VLLM_LOGGING_PREFIX", "value": "[vllm] "},
           {"name": "VLLM_LOGGING_LEVEL", "value": "WARNING"}]
    create(api, ns, cr("patched", replicas=1, health=health(), vllm={"env": env}))
    create(api, ns, cr("plain", replicas=1, health=health(),
                       vllm={"env": [{"name": "VLM_SIM_PATCHED", "value": "0"}]}))
    create(api, ns, cr("foreign", replicas=1, health=health(), vllm={"env": [
        {"name": "VLM_SIM_IMAGE_ENV", "value": json.dumps({"VLLM_LOGGING_PREFIX": "[img] "})}]}))
    obj = wait_for("patched pod reported", lambda: (o := get_cr(api, ns, "patched")) and
                   (c := condition(o, "Unpatched")) and c["status"] == "False" and o, timeout=90)
    assert condition(obj, "Unpatched")["reason"] == "AllPodsPatched"
    (pod,) = wait_ready_pods(api, ns, "plain", 1)
    (foreign,) = wait_ready_pods(api, ns, "foreign", 1)
    # No pod event comes when the 60 s grace runs out: the operator must look again by itself.
    obj = wait_for("plain pod reported", lambda: (o := get_cr(api, ns, "plain")) and
                   (c := condition(o, "Unpatched")) and c["status"] == "True" and o, timeout=150)
    assert pod.metadata.name in condition(obj, "Unpatched")["message"]
    assert condition(obj, "LogDetectionOff")["status"] == "False"
    warning = wait_for("Warning event", lambda: events(api, ns, "plain", "Unpatched"))
    assert warning[0].type == "Warning"
    assert not pod_gone(api, ns, pod)  # reported, not restarted: an unpatched engine still serves
    obj = wait_for("foreign pod reported", lambda: (o := get_cr(api, ns, "foreign")) and
                   (c := condition(o, "LogDetectionOff")) and c["status"] == "True" and o,
                   timeout=60)
    message = condition(obj, "LogDetectionOff")["message"]
    assert foreign.metadata.name in message and "VLLM_LOGGING_PREFIX" in message
    assert condition(obj, "Unpatched")["status"] == "False"
    assert wait_for("LogDetectionOff event", lambda: events(api, ns, foreign.metadata.name,
                                                            "LogDetectionOff"))
    obj = get_cr(api, ns, "patched")  # its grace has run out too: the WARNING line was read
    assert [condition(obj, t)["status"] for t in ("Unpatched", "LogDetectionOff")] == [
        "False", "False"]


def test_a_look_alike_pod_of_another_app_is_never_touched(api, ns, sim, operator):
    """A tenant's pod carrying every label of ours (instance, managed-by, in-service) but not
    made by the operator's Deployment: its engine death is not acted on, it is not scraped or
    sent a canary, and it does not count in the VLMDeployment's status; the operator's own
    pod with the same fault is restarted."""
    create(api, ns, cr("real", health=health()))
    (ours,) = wait_ready_pods(api, ns, "real", 1)
    labels = {**children.get_labels("real"), children.IN_SERVICE_LABEL: "true"}
    template = deployment(api, ns, "real").spec.template.spec
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, client.V1Pod(
        metadata=client.V1ObjectMeta(name="look-alike", labels=labels), spec=template))
    alike = wait_for("the look-alike ready", lambda: is_ready(
        p := core.read_namespaced_pod("look-alike", ns)) and p)
    sim_post(alike.status.pod_ip, "/sim/fault", {"fault": "engine_dead", "exit_delay": 600})
    sim_post(ours.status.pod_ip, "/sim/fault", {"fault": "engine_dead", "exit_delay": 600})
    wait_for("our pod restarted", lambda: pod_gone(api, ns, ours), timeout=30)
    time.sleep(3)  # what the operator would have done to the look-alike, it did by now
    alike_now = core.read_namespaced_pod("look-alike", ns)
    assert alike_now.metadata.deletion_timestamp is None
    assert alike_now.metadata.uid == alike.metadata.uid
    assert alike_now.metadata.labels[children.IN_SERVICE_LABEL] == "true"
    assert [e.reason for e in events(api, ns, "look-alike")
            if e.source.component == "vlm-operator"] == []
    assert "look-alike" not in operator.log()
