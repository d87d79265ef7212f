"""A VLMDeployment's pod on a real node: the real kubelet pulls the project's vLLM image (built
from images/vllm/Dockerfile, served by the local registry) and runs the operator's pod spec
(probes, downwardAPI volume, non-root, one GPU), gives it an address of the node's pod network,
a GPU through the device plugin, an in-place restart when its engine process dies, and the
operator's restart-request annotation in the container's file."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from vlm_operator.api import crd
from vlm_operator.api.names import (
    HISTORY,
    RESTART_REQUEST,
    RESTART_REQUEST_DIR,
    RESTART_REQUEST_FILE,
)
from vlm_operator.remediation.incidents import parse_history
from vlm_testbed.realnode import VLLM_IMAGE
from vlm_testbed.realnode.pods import (
    condition,
    container_status,
    events,
    is_ready,
    running_id,
    vlmd_status,
    wait_for,
)

# Remediation off: what the kubelet does is what is tested, not the operator's recovery.
IGNORE_ALL = {"tokenizerRetry": {"action": "Ignore"}, "engineDead": {"action": "Ignore"},
              "engineStalled": {"action": "Ignore"}, "apiUnresponsive": {"action": "Ignore"}}


def deploy(api: Any, ns: str, name: str = "real") -> None:
    body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
            "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", "replicas": 1,  # the default image
                     "health": IGNORE_ALL,
                     "vllm": {"env": [{"name": "VLM_SIM_STARTUP_SECONDS", "value": "0"}]}}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        crd.GROUP, crd.VERSION, ns, crd.PLURAL, body)


def ready_pod(api: Any, ns: str, timeout_s: float = 120) -> Any:
    v1 = client.CoreV1Api(api)

    def one_ready() -> Any:
        pods = [p for p in v1.list_namespaced_pod(ns).items if is_ready(p)]
        return pods[0] if pods else None

    return wait_for(f"a Ready pod in {ns}", one_ready, timeout_s, 0.2)


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def test_pod_runs_on_the_real_node_with_a_pod_address_and_a_gpu(api, ns, node):
    deploy(api, ns)
    pod = ready_pod(api, ns)
    assert pod.spec.node_name == node.name
    ip = ipaddress.ip_address(pod.status.pod_ip)
    assert not ip.is_loopback and ip in ipaddress.ip_network(node.net.subnet)
    assert pod.status.pod_ip != node.ip
    env = environ(wait_for("task", lambda: node.task_pid(running_id(pod)), 30))
    gpu = env.get("NVIDIA_VISIBLE_DEVICES", "")
    assert gpu.startswith(f"GPU-{node.name}-"), env  # set by the device plugin's Allocate
    assert os.stat(f"/proc/{node.task_pid(running_id(pod))}").st_uid == 10001  # runAsUser
    # the Service's core/v1 Endpoints hold the pod's address: the Endpoints controller refuses
    # the node simulator's loopback addresses (FailedToUpdateEndpoint), never a real node's
    v1 = client.CoreV1Api(api)

    def endpoint_ips() -> list[str]:
        subsets = v1.read_namespaced_endpoints("real", ns).subsets or []
        return [a.ip for s in subsets for a in s.addresses or []]

    assert wait_for("the pod in the Service's Endpoints", endpoint_ips, 30) == [pod.status.pod_ip]


def test_the_kubelet_pulls_the_built_vllm_image_and_its_plugin_loads(api, ns, node):
    """The default spec.image is the project's image: pulled by the kubelet from the local
    registry (a Pulled Event with the pull's time, or already present from an earlier test on
    this node), its plugin, installed by images/vllm/Dockerfile, loaded by the engine."""
    v1 = client.CoreV1Api(api)
    deploy(api, ns)
    pod = ready_pod(api, ns)
    assert pod.spec.containers[0].image == VLLM_IMAGE
    status = container_status(pod)
    assert status.image.endswith(VLLM_IMAGE.split("/", 1)[1]) and status.image_id, status
    pulled = events(v1, ns, pod.metadata.name, "Pulled")
    assert any("Successfully pulled image" in m or "already present on machine" in m
               for m in pulled), pulled
    print("pull:", pulled)
    log = v1.read_namespaced_pod_log(pod.metadata.name, ns)
    assert "vlm-tokenizer-pool active" in log, log[-2000:]


def test_engine_process_killed_restarts_in_place(api, ns, node):
    v1 = client.CoreV1Api(api)
    deploy(api, ns)
    pod = ready_pod(api, ns)
    uid, cid = pod.metadata.uid, running_id(pod)
    assert container_status(pod).restart_count == 0
    os.kill(wait_for("task", lambda: node.task_pid(cid), 30), signal.SIGKILL)
    t0 = time.monotonic()

    def restarted() -> Any:
        p = v1.read_namespaced_pod(pod.metadata.name, ns)
        st = container_status(p)
        return p if st.restart_count == 1 and is_ready(p) else None

    again = wait_for("in-place restart, Ready again", restarted, 90, 0.2)
    assert again.metadata.uid == uid and running_id(again) != cid
    last = container_status(again).last_state.terminated
    assert last is not None and last.exit_code == 137, last
    print(f"killed -> Ready again in place: {time.monotonic() - t0:.1f} s")


def test_restart_request_annotation_reaches_the_container_file(api, ns, node):
    v1 = client.CoreV1Api(api)
    deploy(api, ns)
    pod = ready_pod(api, ns)
    path = f"{RESTART_REQUEST_DIR}/{RESTART_REQUEST_FILE}"
    value = f"test-{time.time():.0f}"
    t0 = time.monotonic()
    v1.patch_namespaced_pod(pod.metadata.name, ns,
                            {"metadata": {"annotations": {RESTART_REQUEST: value}}})

    def seen() -> bool:
        p = v1.read_namespaced_pod(pod.metadata.name, ns)
        cid = running_id(p)
        return bool(cid) and node.read_in_container(cid, path) == value

    wait_for("the annotation in the downwardAPI file", seen, 60, 0.05)
    print(f"annotation -> file in {time.monotonic() - t0:.2f} s")


def test_a_second_node_beside_the_first_has_its_own_network_gpus_and_logs(control_plane, api,
                                                                         registry, node):
    """Two kubelets on one machine: each its own bridge and /24, device-plugin socket and pod
    logs (the kubelet keeps those at fixed paths: each node's mount namespace has its own)."""
    from vlm_testbed.controlplane import ready_namespace
    from vlm_testbed.realnode import GPU, RealNode
    from vlm_testbed.realnode.pods import standin_pod

    v1 = client.CoreV1Api(api)
    ns = ready_namespace(api, f"realnode-second-{time.time_ns() % 10**6}")
    try:
        with RealNode(control_plane, registry=registry.address, gpus=1,
                      labels={"vlm-testbed/second": "true"}) as second:
            assert second.net.subnet != node.net.subnet
            first_gpus = v1.read_node(node.name).status.allocatable[GPU]
            assert (first_gpus, v1.read_node(second.name).status.allocatable[GPU]) == ("4", "1")
            for name, target in (("on-first", node), ("on-second", second)):
                body = standin_pod(name)
                body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": target.name}
                v1.create_namespaced_pod(ns, body)
            pods = {n: wait_for(f"{n} Ready", lambda n=n: (p := v1.read_namespaced_pod(n, ns))
                                and is_ready(p) and p, 90, 0.2) for n in ("on-first", "on-second")}
            for name, target in (("on-first", node), ("on-second", second)):
                assert ipaddress.ip_address(pods[name].status.pod_ip) in ipaddress.ip_network(
                    target.net.subnet)
                assert "Starting vLLM server" in v1.read_namespaced_pod_log(name, ns)
            env = environ(second.task_pid(running_id(pods["on-second"])))
            assert env["NVIDIA_VISIBLE_DEVICES"] == f"GPU-{second.name}-0"
        # the second node gone: the first one's pod and logs are untouched
        assert is_ready(v1.read_namespaced_pod("on-first", ns))
        assert "Starting vLLM server" in v1.read_namespaced_pod_log("on-first", ns)
    finally:
        v1.delete_namespace(ns)


REMEDIATION_EVENTS = ("PodFenced", "PodRestartRequested", "PodRestarted", "PodReplacing",
                      "PodRecoveredInPlace")


def test_a_pod_that_never_becomes_ready_is_reported_and_left_alone(api, ns, node):
    """A model load that does not end (the stand-in loads for an hour: /health is not 200) with
    the default health policy: the real kubelet's startup probe fails every period and keeps the
    pod out of the Service; the operator says Ready=False (0/1 replicas ready) and, as a load
    on real hardware takes minutes, neither fences, restarts nor replaces the pod: it is the
    startup probe's budget (30 minutes) that ends a load, not the operator."""
    v1, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "loading"},
            "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", "replicas": 1, "vllm": {"env": [
                {"name": "VLM_SIM_STARTUP_SECONDS", "value": "3600"}]}}}
    custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, body)
    pod = wait_for("the pod's container running", lambda: next(
        (p for p in v1.list_namespaced_pod(ns).items if running_id(p)), None), 120, 0.2)
    name, uid = pod.metadata.name, pod.metadata.uid
    failed = wait_for("the kubelet's startup probe failing", lambda: [
        m for m in events(v1, ns, name, "Unhealthy") if m.startswith("Startup probe failed")],
        60, 0.5)

    ready = wait_for("Ready=False from the operator", lambda: (
        c := condition(custom, ns, "loading", "Ready")).get("reason") == "ReplicasNotReady"
        and c, 60, 0.5)
    assert "0/1 replicas ready" in ready["message"], ready
    time.sleep(30)  # some 15 failed startup probes more: nothing may come of them but waiting
    pod = v1.read_namespaced_pod(name, ns)
    assert pod.metadata.uid == uid and pod.metadata.deletion_timestamp is None
    assert not is_ready(pod) and container_status(pod).restart_count == 0
    status = vlmd_status(custom, ns, "loading")
    assert not status.get("lastRemediation"), status.get("lastRemediation")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False", degraded
    acted = [(e.reason, e.message) for e in v1.list_namespaced_event(ns).items
             if e.reason in REMEDIATION_EVENTS]
    assert not acted, acted
    print(f"startup probe: {failed[-1]}; operator: {degraded['reason']}, Ready "
          f"{status.get('readyReplicas', 0)}/1")


