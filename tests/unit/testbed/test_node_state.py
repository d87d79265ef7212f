"""The node simulator's state and time: back-off with its reset, volumes mapped onto host
directories, downwardAPI files, image pulls per node, Events' texts, and a container's process
group going with its main process."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from vlm_testbed.nodesim import claims, volumes
from vlm_testbed.nodesim.events import go_duration
from vlm_testbed.nodesim.images import NodeImages, pull_policy, pull_seconds
from vlm_testbed.nodesim.processes import Container
from vlm_testbed.nodesim.state import backoff_delay, crashes_after_exit, field_value


def test_backoff_doubles_to_the_cap_and_resets_after_a_long_run():
    crashes, delays = 0, []
    for ran in (1, 1, 1, 1, 1, 1, 1, 1):  # crash loop: 0, 10, 20, ... capped at 300
        crashes = crashes_after_exit(crashes, ran, 300)
        delays.append(backoff_delay(crashes, 10, 300))
    assert delays == [0, 10, 20, 40, 80, 160, 300, 300]
    crashes = crashes_after_exit(crashes, 601, 300)  # ran over 10 min: forgotten
    assert backoff_delay(crashes, 10, 300) == 0
    crashes = crashes_after_exit(crashes, 5, 300)
    assert backoff_delay(crashes, 10, 300) == 10
    # a run just under 10 minutes keeps the back-off
    assert backoff_delay(crashes_after_exit(7, 599, 300), 10, 300) == 300


def test_host_path_longest_mount_wins():
    mounts = {"/models": "/h/cache", "/home/vllm": "/h/home", "/home/vllm/.cache": "/h/c2"}
    assert volumes.host_path(mounts, "/models") == "/h/cache"
    assert volumes.host_path(mounts, "/models/hub/x") == "/h/cache/hub/x"
    assert volumes.host_path(mounts, "/home/vllm/.cache/vllm") == "/h/c2/vllm"
    assert volumes.host_path(mounts, "/home/vllmx") is None
    assert volumes.host_path(mounts, "models") is None
    assert volumes.host_path(mounts, "/usr/bin/python3") is None


def test_container_env_is_mapped_onto_the_pods_volumes(tmp_path):
    container = {"volumeMounts": [{"name": "cache", "mountPath": "/models"},
                                  {"name": "home", "mountPath": "/home/vllm"},
                                  {"name": "cache", "mountPath": "/data", "subPath": "d/e"}]}
    vols = {"cache": str(tmp_path / "pvc"), "home": str(tmp_path / "empty")}
    mounts = volumes.container_mounts(container, vols)
    assert mounts == {"/models": vols["cache"], "/home/vllm": vols["home"],
                      "/data": os.path.join(vols["cache"], "d/e")}
    assert (tmp_path / "pvc" / "d" / "e").is_dir()
    env = volumes.map_env({"HF_HOME": "/models", "HOME": "/home/vllm", "X": "/models/a",
                           "VLLM_CACHE_ROOT": "/var/cache/vllm", "PATHY": "/usr/bin"},
                          mounts, tmp_path / "layer")
    assert env["HF_HOME"] == vols["cache"] and env["HOME"] == vols["home"]
    assert env["X"] == vols["cache"] + "/a" and env["PATHY"] == "/usr/bin"
    # a cache variable under no mount is on the container's writable layer
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "layer" / "var/cache/vllm")
    assert json.loads(env[volumes.MOUNTS_ENV]) == mounts
    # no HOME in the pod's env: the image's home, on the writable layer
    assert volumes.map_env({}, {}, tmp_path / "l2")["HOME"] == str(tmp_path / "l2" / "root")
    assert (tmp_path / "l2" / "root").is_dir()


def test_downward_api_files_follow_the_pod_object(tmp_path):
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u",
                        "annotations": {"serving.vlm-operator.dev/restart-request": "r1"},
                        "labels": {"b": "2", "a": "1"}}, "spec": {}}
    source = {"items": [
        {"path": "restart-request",
         "fieldRef": {"fieldPath": "metadata.annotations['serving.vlm-operator.dev/"
                                   "restart-request']"}},
        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
        {"path": "sub/name", "fieldRef": {"fieldPath": "metadata.name"}}]}
    files = volumes.downward_files(pod, source, "127.1.1.2")
    assert files == {"restart-request": "r1", "labels": 'a="1"\nb="2"', "sub/name": "p"}
    volumes.write_files(tmp_path, files)
    assert (tmp_path / "sub" / "name").read_text() == "p"
    assert field_value(pod, "metadata.annotations['missing']", "") is None


def test_local_volumes_live_under_the_pod(tmp_path):
    pod = {"metadata": {"name": "p", "namespace": "ns", "annotations": {"k": "v"}}, "spec": {}}

    def lookup(kind, name, key):
        return {"a.txt": "A", "b.txt": "B"} if (kind, name) == ("configmap", "cm") else None

    empty = volumes.local_volume(tmp_path, {"name": "home", "emptyDir": {}}, pod, "", lookup)
    assert empty == str(tmp_path / "volumes" / "kubernetes.io~empty-dir" / "home")
    cm = volumes.local_volume(tmp_path, {"name": "c", "configMap": {
        "name": "cm", "items": [{"key": "a.txt", "path": "x/a"}]}}, pod, "", lookup)
    assert Path(cm, "x/a").read_text() == "A" and not Path(cm, "b.txt").exists()
    assert volumes.local_volume(tmp_path, {"name": "c", "persistentVolumeClaim": {
        "claimName": "x"}}, pod, "", lookup) is None


def test_provisioned_volume_matches_the_claim(tmp_path):
    claim = {"metadata": {"name": "cache", "namespace": "ns", "uid": "u1"},
             "spec": {"accessModes": ["ReadWriteMany"], "resources": {
                 "requests": {"storage": "5Gi"}}}, "status": {"phase": "Pending"}}
    assert claims.wants_provisioning(claim)
    pv = claims.persistent_volume(claim, tmp_path / "pvc-u1")
    assert pv["metadata"]["name"] == "pvc-u1"
    assert pv["spec"]["capacity"] == {"storage": "5Gi"}
    assert pv["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pv["spec"]["claimRef"]["uid"] == "u1" and pv["spec"]["storageClassName"] == ""
    assert pv["metadata"]["annotations"][claims.PROVISIONED_BY] == claims.PROVISIONER
    assert not claims.wants_provisioning({**claim, "spec": {"volumeName": "pv"}})
    assert not claims.wants_provisioning({**claim, "spec": {"storageClassName": "gold"}})
    assert claims.multi_attach_message("pvc-u1", ["b", "a"]) == (
        'Multi-Attach error for volume "pvc-u1" Volume is already used by pod(s) a, b')


def test_go_duration_as_the_kubelet_prints_it():
    assert go_duration(0) == "0s"
    assert go_duration(1.5) == "1.5s"
    assert go_duration(0.25) == "250ms"
    assert go_duration(123.25) == "2m3.25s"
    assert go_duration(3723) == "1h2m3s"
    assert go_duration(0.0000015) == "1.5µs"


def test_pull_policy_defaults_as_the_apiserver():
    assert pull_policy({"image": "vllm/vllm-openai:v0.32.0"}) == "IfNotPresent"
    assert pull_policy({"image": "vllm/vllm-openai"}) == "Always"
    assert pull_policy({"image": "vllm/vllm-openai:latest"}) == "Always"
    assert pull_policy({"image": "localhost:5000/vllm"}) == "Always"
    assert pull_policy({"image": "x:1", "imagePullPolicy": "Never"}) == "Never"


class FakeCore:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def create_namespaced_event(self, ns, body):
        self.events.append(body)


def fake_container(core, node: str, image: str = "vllm/vllm-openai:v0.32.0", **spec):
    pod = SimpleNamespace(
        sim=SimpleNamespace(core=core), spec={"nodeName": node}, changed=lambda: None,
        pod={"metadata": {"name": f"p-{node}", "namespace": "ns", "uid": "u"}})
    return SimpleNamespace(pod=pod, spec={"image": image, **spec}, name="vllm",
                           stop=threading.Event(), waiting=None)


def test_an_image_is_pulled_once_per_node():
    core, pulls = FakeCore(), []
    images = NodeImages(lambda image: pulls.append(image) or 0.0)
    assert images.ensure(fake_container(core, "n1"))
    assert images.ensure(fake_container(core, "n1"))
    assert images.ensure(fake_container(core, "n2"))
    assert pulls == ["vllm/vllm-openai:v0.32.0"] * 2
    texts = [(e["reason"], e["message"].split(" in ")[0], e["source"]["host"])
             for e in core.events]
    image = '"vllm/vllm-openai:v0.32.0"'
    assert texts == [
        ("Pulling", f"Pulling image {image}", "n1"),
        ("Pulled", f"Successfully pulled image {image}", "n1"),
        ("Pulled", f"Container image {image} already present on machine", "n1"),
        ("Pulling", f"Pulling image {image}", "n2"),
        ("Pulled", f"Successfully pulled image {image}", "n2")]
    assert core.events[0]["involvedObject"]["fieldPath"] == "spec.containers{vllm}"
    never = fake_container(core, "n3", imagePullPolicy="Never")
    assert not images.ensure(never) and never.waiting[0] == "ErrImageNeverPull"
    assert pull_seconds({"a": 3.0})("b") == 0.0 and pull_seconds(2)("x") == 2.0


def test_a_pull_is_cut_short_when_the_pod_stops():
    images = NodeImages(lambda image: 30.0)
    c = fake_container(FakeCore(), "n1")
    threading.Timer(0.2, c.stop.set).start()
    assert not images.ensure(c)
    assert not images.has("n1", c.spec["image"])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_containers_leftover_processes_die_with_its_main_process(tmp_path):
    """The main process exits leaving a child behind (vLLM's engine processes): the child goes
    too, as with PID 1 of a container's PID namespace, before the container is restarted."""
    script = "sleep 300 & echo $! > child.pid; exit 3"
    sim = SimpleNamespace(command_for=lambda spec, ip: ["sh", "-c", script],
                          images=SimpleNamespace(ensure=lambda c: True))
    pod = SimpleNamespace(dir=tmp_path, sim=sim, ip="127.0.0.1", spec={}, key="ns/p",
                          meta={"name": "p", "namespace": "ns", "uid": "u"},
                          changed=lambda: None,
                          container_env=lambda spec, writable: {"PATH": os.environ["PATH"]})
    container = Container(pod, {"name": "main", "image": "busybox"}, init=True)
    term = container._run_once()
    assert term is not None and term.exit_code == 3
    child = int((container.dir / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)

