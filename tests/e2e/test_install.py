"""Installing the operator: `helm install` and `kubectl apply -f manifests/` on the real apiserver.

There is no container runtime, so the chart's Deployment is installed with 0 replicas and the
operator runs as a local process authenticated as the chart's ServiceAccount (its token from
the apiserver): what it can and cannot do is exactly what the chart's RBAC grants.
Namespaces here use the prefix e2e-inst- so the session operator (e2e-op-*) never acts in them.
"""

from __future__ import annotations

import base64
import contextlib
import pathlib
import subprocess
import uuid

import pytest
import yaml
from kube_helpers import condition, get_cr, make_namespace, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from vlm_operator import crd
from vlm_operator.kube import Kube
from vlm_testbed.operator_process import OperatorProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/vlm-operator"
EXAMPLE = ROOT / "manifests/examples/qwen3-vl-4b.yaml"
INSTALL = ROOT / "manifests/install.yaml"
PREFIX = "e2e-inst-"


@pytest.fixture(scope="module")
def helm() -> str:
    out = subprocess.run([str(ROOT / "hack/helm.sh")], check=True, capture_output=True,
                         text=True)
    return out.stdout.strip()


def run(*argv, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if check and result.returncode:
        raise AssertionError(f"{argv} failed ({result.returncode}):\n{result.stdout}"
                             f"\n{result.stderr}")
    return result


def sa_kubeconfig(api, admin_kubeconfig: pathlib.Path, namespace: str, sa: str,
                  path: pathlib.Path) -> pathlib.Path:
    """A kubeconfig that authenticates as the ServiceAccount (v1.20: its token Secret)."""
    core = client.CoreV1Api(api)
    secret_name = wait_for(f"token of {namespace}/{sa}", lambda: (
        core.read_namespaced_service_account(sa, namespace).secrets or [None])[0]).name
    secret = wait_for("token secret data", lambda: core.read_namespaced_secret(
        secret_name, namespace).data)
    token = base64.b64decode(secret["token"]).decode()
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    cluster = admin["clusters"][0]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": cluster["name"], "user": sa}}],
        "current-context": sa,
    }))
    return path


def can_i(cluster, who: str, verb: str, resource: str, namespace: str | None) -> bool:
    where = ["-n", namespace] if namespace else ["--all-namespaces"]
    resource, _, sub = resource.partition("/")  # "pods/log": kubectl reads TYPE/NAME
    result = run(cluster.kubectl, "--kubeconfig", cluster.kubeconfig, "auth", "can-i", verb,
                 resource, *where, *([f"--subresource={sub}"] if sub else []), "--as", who,
                 check=False)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode == 0


def assert_matrix(cluster, who: str, allowed: list[tuple], denied: list[tuple]) -> None:
    wrong = [("should be allowed", *t) for t in allowed if not can_i(cluster, who, *t)]
    wrong += [("should be denied", *t) for t in denied if can_i(cluster, who, *t)]
    assert wrong == []


def create_example(api, namespace: str) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    return client.CustomObjectsApi(api).create_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, body)


def assert_reconciled(api, namespace: str, name: str) -> dict:
    """The example's children exist with our labels and the status says it was handled."""
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    kube = Kube(api)
    dep = wait_for("deployment", lambda: apps.read_namespaced_deployment(name, namespace))
    assert dep.metadata.labels["app.kubernetes.io/managed-by"] == "vlm-operator"
    service = wait_for("service", lambda: core.read_namespaced_service(name, namespace))
    assert service.spec.ports[0].port == 8000
    wait_for("pdb", lambda: kube.get(kube.pdb_api_version, "PodDisruptionBudget", namespace,
                                     name))
    wait_for("pvc", lambda: core.list_namespaced_persistent_volume_claim(
        namespace, label_selector=f"app.kubernetes.io/instance={name}").items)
    obj = wait_for("status", lambda: (o := get_cr(api, namespace, name)).get("status", {}).get(
        "observedGeneration") == o["metadata"]["generation"] and o)
    assert obj["status"]["tokenizerPoolSize"] == 5  # rendererNumWorkers 4 + 1
    assert condition(obj, "SpecValid")["status"] == "True"
    wait_for("Created events", lambda: core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},reason=Created").items)
    return obj


def delete_example(api, namespace: str, name: str) -> None:
    """Delete the CR and wait until it is gone."""
    custom = client.CustomObjectsApi(api)
    custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, name)

    def gone():
        try:
            custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL,
                                                name)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False
    wait_for(f"{name} deleted", gone)


@contextlib.contextmanager
def log_on_failure(proc: OperatorProcess):
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator log:\n{proc.log()[-4000:]}") from exc


def forbidden_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "Forbidden" in line or " 403" in line
            or "Not enough permissions" in line]


