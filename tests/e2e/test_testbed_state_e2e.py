"""The test bed's state and time on the real control plane: emptyDirs that survive a container
restart and go with the pod, claims provisioned, bound and outliving pods, ReadWriteOnce
Multi-Attach across nodes with the controllers' Events, image pulls paid once per node, the
vLLM stand-in's cold and warm starts, downwardAPI files that follow the pod after the kubelet's
lag, and the stand-in's in-place restart request. Every figure is scaled down."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kube_helpers import events, wait_for

from vlm_testbed.nodesim import NodeSimulator

GROUP = "vlm-testbed/state-test"
PULLED_IMAGE = "registry.local/state-test/app:1"
PULL_S = 1.5
LAG_S = 2.0
REQUEST = "serving.vlm-operator.dev/restart-request"


@pytest.fixture(scope="module")
def sim(cluster) -> Iterator[NodeSimulator]:
    group = uuid.uuid4().hex[:6]
    api = cluster.api_client()
    with NodeSimulator(nodes=2, api_client=api, name_prefix=f"state-{group}",
                       backoff_base=1.0, backoff_cap=4.0, heartbeat_s=2.0,
                       labels={GROUP: group}, image_pull_seconds={PULLED_IMAGE: PULL_S},
                       downward_api_lag=LAG_S, mount_timeout=3.0) as s:
        yield s
    api.close()


@pytest.fixture
def core(sim):
    return sim.core


def pod(name: str, sim: NodeSimulator, node: int, containers: list[dict],
        volumes: list[dict] | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "nodeSelector": {"kubernetes.io/hostname": sim.node_names[node]},
        "containers": containers, "volumes": volumes or [], "terminationGracePeriodSeconds": 2}}


def shell(script: str, mounts: dict[str, str], image: str = "busybox:1.36") -> dict:
    """A container running `sh -c script` with $DATA = the first mount's path."""
    first = next(iter(mounts.values()), "/tmp")
    return {"name": "main", "image": image, "command": ["sh", "-c", script],
            "env": [{"name": "DATA", "value": first}],
            "volumeMounts": [{"name": n, "mountPath": p} for n, p in mounts.items()]}


def status(core, ns: str, name: str) -> dict:
    return core.api_client.sanitize_for_serialization(core.read_namespaced_pod(name, ns))["status"]


def running(core, ns: str, name: str, restarts: int | None = None) -> dict | None:
    st = status(core, ns, name)
    cs = (st.get("containerStatuses") or [{}])[0]
    ok = st.get("phase") == "Running" and "running" in cs.get("state", {}) and cs.get("ready")
    return st if ok and (restarts is None or cs["restartCount"] == restarts) else None


def gone(core, ns: str, name: str) -> bool:
    return not any(p.metadata.name == name for p in core.list_namespaced_pod(ns).items)


def delete(core, ns: str, *names: str) -> None:
    for name in names:
        core.delete_namespaced_pod(name, ns)
    for name in names:
        wait_for(f"{name} gone", lambda n=name: gone(core, ns, n), timeout=30)


def test_empty_dir_survives_a_container_restart_and_goes_with_the_pod(sim, core, namespace):
    # the first run exits 1, the restarted one finds the first run's line and stays
    script = 'echo run >> "$DATA/runs"; [ "$(wc -l < "$DATA/runs")" -ge 2 ] || exit 1; sleep 300'
    spec = pod("scratch", sim, 0, [shell(script, {"scratch": "/scratch"})],
               [{"name": "scratch", "emptyDir": {}}])
    core.create_namespaced_pod(namespace, spec)
    wait_for("restarted in place, running", lambda: running(core, namespace, "scratch", 1))
    runner = sim.runner_by_name(namespace, "scratch")
    directory = Path(runner.volumes["scratch"])
    assert directory.is_relative_to(runner.dir)
    assert (directory / "runs").read_text() == "run\nrun\n"
    delete(core, namespace, "scratch")
    assert not directory.exists()
    core.create_namespaced_pod(namespace, spec)  # a new pod: a fresh emptyDir, so it fails once
    wait_for("new pod restarted once, running", lambda: running(core, namespace, "scratch", 1))
    fresh = Path(sim.runner_by_name(namespace, "scratch").volumes["scratch"])
    assert fresh != directory and (fresh / "runs").read_text() == "run\nrun\n"