def test_a_container_that_dies_at_every_start_is_left_to_the_kubelets_back_off(api, ns, node):
    """CrashLoopBackOff on the real kubelet: the engine dies as soon as the server listens, 2 s
    into every container (past the first second, which the operator leaves to the container
    before; and before any probe can pass: a container that never becomes Ready), exit 1 a
    second later, with the default health policy (in-place recovery). The kubelet restarts
    the container on its own back-off (10, 20, 40 s: measured in bench/results/node-model.md);
    the operator fences the pod once, counts one restart for the whole loop (the fenced
    container's later deaths belong to that recovery), says Degraded=True (CrashLoopBackOff),
    and while the kubelet's back-off stays shorter than a cold start it keeps the pod rather
    than pay a new pod's start: the same pod, restarted by the kubelet only."""
    v1, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    die = {"fault": "engine_dead", "after": 0, "exit_code": 1, "exit_delay": 1}
    body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "crashing"},
            "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", "replicas": 1, "vllm": {"env": [
                {"name": "VLM_SIM_STARTUP_SECONDS", "value": "2"},
                {"name": "VLM_SIM_FAULT", "value": json.dumps(die)}]}}}
    custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, body)
    pod = wait_for("the pod", lambda: next(iter(v1.list_namespaced_pod(ns).items), None), 60)
    name, uid = pod.metadata.name, pod.metadata.uid

    def backing_off() -> Any:
        cs = container_status(v1.read_namespaced_pod(name, ns))
        waiting = cs.state.waiting if cs and cs.state else None
        return waiting and waiting.reason == "CrashLoopBackOff" and cs.restart_count >= 2 and cs

    looping = wait_for("the kubelet's CrashLoopBackOff after two restarts", backing_off, 150, 0.5)
    degraded = wait_for("Degraded=True (CrashLoopBackOff) from the operator", lambda: (
        c := condition(custom, ns, "crashing", "Degraded")).get("reason") == "CrashLoopBackOff"
        and c["status"] == "True" and c, 60, 0.5)
    pod = v1.read_namespaced_pod(name, ns)
    assert pod.metadata.uid == uid and pod.metadata.deletion_timestamp is None
    annotations = custom.get_namespaced_custom_object(
        crd.GROUP, crd.VERSION, ns, crd.PLURAL, "crashing")["metadata"].get("annotations") or {}
    decided = parse_history(annotations.get(HISTORY))
    assert len(decided) == 1, f"one restart for the loop, not {len(decided)}"
    assert events(v1, ns, name, "PodFenced"), "the dying pod was not fenced"
    assert not [p for p in v1.list_namespaced_pod(ns).items if p.metadata.uid != uid]
    print(f"kubelet: CrashLoopBackOff at restart {looping.restart_count}; operator: "
          f"{degraded['reason']}: {degraded['message']}")