def leftovers(api, release: str, namespaces: list[str]) -> list[str]:
    """Everything the release labelled, cluster-wide and in the given namespaces."""
    selector = f"app.kubernetes.io/instance={release}"
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    rbac, custom = client.RbacAuthorizationV1Api(api), client.CustomObjectsApi(api)
    found = [f"ClusterRole {o.metadata.name}" for o in
             rbac.list_cluster_role(label_selector=selector).items]
    found += [f"ClusterRoleBinding {o.metadata.name}" for o in
              rbac.list_cluster_role_binding(label_selector=selector).items]
    peerings = custom.list_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings",
                                                 label_selector=selector)["items"]
    found += [f"ClusterKopfPeering {o['metadata']['name']}" for o in peerings]
    for ns in namespaces:
        for kind, items in [
            ("ServiceAccount", core.list_namespaced_service_account(ns, label_selector=selector)),
            ("Service", core.list_namespaced_service(ns, label_selector=selector)),
            ("ConfigMap", core.list_namespaced_config_map(ns, label_selector=selector)),
            ("Secret", core.list_namespaced_secret(ns, label_selector=f"name={release}")),
            ("Deployment", apps.list_namespaced_deployment(ns, label_selector=selector)),
            ("Role", rbac.list_namespaced_role(ns, label_selector=selector)),
            ("RoleBinding", rbac.list_namespaced_role_binding(ns, label_selector=selector)),
        ]:
            found += [f"{kind} {ns}/{o.metadata.name}" for o in items.items]
        found += [f"KopfPeering {ns}/{o['metadata']['name']}" for o in
                  custom.list_namespaced_custom_object("kopf.dev", "v1", ns, "kopfpeerings")[
                      "items"]]
    return found


def test_helm_install_namespaced(cluster, api, helm, tmp_path):
    release = f"inst-{uuid.uuid4().hex[:6]}"
    system = make_namespace(api, PREFIX)
    watched = make_namespace(api, PREFIX)
    other = make_namespace(api, PREFIX)
    core = client.CoreV1Api(api)
    kc = ["--kubeconfig", cluster.kubeconfig]
    try:
        run(helm, "install", release, CHART, "-n", system, *kc,
            "--set", f"watchNamespaces={{{watched}}},replicaCount=0,metrics.port=9191")
        sa = f"{release}-vlm-operator"
        dep = client.AppsV1Api(api).read_namespaced_deployment(sa, system)
        args = dep.spec.template.spec.containers[0].args
        assert args[:3] == ["run", "-n", watched] and "--metrics-port=9191" in args
        assert dep.spec.template.spec.service_account_name == sa
        (peering,) = client.CustomObjectsApi(api).list_namespaced_custom_object(
            "kopf.dev", "v1", watched, "kopfpeerings")["items"]
        assert peering["metadata"]["name"] == "vlm-operator"

        who = f"system:serviceaccount:{system}:{sa}"
        assert_matrix(cluster, who, allowed=[
            ("watch", "vlmdeployments.serving.vlm-operator.dev", watched),
            ("patch", "vlmdeployments.serving.vlm-operator.dev", watched),
            ("patch", "vlmdeployments.serving.vlm-operator.dev/status", watched),
            ("patch", "vlmdeployments.serving.vlm-operator.dev/scale", watched),
            ("create", "deployments.apps", watched),
            ("patch", "deployments.apps", watched),
            ("create", "services", watched),
            ("create", "poddisruptionbudgets.policy", watched),
            ("create", "persistentvolumeclaims", watched),
            ("delete", "pods", watched),
            ("patch", "pods", watched),
            ("get", "pods/log", watched),
            ("create", "events", watched),
            ("patch", "kopfpeerings.kopf.dev", watched),
            ("delete", "horizontalpodautoscalers.autoscaling", watched),  # unwanted ones
            ("list", "nodes", None),
            ("list", "pods", other),  # rbac.gpuCapacity: GPUs requested anywhere are not free
            ("list", "priorityclasses.scheduling.k8s.io", None),
            ("watch", "customresourcedefinitions.apiextensions.k8s.io", None),
            ("list", "namespaces", None),
        ], denied=[
            ("get", "pods/log", other),
            ("delete", "pods", other),
            ("patch", "pods", other),
            ("watch", "pods", other),
            ("get", "vlmdeployments.serving.vlm-operator.dev/status", other),
            ("get", "secrets", watched),
            ("get", "secrets", system),
            ("list", "secrets", None),
            ("get", "configmaps", watched),
            ("delete", "deployments.apps", "kube-system"),
            ("delete", "deployments.apps", watched),  # the garbage collector does that
            ("create", "deployments.apps", other),
            ("list", "vlmdeployments.serving.vlm-operator.dev", other),
            ("create", "pods", watched),
            ("patch", "nodes", None),
            ("delete", "namespaces", None),
            ("create", "clusterroles.rbac.authorization.k8s.io", None),
            ("create", "rolebindings.rbac.authorization.k8s.io", watched),
            ("impersonate", "serviceaccounts", watched),
            ("create", "customresourcedefinitions.apiextensions.k8s.io", None),
            ("patch", "clusterkopfpeerings.kopf.dev", None),
            ("create", "horizontalpodautoscalers.autoscaling", watched),  # rbac.hpa off
            ("create", "scaledobjects.keda.sh", watched),  # rbac.keda off
        ])

        kubeconfig = sa_kubeconfig(api, cluster.kubeconfig, system, sa, tmp_path / "sa.kubecfg")
        with OperatorProcess(kubeconfig, "-n", watched, "--peering", "vlm-operator") as proc, \
                log_on_failure(proc):
            name = create_example(api, watched)["metadata"]["name"]
            assert_reconciled(api, watched, name)
            assert 'vlm_operator_reconciles_total{result="ok"}' in proc.metrics()
            # Its own token cannot read Secrets, even where it works.
            with client.ApiClient(_config_for(kubeconfig)) as as_sa:
                with pytest.raises(ApiException) as denied:
                    client.CoreV1Api(as_sa).list_namespaced_secret(watched)
                assert denied.value.status == 403
            delete_example(api, watched, name)
            log = proc.log()
        assert forbidden_lines(log) == [], log[-3000:]

        run(helm, "uninstall", release, "-n", system, *kc)
        wait_for("nothing left but the CRDs",
                 lambda: leftovers(api, release, [system, watched]) == [] or None)
        wait_for("SA token secret removed", lambda: not [
            s for s in core.list_namespaced_secret(system).items
            if s.metadata.name.startswith(f"{sa}-token-")])
        ext = client.ApiextensionsV1Api(api)
        assert ext.read_custom_resource_definition(f"{crd.PLURAL}.{crd.GROUP}")
    finally:
        run(helm, "uninstall", release, "-n", system, *kc, check=False)
        for ns in (system, watched, other):
            core.delete_namespace(ns)