def test_claim_is_provisioned_bound_outlives_pods_and_attaches_to_one_node(
        sim, core, namespace):
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "cache"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {
            "storage": "2Gi"}}}})
    claim = wait_for("claim Bound", lambda: (c := core.read_namespaced_persistent_volume_claim(
        "cache", namespace)).status.phase == "Bound" and c)
    pv = core.read_persistent_volume(claim.spec.volume_name)
    assert pv.spec.capacity["storage"] == "2Gi" and pv.spec.access_modes == ["ReadWriteOnce"]
    assert pv.spec.claim_ref.uid == claim.metadata.uid
    volume = [{"name": "cache", "persistentVolumeClaim": {"claimName": "cache"}}]
    writer = 'echo "$HOSTNAME" > "$DATA/marker"; sleep 300'
    core.create_namespaced_pod(namespace, pod("a", sim, 0, [shell(writer, {"cache": "/c"})],
                                              volume))
    wait_for("a running", lambda: running(core, namespace, "a"))
    assert Path(pv.spec.host_path.path, "marker").read_text() == "a\n"
    # a second pod on the same node shares the ReadWriteOnce claim
    reader = 'cat "$DATA/marker" > "$DATA/seen-by-$HOSTNAME"; sleep 300'
    core.create_namespaced_pod(namespace, pod("b", sim, 0, [shell(reader, {"cache": "/c"})],
                                              volume))
    wait_for("b running", lambda: running(core, namespace, "b"))
    # a pod on the other node waits, ContainerCreating, with the controllers' Events
    core.create_namespaced_pod(namespace, pod("c", sim, 1, [shell(reader, {"cache": "/c"})],
                                              volume))
    attach = wait_for("FailedAttachVolume", lambda: events(sim.api, namespace, "c",
                                                           "FailedAttachVolume"))
    assert attach[0].type == "Warning" and attach[0].source.component == "attachdetach-controller"
    assert attach[0].message == (f'Multi-Attach error for volume "{pv.metadata.name}" Volume is '
                                 "already used by pod(s) a, b")
    mount = wait_for("FailedMount", lambda: events(sim.api, namespace, "c", "FailedMount"))
    assert mount[0].message.startswith("Unable to attach or mount volumes: unmounted "
                                       "volumes=[cache]")
    assert mount[0].source.component == "kubelet" and mount[0].source.host == sim.node_names[1]
    st = wait_for("c's status", lambda: (s := status(core, namespace, "c")).get(
        "containerStatuses") and s)
    assert st["phase"] == "Pending"
    assert st["containerStatuses"][0]["state"]["waiting"]["reason"] == "ContainerCreating"
    # once no pod on the first node uses it, it attaches to the second; the data outlived a, b
    delete(core, namespace, "a", "b")
    wait_for("c running", lambda: running(core, namespace, "c"), timeout=30)
    assert Path(pv.spec.host_path.path, "seen-by-c").read_text() == "a\n"
    delete(core, namespace, "c")
    core.delete_namespaced_persistent_volume_claim("cache", namespace)
    wait_for("PV deleted with its claim", lambda: not any(
        v.metadata.name == pv.metadata.name for v in core.list_persistent_volume().items))
    wait_for("its directory removed", lambda: not Path(pv.spec.host_path.path).exists())


def test_image_pull_is_paid_once_per_node(sim, core, namespace):
    app = {"name": "main", "image": PULLED_IMAGE, "command": ["sleep", "300"]}
    for name, node in (("first", 0), ("second", 0), ("other", 1)):
        core.create_namespaced_pod(namespace, pod(name, sim, node, [app]))
        wait_for(f"{name} running", lambda n=name: running(core, namespace, n))

    def texts(name: str) -> list[tuple[str, str]]:
        return sorted((e.reason, e.message) for e in events(sim.api, namespace, name)
                      if e.reason in ("Pulling", "Pulled"))

    for name in ("first", "other"):
        (pulled, message), pulling = wait_for(f"{name}'s pull events", lambda n=name: len(
            t := texts(n)) == 2 and t)
        assert pulling == ("Pulling", f'Pulling image "{PULLED_IMAGE}"')
        assert pulled == "Pulled"
        took = message.removeprefix(f'Successfully pulled image "{PULLED_IMAGE}" in ')
        assert took.endswith("s") and float(took[:-1]) >= PULL_S
    assert wait_for("second's event", lambda: texts("second")) == [
        ("Pulled", f'Container image "{PULLED_IMAGE}" already present on machine')]
    delete(core, namespace, "first", "second", "other")


