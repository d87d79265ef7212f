"""The local control plane is the real thing: version, RBAC, controllers, scheduler, GC, CRDs."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from vlm_testbed.controlplane import (
    api_client_from_kubeconfig,
    apply_manifests,
    bin_dir,
    binaries_ready,
)

if TYPE_CHECKING:
    from tests.e2e.conftest import Cluster


def wait_for(what: str, fn: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """Poll until fn() is truthy; the timeout only bounds a hang, it asserts nothing on speed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def test_serves_v1_20_2(cluster: Cluster) -> None:
    with cluster.api_client() as api:
        assert client.VersionApi(api).get_code().git_version == "v1.20.2"


def _sa_token(core: client.CoreV1Api, ns: str, sa: str) -> str:
    def token() -> str | None:
        refs = core.read_namespaced_service_account(sa, ns).secrets or []
        for ref in refs:
            secret = core.read_namespaced_secret(ref.name, ns)
            if secret.type == "kubernetes.io/service-account-token" and "token" in (
                secret.data or {}
            ):
                return base64.b64decode(secret.data["token"]).decode()
        return None

    return wait_for(f"token of ServiceAccount {ns}/{sa}", token)


def test_rbac_denies_then_allows_service_account(cluster: Cluster, namespace: str) -> None:
    with cluster.api_client() as admin:
        core = client.CoreV1Api(admin)
        core.create_namespaced_service_account(
            namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="nobody")))
        if cluster.control_plane:  # the controller-manager's token controller, v1.20 style
            token = _sa_token(core, namespace, "nobody")
        else:  # clusters >= 1.24 create no token secrets
            token = core.create_namespaced_service_account_token(
                "nobody", namespace, client.AuthenticationV1TokenRequest(
                    spec=client.V1TokenRequestSpec(audiences=[]))).status.token

        cfg = client.Configuration()
        cfg.host = admin.configuration.host
        cfg.ssl_ca_cert = admin.configuration.ssl_ca_cert
        cfg.api_key = {"authorization": f"Bearer {token}"}
        with client.ApiClient(cfg) as as_sa:
            sa_core = client.CoreV1Api(as_sa)
            with pytest.raises(ApiException) as err:
                sa_core.list_namespaced_pod(namespace)
            assert err.value.status == 403
            # Authenticated as the ServiceAccount, then refused by RBAC (not a 401).
            assert f"system:serviceaccount:{namespace}:nobody" in err.value.body

            rbac = client.RbacAuthorizationV1Api(admin)
            rbac.create_namespaced_role(namespace, client.V1Role(
                metadata=client.V1ObjectMeta(name="pod-reader"),
                rules=[client.V1PolicyRule(api_groups=[""], resources=["pods"],
                                           verbs=["list"])]))
            rbac.create_namespaced_role_binding(namespace, client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name="pod-reader"),
                role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role",
                                          name="pod-reader"),
                subjects=[client.RbacV1Subject(kind="ServiceAccount", name="nobody",
                                               namespace=namespace)]))

            def allowed() -> bool:
                try:
                    sa_core.list_namespaced_pod(namespace)
                except ApiException as e:
                    if e.status == 403:
                        return False
                    raise
                return True

            wait_for("the RoleBinding to take effect", allowed)


def test_deployment_gets_replicaset_and_unschedulable_pods(
    cluster: Cluster, namespace: str
) -> None:
    labels = {"app": "web"}
    dep = client.V1Deployment(
        metadata=client.V1ObjectMeta(name="web"),
        spec=client.V1DeploymentSpec(
            replicas=2,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[
                    client.V1Container(name="web", image="registry.invalid/web:1")]),
            ),
        ),
    )
    with cluster.api_client() as api:
        client.AppsV1Api(api).create_namespaced_deployment(namespace, dep)
        core = client.CoreV1Api(api)

        def unschedulable_pods() -> list[client.V1Pod]:
            pods = core.list_namespaced_pod(namespace, label_selector="app=web").items
            done = [
                p for p in pods
                if any(c.type == "PodScheduled" and c.status == "False"
                       and c.reason == "Unschedulable" for c in p.status.conditions or [])
            ]
            return done if len(done) == 2 else []

        pods = wait_for("2 pods marked Unschedulable by the scheduler", unschedulable_pods)
        rs = client.AppsV1Api(api).list_namespaced_replica_set(namespace).items
        assert len(rs) == 1
        assert rs[0].metadata.owner_references[0].name == "web"
        for pod in pods:
            assert pod.status.phase == "Pending"
            assert pod.metadata.owner_references[0].name == rs[0].metadata.name