def _config_for(kubeconfig: pathlib.Path) -> client.Configuration:
    from kubernetes import config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    return cfg


def test_kubectl_apply_manifests(cluster, api, tmp_path):
    """`kubectl apply -f manifests/` (cluster-wide RBAC in namespace vlm-system)."""
    kubectl = [cluster.kubectl, "--kubeconfig", cluster.kubeconfig]
    docs = [d for d in yaml.safe_load_all(INSTALL.read_text()) if d]
    # Deleting the CRDs would delete every VLMDeployment in the session: keep them.
    removable = tmp_path / "without-crds.yaml"
    removable.write_text(yaml.safe_dump_all(
        [d for d in docs if d["kind"] != "CustomResourceDefinition"]))
    watched = make_namespace(api, PREFIX)
    core = client.CoreV1Api(api)
    try:
        run(*kubectl, "apply", "-f", ROOT / "manifests")
        run(*kubectl, "-n", "vlm-system", "scale", "deployment/vlm-operator", "--replicas=0")
        who = "system:serviceaccount:vlm-system:vlm-operator"
        assert_matrix(cluster, who, allowed=[
            ("list", "vlmdeployments.serving.vlm-operator.dev", None),
            ("create", "deployments.apps", watched),
            ("delete", "pods", watched),
            ("get", "pods/log", watched),
            ("patch", "clusterkopfpeerings.kopf.dev", None),
            ("list", "nodes", None),
        ], denied=[
            ("list", "secrets", None),
            ("get", "secrets", "vlm-system"),
            ("delete", "deployments.apps", "kube-system"),
            ("create", "pods", watched),
            ("delete", "namespaces", None),
            ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
        ])
        kubeconfig = sa_kubeconfig(api, cluster.kubeconfig, "vlm-system", "vlm-operator",
                                   tmp_path / "sa.kubecfg")
        # Cluster-wide it would also act on other tests' namespaces: watch only ours.
        with OperatorProcess(kubeconfig, "-n", watched, "--standalone") as proc, \
                log_on_failure(proc):
            name = create_example(api, watched)["metadata"]["name"]
            assert_reconciled(api, watched, name)
            delete_example(api, watched, name)
    finally:
        run(*kubectl, "delete", "--ignore-not-found", "--wait=false", "-f", removable,
            check=False)
        core.delete_namespace(watched)
    rbac = client.RbacAuthorizationV1Api(api)
    wait_for("cluster RBAC removed", lambda: not [
        r for r in rbac.list_cluster_role(label_selector="app.kubernetes.io/part-of="
                                          "vlm-operator").items
        if r.metadata.name.startswith("vlm-operator")])
