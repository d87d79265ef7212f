"""Installing the operator: `helm install` and `kubectl apply -f manifests/crds/ -f manifests/`
on the real apiserver.

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
from kube_helpers import condition, cr, create, events, get_cr, make_namespace, patch_cr, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from vlm_operator.api import crd
from vlm_operator.k8s.kube import Kube
from vlm_testbed import chart, gateway
from vlm_testbed.operator_process import OperatorProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/vlm-operator"
EXAMPLE = ROOT / "manifests/examples/qwen3-vl-4b.yaml"
INSTALL = ROOT / "manifests/install.yaml"
PREFIX = "e2e-inst-"


@pytest.fixture(scope="module")
def helm() -> str:
    return chart.helm()


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


@contextlib.contextmanager
def inference_pool_crd(api):
    """The extension's InferencePool CRD while a can-i matrix names inferencepools: kubectl
    resolves a resource through discovery, and for one the cluster does not serve its answer
    does not reflect the chart's rule. Removed afterwards: the gateway e2e module expects a
    control plane without it."""
    gateway.install_crd(api)
    ext = client.ApiextensionsV1Api(api)
    name = gateway.crd()["metadata"]["name"]
    try:
        yield
    finally:
        ext.delete_custom_resource_definition(name)

        def gone():
            try:
                ext.read_custom_resource_definition(name)
            except ApiException as exc:
                if exc.status == 404:
                    return True
                raise
            return None
        wait_for("InferencePool CRD removed", gone)


def assert_matrix(cluster, who: str, allowed: list[tuple], denied: list[tuple]) -> None:
    wrong = [("should be allowed", *t) for t in allowed if not can_i(cluster, who, *t)]
    wrong += [("should be denied", *t) for t in denied if can_i(cluster, who, *t)]
    assert wrong == []


def policy_args(args: list[str]) -> list[str]:
    """The chart's policy arguments of the operator (what it serves and refuses): an operator
    run here under the chart's RBAC runs with them, as the chart's Deployment does."""
    return [a for a in args if a.startswith(("--allowed-", "--secret-label", "--deny-code",
                                             "--autoscaling-mode", "--keda-prometheus",
                                             "--no-inference-pools"))]


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
    assert obj["status"]["tokenizerPoolSize"] == 6  # 4 workers + the loop + the mm thread
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
        # watchNamespaces: Roles and RoleBindings there only; the ClusterRole reads only.
        rbac = client.RbacAuthorizationV1Api(api)
        mine = f"app.kubernetes.io/instance={release}"
        for listing in (rbac.list_role_for_all_namespaces,
                        rbac.list_role_binding_for_all_namespaces):
            assert [o.metadata.namespace for o in listing(label_selector=mine).items] == [watched]
        (cluster_role,) = rbac.list_cluster_role(label_selector=mine).items
        assert {v for rule in cluster_role.rules for v in rule.verbs} <= {"get", "list", "watch"}

        who = f"system:serviceaccount:{system}:{sa}"
        with inference_pool_crd(api):
            pools = "inferencepools.inference.networking.k8s.io"
            # rbac.inferencePools off: spec.gateway.inferencePool is not served
            assert_matrix(cluster, who, allowed=[], denied=[
                (verb, pools, watched) for verb in ("get", "create", "patch", "delete")])
        assert "--no-inference-pools" in args
        assert_matrix(cluster, who, allowed=[
            ("watch", "vlmdeployments.serving.vlm-operator.dev", watched),
            ("patch", "vlmdeployments.serving.vlm-operator.dev", watched),
            ("patch", "vlmdeployments.serving.vlm-operator.dev/status", watched),
            ("patch", "vlmdeployments.serving.vlm-operator.dev/scale", watched),
            ("update", "vlmdeployments.serving.vlm-operator.dev/finalizers", watched),
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
            ("get", "replicasets.apps", watched),  # a pod's owner chain
            ("list", "nodes", None),
            ("watch", "nodes", None),  # node drains are noticed from the watch
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
            ("update", "vlmdeployments.serving.vlm-operator.dev/finalizers", other),
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
            # rbac.hpa and rbac.keda off: those modes are refused, nothing on their objects
            ("create", "horizontalpodautoscalers.autoscaling", watched),
            ("delete", "horizontalpodautoscalers.autoscaling", watched),
            ("get", "horizontalpodautoscalers.autoscaling", watched),
            ("create", "scaledobjects.keda.sh", watched),
            ("delete", "scaledobjects.keda.sh", watched),
            ("patch", "replicasets.apps", watched),
        ])

        kubeconfig = sa_kubeconfig(api, cluster.kubeconfig, system, sa, tmp_path / "sa.kubecfg")
        with OperatorProcess(kubeconfig, "-n", watched, "--peering", "vlm-operator",
                             *policy_args(args)) as proc, log_on_failure(proc):
            name = create_example(api, watched)["metadata"]["name"]
            assert_reconciled(api, watched, name)
            # The test bed enforces owner-reference permissions (as OpenShift does).
            dep = client.AppsV1Api(api).read_namespaced_deployment(name, watched)
            assert [(r.kind, r.block_owner_deletion) for r in dep.metadata.owner_references] \
                == [(crd.KIND, True)]
            assert 'vlm_operator_reconciles_total{result="ok"}' in proc.metrics()
            # Its own token cannot read Secrets, even where it works.
            with client.ApiClient(_config_for(kubeconfig)) as as_sa:
                with pytest.raises(ApiException) as denied:
                    client.CoreV1Api(as_sa).list_namespaced_secret(watched)
                assert denied.value.status == 403
            delete_example(api, watched, name)
            log = proc.log()
        assert forbidden_lines(log) == [], log[-3000:]
        assert_block_owner_deletion_needs_the_finalizers_rule(api, kubeconfig, watched, sa)

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


def assert_block_owner_deletion_needs_the_finalizers_rule(api, kubeconfig, namespace, role):
    """Without `update` on vlmdeployments/finalizers the apiserver refuses every child the
    operator applies (OwnerReferencesPermissionEnforcement), and only because of it."""
    rbac = client.RbacAuthorizationV1Api(api)
    rules = rbac.read_namespaced_role(role, namespace).rules
    kept = [r for r in rules if "vlmdeployments/finalizers" not in r.resources]
    assert len(kept) == len(rules) - 1
    rbac.patch_namespaced_role(role, namespace, {"rules": [
        api.sanitize_for_serialization(r) for r in kept]})
    owner = create_example(api, namespace)["metadata"]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": "owned", "namespace": namespace, "ownerReferences": [{
            "apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": owner["name"],
            "uid": owner["uid"], "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"ports": [{"port": 80, "protocol": "TCP"}]}}
    with client.ApiClient(_config_for(kubeconfig)) as as_sa:
        refused = wait_for("RBAC change seen", lambda: _apply_error(as_sa, service))
        assert refused.status == 403, refused.body
        assert "cannot set blockOwnerDeletion" in refused.body
        service["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] = False
        assert _apply_error(as_sa, service) is None
    delete_example(api, namespace, owner["name"])


def _apply_error(api, obj) -> ApiException | None:
    try:
        Kube(api).apply(obj)
    except ApiException as exc:
        return exc
    return None


REFERABLE = "vlm-operator.dev/referable"


def test_chart_policy_is_enforced_by_the_operator(cluster, api, helm, tmp_path):
    """The chart's policy values, run by the operator under the chart's RBAC: a spec breaking a
    rule gets SpecValid=False naming the field and the rule, and no children; a Secret becomes
    usable once labelled for it."""
    release = f"pol-{uuid.uuid4().hex[:6]}"
    system, watched = make_namespace(api, PREFIX), make_namespace(api, PREFIX)
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    kc = ["--kubeconfig", cluster.kubeconfig]
    try:
        run(helm, "install", release, CHART, "-n", system, *kc, "--set",
            f"watchNamespaces={{{watched}}},replicaCount=0,peering.standalone=true,"
            "policy.allowedImagePrefixes={vllm/vllm-openai},"
            "policy.allowedPriorityClasses={gpu-online},"
            f"policy.secretLabel={REFERABLE}=true,rbac.inferencePools=true")
        sa = f"{release}-vlm-operator"
        args = client.AppsV1Api(api).read_namespaced_deployment(sa, system).spec.template.spec \
            .containers[0].args
        chart_args = policy_args(args)
        pools = "inferencepools.inference.networking.k8s.io"
        with inference_pool_crd(api):
            assert_matrix(cluster, f"system:serviceaccount:{system}:{sa}", allowed=[
                (verb, pools, watched) for verb in ("get", "create", "patch", "delete")
            ], denied=[
                ("list", pools, watched), ("watch", pools, watched), ("update", pools, watched),
                ("create", pools, system), ("delete", pools, system),
            ])
        assert "--no-inference-pools" not in args
        assert [a for a in chart_args if not a.startswith("--autoscaling-mode")] == [
            "--allowed-image-prefix=vllm/vllm-openai", "--allowed-priority-class=gpu-online",
            f"--secret-label={REFERABLE}=true"]
        for name, labels in (("hf-labelled", {REFERABLE: "true"}), ("hf-plain", {})):
            core.create_namespaced_secret(watched, {"metadata": {"name": name, "labels": labels},
                                                    "stringData": {"token": "t"}})
        kubeconfig = sa_kubeconfig(api, cluster.kubeconfig, system, sa, tmp_path / "sa.kubecfg")
        with OperatorProcess(kubeconfig, "-n", watched, "--standalone", *chart_args) as proc, \
                log_on_failure(proc):
            create(api, watched, cr("ok", hfTokenSecretRef={"name": "hf-labelled"}))
            create(api, watched, cr("bad-image", image="evil.example/vllm:v0.20.2"))
            create(api, watched, cr("bad-pc", scheduling={
                "priorityClassName": "system-node-critical"}))
            create(api, watched, cr("bad-secret", vllm={"env": [{"name": "HF_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "hf-plain", "key": "token"}}}]}))
            wait_for("ok rolled out", lambda: apps.read_namespaced_deployment("ok", watched))
            # status is written after the children: wait for it rather than race it
            valid = wait_for("ok's SpecValid", lambda: condition(get_cr(api, watched, "ok"),
                                                                  "SpecValid"))
            assert valid["status"] == "True"
            expected = {
                "bad-image": "spec.image: 'evil.example/vllm:v0.20.2' is not allowed by the "
                             "operator's policy: images must start with one of "
                             "'vllm/vllm-openai'",
                "bad-pc": "spec.scheduling.priorityClassName: 'system-node-critical' is not "
                          "allowed by the operator's policy: allowed PriorityClasses are "
                          "'gpu-online'",
                "bad-secret": "spec.vllm.env[0].valueFrom.secretKeyRef.name: Secret 'hf-plain' "
                              f"is not labelled {REFERABLE}=true; the operator's policy only "
                              "lets a VLMDeployment use Secrets labelled for it",
            }
            for name, message in expected.items():
                cond = wait_for(f"{name} refused", lambda name=name: condition(
                    get_cr(api, watched, name), "SpecValid"))
                assert (cond["status"], cond["message"]) == ("False", message)
                assert [e.type for e in events(api, watched, name, "InvalidSpec")] == ["Warning"]
            assert [d.metadata.name for d in apps.list_namespaced_deployment(watched).items] \
                == ["ok"]
            core.patch_namespaced_secret("hf-plain", watched,
                                         {"metadata": {"labels": {REFERABLE: "true"}}})
            patch_cr(api, watched, "bad-secret", {"replicas": 0})  # any change re-checks
            wait_for("labelled Secret accepted",
                     lambda: apps.read_namespaced_deployment("bad-secret", watched))
            log = proc.log()
        assert forbidden_lines(log) == [], log[-3000:]
    finally:
        run(helm, "uninstall", release, "-n", system, *kc, check=False)
        for ns in (system, watched):
            core.delete_namespace(ns)


def _config_for(kubeconfig: pathlib.Path) -> client.Configuration:
    from kubernetes import config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    return cfg


def test_kubectl_apply_manifests(cluster, api, tmp_path):
    """`kubectl apply -f manifests/crds/ -f manifests/` (the CRDs through manifests/crds/'
    links to the chart's; cluster-wide RBAC in namespace vlm-system)."""
    kubectl = [cluster.kubectl, "--kubeconfig", cluster.kubeconfig]
    docs = [d for d in yaml.safe_load_all(INSTALL.read_text()) if d]
    watched = make_namespace(api, PREFIX)
    core = client.CoreV1Api(api)
    try:
        applied = run(*kubectl, "apply", "-f", ROOT / "manifests/crds", "-f", ROOT / "manifests")
        assert "customresourcedefinition.apiextensions.k8s.io/vlmdeployments" in applied.stdout
        run(*kubectl, "-n", "vlm-system", "scale", "deployment/vlm-operator", "--replicas=0")
        who = "system:serviceaccount:vlm-system:vlm-operator"
        assert_matrix(cluster, who, allowed=[
            ("list", "vlmdeployments.serving.vlm-operator.dev", None),
            ("create", "deployments.apps", watched),
            ("delete", "pods", watched),
            ("get", "pods/log", watched),
            ("patch", "clusterkopfpeerings.kopf.dev", None),
            ("list", "nodes", None),
            ("watch", "nodes", None),  # node drains are noticed from the watch
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
        (operator,) = [d for d in docs if d["kind"] == "Deployment"]
        args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
        # Cluster-wide it would also act on other tests' namespaces: watch only ours.
        with OperatorProcess(kubeconfig, "-n", watched, "--standalone",
                             *policy_args(args)) as proc, \
                log_on_failure(proc):
            name = create_example(api, watched)["metadata"]["name"]
            assert_reconciled(api, watched, name)
            delete_example(api, watched, name)
    finally:
        # the CRDs stay: deleting them would delete every VLMDeployment in the session
        run(*kubectl, "delete", "--ignore-not-found", "--wait=false", "-f", INSTALL, check=False)
        core.delete_namespace(watched)
    rbac = client.RbacAuthorizationV1Api(api)
    wait_for("cluster RBAC removed", lambda: not [
        r for r in rbac.list_cluster_role(label_selector="app.kubernetes.io/part-of="
                                          "vlm-operator").items
        if r.metadata.name.startswith("vlm-operator")])
