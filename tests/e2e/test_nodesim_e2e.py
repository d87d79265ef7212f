"""The simulated node side against the real control plane: scheduling, status, probes,
restarts, logs through the apiserver, deletion and GPU capacity."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from vlm_testbed.nodesim import NodeSimulator

GROUP_LABEL = "vlm-testbed/nodesim-test"
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z ")


@pytest.fixture(scope="module")
def sim(cluster) -> Iterator[NodeSimulator]:
    group = uuid.uuid4().hex[:6]
    api = cluster.api_client()
    with NodeSimulator(nodes=2, gpus_per_node=1, api_client=api, name_prefix=f"sim-{group}",
                       backoff_base=1.0, backoff_cap=4.0, heartbeat_s=2.0,
                       labels={GROUP_LABEL: group}) as s:
        yield s
    api.close()


@pytest.fixture
def core(sim):
    return sim.core


def wait_for(fn: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except Exception as exc:  # API hiccups while waiting
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def vllm_container(env: dict[str, str] | None = None, **extra) -> dict:
    return {
        "name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "command": ["vllm", "serve"],
        "args": ["org/tiny-vl", "--port", "8000", "--served-model-name", "tiny"],
        "ports": [{"name": "http", "containerPort": 8000}],
        "env": [{"name": k, "value": v} for k, v in
                {"VLM_SIM_STARTUP_SECONDS": "1", "VLM_SIM_STATS_INTERVAL": "0",
                 **(env or {})}.items()],
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1,
                         "failureThreshold": 60},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1,
                           "failureThreshold": 1},
        **extra,
    }


def pod_manifest(name: str, sim: NodeSimulator, containers: list[dict], **spec) -> dict:
    group = sim.labels[GROUP_LABEL]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {
        "app.kubernetes.io/name": "vllm"}}, "spec": {
        "nodeSelector": {GROUP_LABEL: group}, "containers": containers,
        "terminationGracePeriodSeconds": 5, **spec}}


def pod_status(core, ns: str, name: str) -> dict:
    return core.api_client.sanitize_for_serialization(
        core.read_namespaced_pod(name, ns)).get("status", {})


def ready_pod(core, ns: str, name: str, timeout: float = 60) -> dict:
    def ready():
        st = pod_status(core, ns, name)
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
        return st if ok and st.get("phase") == "Running" else None

    return wait_for(ready, f"pod {name} Ready", timeout)


def http(url: str, body: dict | None = None, timeout: float = 5) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def kubectl(cluster, *args: str, timeout: float = 30) -> str:
    if not cluster.kubectl:
        pytest.skip("no kubectl binary")
    done = subprocess.run([str(cluster.kubectl), "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_nodes_registered_ready_untainted(sim, core):
    for name in sim.node_names:
        node = core.read_node(name)
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert ready and ready[0].status == "True"
        assert node.status.capacity["nvidia.com/gpu"] == "1"
        assert not [t for t in node.spec.taints or [] if t.key == "node.kubernetes.io/not-ready"]
        assert node.metadata.labels["vlm-testbed/simulated"] == "true"
        lease = sim.coord.read_namespaced_lease(name, "kube-node-lease")
        assert lease.spec.holder_identity == name


def test_deployment_becomes_ready_and_serves_metrics(sim, core, namespace):
    from kubernetes import client

    group = sim.labels[GROUP_LABEL]
    labels = {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "demo"}
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "demo"},
           "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
               "metadata": {"labels": labels},
               "spec": {"nodeSelector": {GROUP_LABEL: group}, "containers": [vllm_container()]}}}}
    apps = client.AppsV1Api(sim.api)
    apps.create_namespaced_deployment(namespace, dep)
    pods = wait_for(lambda: core.list_namespaced_pod(
        namespace, label_selector="app.kubernetes.io/instance=demo").items, "deployment's pod")
    st = ready_pod(core, namespace, pods[0].metadata.name)
    ip = st["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"
    cs = st["containerStatuses"][0]
    assert cs["ready"] and cs["started"] and cs["restartCount"] == 0
    status, text = http(f"http://{ip}:8000/metrics")
    assert status == 200 and 'vllm:num_requests_running{engine="0",model_name="tiny"}' in text
    wait_for(lambda: apps.read_namespaced_deployment(
        "demo", namespace).status.available_replicas == 1, "deployment available")


def test_logs_through_apiserver(sim, core, namespace, cluster):
    pool = vllm_container(env={"VLM_TOKENIZER_POOL_SIZE": "2"})
    core.create_namespaced_pod(namespace, pod_manifest("logs", sim, [pool]))
    st = ready_pod(core, namespace, "logs")
    ip = st["podIP"]
    out = kubectl(cluster, "-n", namespace, "logs", "logs")
    assert "vlm-tokenizer-pool active: vllm=0.32.0 pool_size=2 patched=" in out
    assert re.search(r"\(APIServer pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[entry\.py:\d+\] "
                     r"Starting vLLM server on http://127\.", out)
    stamped = kubectl(cluster, "-n", namespace, "logs", "logs", "--timestamps", "--tail", "3")
    assert len(stamped.splitlines()) == 3 and all(STAMP.match(x) for x in stamped.splitlines())

    follower = subprocess.Popen(
        [str(cluster.kubectl), "--kubeconfig", str(cluster.kubeconfig), "-n", namespace, "logs",
         "-f", "logs"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        marker = f"marker-{uuid.uuid4().hex}"
        time.sleep(1)
        http(f"http://{ip}:8000/sim/log", {"lines": [marker]})
        seen = []
        for line in follower.stdout:
            seen.append(line)
            if marker in line:
                break
        assert marker in seen[-1]
    finally:
        follower.kill()
        follower.wait()

    # the Python client: follow with a raw response, and since_seconds
    resp = core.read_namespaced_pod_log("logs", namespace, container="vllm", follow=True,
                                        timestamps=True, _preload_content=False)
    marker2 = f"marker-{uuid.uuid4().hex}"
    http(f"http://{ip}:8000/sim/log", {"lines": [marker2]})
    buf = b""
    for chunk in resp.stream(1024):
        buf += chunk
        if marker2.encode() in buf:
            break
    resp.release_conn()
    last = next(x for x in buf.decode().splitlines() if marker2 in x)
    assert STAMP.match(last)
    recent = core.read_namespaced_pod_log("logs", namespace, since_seconds=3600, tail_lines=50)
    assert marker2 in recent and marker in recent
    # the apiserver keeps sinceTime to the second: lines of the marker's second onwards
    since = last.split(" ", 1)[0]
    after = kubectl(cluster, "-n", namespace, "logs", "logs", f"--since-time={since}")
    assert marker2 in after and "Starting vLLM server" not in after


def test_engine_dead_restarts_container_and_keeps_previous_log(sim, core, namespace, cluster):
    core.create_namespaced_pod(namespace, pod_manifest("dies", sim, [vllm_container()]))
    ip = ready_pod(core, namespace, "dies")["podIP"]
    http(f"http://{ip}:8000/sim/fault", {"fault": "engine_dead", "exit_code": 1,
                                         "exit_delay": 0.5})

    def restarted():
        cs = pod_status(core, namespace, "dies")["containerStatuses"][0]
        return cs if cs["restartCount"] >= 1 and cs.get("lastState", {}).get("terminated") else None

    cs = wait_for(restarted, "restartCount 1")
    assert cs["lastState"]["terminated"]["exitCode"] == 1
    assert cs["lastState"]["terminated"]["reason"] == "Error"
    ready_pod(core, namespace, "dies")
    previous = kubectl(cluster, "-n", namespace, "logs", "dies", "--previous")
    assert "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue." in previous
    assert "INFO:     Shutting down" in previous
    current = core.read_namespaced_pod_log("dies", namespace)
    assert "EngineDeadError" not in current and "Starting vLLM server" in current


def test_failing_container_goes_to_crashloopbackoff(sim, core, namespace):
    fault = json.dumps({"fault": "engine_dead", "after": 0, "exit_code": 1, "exit_delay": 0})
    container = vllm_container(env={"VLM_SIM_FAULT": fault, "VLM_SIM_STARTUP_SECONDS": "0"})
    core.create_namespaced_pod(namespace, pod_manifest("crashy", sim, [container]))

    def backing_off():
        cs = (pod_status(core, namespace, "crashy").get("containerStatuses") or [{}])[0]
        waiting = cs.get("state", {}).get("waiting") or {}
        return cs if waiting.get("reason") == "CrashLoopBackOff" else None

    cs = wait_for(backing_off, "CrashLoopBackOff")
    assert cs["restartCount"] >= 1 and not cs["ready"]
    assert cs["lastState"]["terminated"]["exitCode"] == 1
    assert "back-off" in cs["state"]["waiting"]["message"]


def test_shell_container_exit_code_and_never_policy(sim, core, namespace):
    c = {"name": "sh", "image": "busybox", "command": ["sh", "-c", "echo bye; exit 3"]}
    core.create_namespaced_pod(namespace, pod_manifest("once", sim, [c], restartPolicy="Never"))
    st = wait_for(lambda: (s := pod_status(core, namespace, "once")).get("phase") == "Failed"
                  and s, "phase Failed")
    term = st["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 3 and st["containerStatuses"][0]["restartCount"] == 0
    assert core.read_namespaced_pod_log("once", namespace) == "bye\n"


def test_deleting_a_pod_stops_its_process(sim, core, namespace):
    from kubernetes.client.exceptions import ApiException

    stubborn = {"name": "sh", "image": "busybox",
                "command": ["sh", "-c", "trap '' TERM; while true; do sleep 0.2; done"]}
    core.create_namespaced_pod(namespace, pod_manifest("gone", sim, [vllm_container()]))
    core.create_namespaced_pod(namespace, pod_manifest("stubborn", sim, [stubborn],
                                                       terminationGracePeriodSeconds=1))
    ip = ready_pod(core, namespace, "gone")["podIP"]
    ready_pod(core, namespace, "stubborn")
    runner = sim.runner_by_name(namespace, "stubborn")
    pids = [i.proc.pid for c in runner.main for i in c.instances]
    core.delete_namespaced_pod("gone", namespace)
    core.delete_namespaced_pod("stubborn", namespace)

    def vanished(name):
        try:
            core.read_namespaced_pod(name, namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for(lambda: vanished("gone") and vanished("stubborn"), "pods deleted")
    with pytest.raises(ConnectionRefusedError), socket.create_connection((ip, 8000), 2):
        pass
    assert pids and not [pid for pid in pids if _alive(pid)]


def test_deletion_runs_the_pre_stop_hook_within_the_grace_period(sim, core, namespace,
                                                                   tmp_path):
    """As the kubelet: the preStop exec hook runs (with the container's environment) before
    SIGTERM, the pod's deletion grace period bounding both."""
    from kubernetes.client.exceptions import ApiException

    mark = tmp_path / "pre-stop"
    hook = {"preStop": {"exec": {"command": [
        "python3", "-c", f"import os; open({str(mark)!r}, 'w').write(os.environ['WHO'])"]}}}
    container = {"name": "sh", "image": "busybox", "command": ["sleep", "3600"],
                 "env": [{"name": "WHO", "value": "the container"}], "lifecycle": hook}
    core.create_namespaced_pod(namespace, pod_manifest("hooked", sim, [container]))
    ready_pod(core, namespace, "hooked")
    core.delete_namespaced_pod("hooked", namespace)

    def vanished():
        try:
            core.read_namespaced_pod("hooked", namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for(vanished, "pod deleted")
    assert mark.read_text() == "the container"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return " Z " not in f.read()
    except FileNotFoundError:
        return False


def test_gpu_capacity_leaves_extra_pod_pending(sim, core, namespace):
    def gpu_pod(name):
        c = {"name": "idle", "image": "registry.local/idle:1",
             "resources": {"limits": {"nvidia.com/gpu": "1"}}}
        return pod_manifest(name, sim, [c])

    total = len(sim.node_names) * sim.gpus
    names = [f"gpu-{i}" for i in range(total + 1)]
    for name in names:
        core.create_namespaced_pod(namespace, gpu_pod(name))

    def settled():
        sts = {n: pod_status(core, namespace, n) for n in names}
        running = [n for n, s in sts.items() if s.get("phase") == "Running"]
        unschedulable = [n for n, s in sts.items() if any(
            c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
            for c in s.get("conditions") or [])]
        return (running, unschedulable) if len(running) == total and unschedulable else None

    running, unschedulable = wait_for(settled, "GPUs used up")
    assert len(unschedulable) == 1
    pending = pod_status(core, namespace, unschedulable[0])
    assert pending["phase"] == "Pending"
    assert "nvidia.com/gpu" in next(c["message"] for c in pending["conditions"]
                                    if c["type"] == "PodScheduled")
    nodes = {core.read_namespaced_pod(n, namespace).spec.node_name for n in running}
    assert nodes == set(sim.node_names)


def test_hang_fails_readiness_then_liveness_restarts(sim, core, namespace):
    liveness = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1,
                "timeoutSeconds": 1, "failureThreshold": 3}
    c = vllm_container(livenessProbe=liveness)
    core.create_namespaced_pod(namespace, pod_manifest("hangs", sim, [c]))
    ip = ready_pod(core, namespace, "hangs")["podIP"]
    http(f"http://{ip}:8000/sim/fault", {"fault": "hang"})

    def not_ready():
        cs = pod_status(core, namespace, "hangs")["containerStatuses"][0]
        return cs if not cs["ready"] else None

    wait_for(not_ready, "readiness failure")

    def restarted():
        cs = pod_status(core, namespace, "hangs")["containerStatuses"][0]
        return cs if cs["restartCount"] >= 1 else None

    cs = wait_for(restarted, "liveness restart")
    assert "terminated" in cs["lastState"]
    ready_pod(core, namespace, "hangs")