def test_standin_restarts_warm_in_place_on_request_and_a_new_pod_starts_cold(
        sim, core, namespace):
    vllm = {
        "name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "command": ["vllm", "serve"],
        "args": ["org/tiny-vl", "--port", "8000"],
        "ports": [{"name": "http", "containerPort": 8000}],
        "env": [{"name": k, "value": v} for k, v in {
            "HF_HOME": "/models", "HOME": "/home/vllm", "VLM_TOKENIZER_POOL_SIZE": "2",
            "VLM_SIM_STATS_INTERVAL": "0", "VLM_ENGINE_HEARTBEAT_SECONDS": "0",
            "VLM_SIM_TIME_SCALE": "0.01", "VLM_SIM_WEIGHTS_BYTES": "1000000",
            "VLM_RESTART_REQUEST_FILE": "/etc/podinfo/restart-request"}.items()],
        "volumeMounts": [{"name": "cache", "mountPath": "/models"},
                         {"name": "home", "mountPath": "/home/vllm"},
                         {"name": "podinfo", "mountPath": "/etc/podinfo"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1}}
    volumes = [{"name": "cache", "emptyDir": {}}, {"name": "home", "emptyDir": {}},
               {"name": "podinfo", "downwardAPI": {"items": [
                   {"path": "restart-request",
                    "fieldRef": {"fieldPath": f"metadata.annotations['{REQUEST}']"}}]}}]
    spec = pod("engine", sim, 0, [vllm], volumes)
    core.create_namespaced_pod(namespace, spec)
    wait_for("engine ready", lambda: running(core, namespace, "engine", 0))
    uid = core.read_namespaced_pod("engine", namespace).metadata.uid
    runner = sim.runner_by_name(namespace, "engine")
    container = runner.container("vllm")
    cold = container.instances[0].log_path.read_text()
    assert "Time spent downloading weights for org/tiny-vl" in cold
    assert "Compiling a graph for dynamic shape" in cold
    request_file = Path(runner.volumes["podinfo"], "restart-request")
    assert request_file.read_text() == ""

    patched = time.time()
    core.patch_namespaced_pod("engine", namespace, {"metadata": {"annotations": {
        REQUEST: "incident-1"}}})
    wait_for("the request in the file", lambda: request_file.read_text() == "incident-1")
    assert request_file.stat().st_mtime >= patched + LAG_S - 0.05  # the kubelet's lag
    st = wait_for("restarted in place, ready", lambda: running(core, namespace, "engine", 1))
    cs = st["containerStatuses"][0]
    assert cs["lastState"]["terminated"]["exitCode"] == 0
    assert core.read_namespaced_pod("engine", namespace).metadata.uid == uid
    first = container.instances[0].log_path.read_text()
    assert "vlm-restart-request incident-1: exiting for an in-place container restart" in first
    warm = container.instances[1].log_path.read_text()
    assert "downloading weights" not in warm and "Compiling a graph" not in warm
    assert "Directly load the compiled graph(s) for dynamic shape from the cache" in warm
    time.sleep(3)  # three polls of the file: the restarted container does not act on it again
    assert running(core, namespace, "engine", 1)
    assert "vlm-restart-request" not in container.instances[1].log_path.read_text()

    delete(core, namespace, "engine")  # a new pod: fresh emptyDirs, a cold start again
    core.create_namespaced_pod(namespace, spec)
    wait_for("new engine ready", lambda: running(core, namespace, "engine", 0))
    again = sim.runner_by_name(namespace, "engine").container("vllm").instances[0]
    assert "Time spent downloading weights" in again.log_path.read_text()