def _owned_config_map(name: str, owner: dict) -> client.V1ConfigMap:
    ref = client.V1OwnerReference(api_version=owner["apiVersion"], kind=owner["kind"],
                                  name=owner["name"], uid=owner["uid"])
    return client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, owner_references=[ref]))


def _gone(read: Callable[[], Any]) -> bool:
    try:
        read()
    except ApiException as e:
        if e.status == 404:
            return True
        raise
    return False


def test_garbage_collector_deletes_config_map_of_deleted_owner(
    cluster: Cluster, namespace: str
) -> None:
    with cluster.api_client() as api:
        core = client.CoreV1Api(api)
        owner = core.create_namespaced_config_map(
            namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner")))
        core.create_namespaced_config_map(namespace, _owned_config_map("child", {
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
            "uid": owner.metadata.uid}))
        core.delete_namespaced_config_map("owner", namespace)
        wait_for("GC to delete the child ConfigMap",
                 lambda: _gone(lambda: core.read_namespaced_config_map("child", namespace)))


def test_custom_resource_and_gc_of_its_children(
    cluster: Cluster, namespace: str, widget_crd: dict
) -> None:
    """Creating a CR crashed the apiserver before the reflect2 fix; GC must follow CR owners."""
    group, version, plural = "testbed.vlm.dev", "v1", "widgets"
    with cluster.api_client() as api:
        apply_manifests(api, [widget_crd])  # no-op on the local cluster; needed on others
        custom = client.CustomObjectsApi(api)
        body = {"apiVersion": f"{group}/{version}", "kind": "Widget",
                "metadata": {"name": "w1"}, "spec": {"size": 3, "nested": {"a": [1, 2]}}}
        created = custom.create_namespaced_custom_object(group, version, namespace, plural, body)
        assert created["spec"] == body["spec"]
        core = client.CoreV1Api(api)
        core.create_namespaced_config_map(namespace, _owned_config_map("w1-child", {
            "apiVersion": f"{group}/{version}", "kind": "Widget", "name": "w1",
            "uid": created["metadata"]["uid"]}))
        custom.delete_namespaced_custom_object(group, version, namespace, plural, "w1")
        # CRDs created after the controller-manager started are found by GC in up to ~40 s.
        timeout = 30 if cluster.control_plane else 120
        wait_for("GC to delete the Widget's ConfigMap",
                 lambda: _gone(lambda: core.read_namespaced_config_map("w1-child", namespace)),
                 timeout)
        assert client.VersionApi(api).get_code().git_version  # apiserver still alive


def test_kubectl_works_with_kubeconfig(cluster: Cluster, namespace: str) -> None:
    if cluster.kubectl is None:
        pytest.skip("no kubectl available for this cluster")
    base = [str(cluster.kubectl), f"--kubeconfig={cluster.kubeconfig}"]
    out = subprocess.run([*base, "version", "-o", "json"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert json.loads(out)["serverVersion"]["gitVersion"] == "v1.20.2"
    subprocess.run([*base, "-n", namespace, "create", "configmap", "from-kubectl",
                    "--from-literal=k=v"], capture_output=True, text=True, timeout=60, check=True)
    with cluster.api_client() as api:
        cm = client.CoreV1Api(api).read_namespaced_config_map("from-kubectl", namespace)
        assert cm.data == {"k": "v"}


def _running(pid: int) -> bool:
    """Exists and is not a zombie (an exited child nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_cli_up_env_down(tmp_path: Path) -> None:
    """The demo's path: `up` in the background, `env`, then `down` stops every component."""
    if not binaries_ready():
        pytest.skip("Kubernetes binaries not built (python -m vlm_testbed.controlplane build)")
    env = {**os.environ, "VLM_OPERATOR_CACHE": str(tmp_path), "VLM_K8S_BIN_DIR": str(bin_dir())}
    env.pop("KUBECONFIG", None)
    cli = [sys.executable, "-m", "vlm_testbed.controlplane"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args], env=env, capture_output=True, text=True,
                              timeout=240)

    up = run("up")
    assert up.returncode == 0, up.stderr + up.stdout
    state = json.loads((tmp_path / "cluster" / "state.json").read_text())
    try:
        exports = run("env").stdout
        assert f"export KUBECONFIG={state['kubeconfig']}" in exports
        with api_client_from_kubeconfig(state["kubeconfig"]) as api:
            assert client.VersionApi(api).get_code().git_version == "v1.20.2"
    finally:
        down = run("down")
    assert down.returncode == 0, down.stderr
    pids = [state["pid"], *state["components"].values()]
    wait_for("all control-plane processes to exit",
             lambda: not any(_running(p) for p in pids), 30)
    assert run("env").returncode == 1
