"""Every object the chart and `vlm-operator render` can produce, checked against the schemas of the
projects that own them, newer than the test bed's v1.20 apiserver: hack/validate-objects (Node)
validates with npm's kubernetes-models (core, apps, policy, autoscaling, RBAC, admission, CRDs),
@kubernetes-models/keda (ScaledObject) and @kubernetes-models/prometheus-operator
(ServiceMonitor, PodMonitor, PrometheusRule), across a matrix of chart values (every optional
feature) and VLMDeployment specs (every autoscaling mode, every optional field). InferencePools
have no npm model: they are checked with jsonschema against the openAPIV3Schema of the Gateway
API Inference Extension's own CRD (vlm_testbed/data), and against its two CEL rules.

kopf's KopfPeering/ClusterKopfPeering are the one kind without an owner's schema: kopf publishes
none (its CRD preserves unknown fields), so they are left out here. The compiled validators
accept unknown fields, as Kubernetes' OpenAPI does; test_install applies the chart through a real
apiserver, whose kubectl validation refuses them.
"""

from __future__ import annotations

import copy
import json
import pathlib
import shutil
import subprocess
import sys

import jsonschema
import pytest
import yaml

from vlm_operator.api import crd
from vlm_operator.api.validation import parse
from vlm_operator.desired import children
from vlm_testbed import gateway
from vlm_testbed.chart import template

ROOT = pathlib.Path(__file__).resolve().parents[3]
VALIDATOR = ROOT / "hack" / "validate-objects"
NO_OWNER_SCHEMA = {"KopfPeering", "ClusterKopfPeering"}

CHART_VARIANTS = {
    "defaults": ["--include-crds"],
    "namespaced-everything": [
        "--include-crds", "--api-versions",
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy", "--set",
        "watchNamespaces={team-a,team-b},rbac.hpa=true,rbac.keda=true,"
        "metrics.serviceMonitor.enabled=true,metrics.serviceMonitor.labels.release=kps,"
        "metrics.vllmPodMonitor.enabled=true,metrics.vllmPodMonitor.interval=1m30s,"
        "metrics.prometheusRule.enabled=true,metrics.prometheusRule.labels.release=kps,"
        "metrics.grafanaDashboard.enabled=true,metrics.service.type=NodePort,"
        "policy.allowedImagePrefixes={reg.example/vllm/},policy.allowedPriorityClasses={gpu},"
        "policy.secretLabel=vlm-operator.dev/referable=true,verbose=true,"
        "imagePullSecrets[0].name=pull,priorityClassName=system-cluster-critical,"
        "nodeSelector.pool=ops,tolerations[0].key=ops,tolerations[0].operator=Exists,"
        "podAnnotations.a=b,podLabels.c=d,extraArgs={--verbose}"],
    "cluster-wide-monitoring": [
        "--set", "metrics.serviceMonitor.enabled=true,metrics.vllmPodMonitor.enabled=true,"
                 "metrics.prometheusRule.enabled=true,rbac.gpuCapacity=false"],
    "sharded": ["--set", "shards=4,watchNamespaces={team-a}"],
    "standalone-bare": [
        "--set", "peering.standalone=true,rbac.create=false,serviceAccount.create=false,"
                 "metrics.service.enabled=false,replicaCount=0"],
}


def vlmd(name: str, **spec) -> dict:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": name, "namespace": "models", "uid": "u-" + name},
            "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", **spec}}


def scaling(mode: str, **extra) -> dict:
    return {"autoscaling": {"enabled": True, "mode": mode, "minReplicas": 1, "maxReplicas": 4,
                            **extra}}


KEDA_PROMETHEUS = "http://prometheus.monitoring:9090"  # the admin's, not the tenant's
KEDA_PROM = {"serverAddress": KEDA_PROMETHEUS}
SPECS = [
    vlmd("minimal"),
    vlmd("builtin", **scaling("Builtin", multimodalWeight=2, priority=5)),
    vlmd("hpa", **scaling("HPA", target=2.5, metric="vllm:num_requests_running")),
    vlmd("keda", **scaling("KEDA")),
    vlmd("keda-query", **scaling("KEDA", prometheus={
        **KEDA_PROM, "query": 'sum(vllm:num_requests_waiting{namespace="models"})'})),
    vlmd("everything", image="reg.example/vllm:v0.20.2", servedModelName="m", revision="main",
         replicas=2, gpusPerReplica=2, rendererNumWorkers=4, serviceAccountName="vllm",
         vllm={"maxModelLen": 4096, "dtype": "bfloat16", "tensorParallelSize": 2,
               "limitMmPerPrompt": {"image": 4}, "mmProcessorKwargs": {"max_pixels": 1000},
               "extraArgs": ["--enforce-eager"],
               "env": [{"name": "A", "value": "b"},
                       {"name": "HF_API_KEY", "valueFrom": {"secretKeyRef": {
                           "name": "keys", "key": "hf"}}}]},
         resources={"requests": {"cpu": "4", "memory": "24Gi"}, "limits": {"memory": "48Gi"}},
         scheduling={"nodeSelector": {"gpu": "a100"},
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                     "affinity": {"nodeAffinity": {
                         "requiredDuringSchedulingIgnoredDuringExecution": {
                             "nodeSelectorTerms": [{"matchExpressions": [
                                 {"key": "gpu", "operator": "In", "values": ["a100"]}]}]}}},
                     "runtimeClassName": "nvidia", "priorityClassName": "inference"},
         hfTokenSecretRef={"name": "hf-token"},
         modelCache={"size": "100Gi", "storageClassName": "fast",
                     "accessModes": ["ReadWriteOnce"]}),
    vlmd("existing-cache", modelCache={"claimName": "weights"}),
    vlmd("gateway", gateway={"inferencePool": {"endpointPickerRef": {
        "name": "gateway-epp", "port": {"number": 9002}}}}),
    vlmd("gateway-fail-open", gateway={"inferencePool": {"endpointPickerRef": {
        "name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"}}}),
]
NO_NPM_MODEL = {"InferencePool"}


@pytest.fixture(scope="module")
def node() -> str:
    found = shutil.which("node")
    assert found, "node is missing: run hack/install-deps.sh"
    assert (VALIDATOR / "node_modules").is_dir(), \
        "run hack/setup.sh (npm ci in hack/validate-objects)"
    return found


def validate(node: str, objects: list[dict]) -> list[dict]:
    result = subprocess.run([node, str(VALIDATOR / "validate.mjs")], input=json.dumps(objects),
                            capture_output=True, text=True, cwd=VALIDATOR)
    assert result.returncode in (0, 1), result.stderr
    return json.loads(result.stdout)


def invalid(results: list[dict]) -> list[str]:
    return [f"{r['apiVersion']} {r['kind']} {r['name']}: {e}" for r in results
            for e in r["errors"]]


@pytest.mark.parametrize("variant", sorted(CHART_VARIANTS))
def test_chart_objects_match_their_owners_schemas(node, variant):
    docs = [d for d in template(*CHART_VARIANTS[variant]) if d["kind"] not in NO_OWNER_SCHEMA]
    results = validate(node, docs)
    assert len(results) == len(docs)
    assert invalid(results) == []


def test_the_matrices_cover_every_kind_the_chart_renders(node):
    kinds = {d["kind"] for v in CHART_VARIANTS.values() for d in template(*v)}
    assert {"CustomResourceDefinition", "Deployment", "StatefulSet", "Service", "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding", "Role", "RoleBinding", "ServiceMonitor", "PodMonitor",
            "PrometheusRule", "ConfigMap", "Pod", "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding", "NetworkPolicy"} <= kinds - NO_OWNER_SCHEMA


def render(*args: str) -> list[dict]:
    """`vlm-operator render` of every spec in SPECS."""
    result = subprocess.run([sys.executable, "-m", "vlm_operator.cli", "render", "-f", "-",
                             "--keda-prometheus-address", KEDA_PROMETHEUS, *args],
                            input=yaml.safe_dump_all(SPECS), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.mark.parametrize("pdb", ["policy/v1", "policy/v1beta1"])
def test_rendered_objects_match_their_owners_schemas(node, pdb):
    docs = render("--pdb-api-version", pdb)
    assert {"PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "ScaledObject", "InferencePool"} == {
        d["kind"] for d in docs}
    assert invalid(validate(node, [d for d in docs if d["kind"] not in NO_NPM_MODEL])) == []


def pool_problems(pool: dict) -> list[str]:
    """What the extension's CRD refuses in `pool`: its schema, then its CEL rules."""
    validator = jsonschema.Draft7Validator(gateway.schema())
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(pool)) + gateway.cel_problems(pool)


def test_rendered_inference_pools_match_the_extensions_crd():
    pools = [d for d in render() if d["kind"] == "InferencePool"]
    assert [p["metadata"]["name"] for p in pools] == ["gateway", "gateway-fail-open"]
    assert [pool_problems(p) for p in pools] == [[], []]


def test_the_inference_pool_check_reports_what_breaks_the_extensions_crd():
    (pool,) = [d for d in render() if d["metadata"]["name"] == "gateway"
               and d["kind"] == "InferencePool"]
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    del broken["spec"]["endpointPickerRef"]["port"]
    broken["spec"]["selector"]["matchLabels"]["bad"] = "-no-"
    assert pool_problems(broken) == [
        "spec.selector.matchLabels.bad: '-no-' does not match "
        "'^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$'",
        "spec.endpointPickerRef: port is required when kind is 'Service' or unspecified "
        "(defaults to 'Service')",
        "spec.targetPorts: port number must be unique"]
    del broken["spec"]["selector"]
    assert "spec: 'selector' is a required property" in pool_problems(broken)


def test_what_the_operator_applies_on_older_clusters_and_while_replacing(node):
    """The children render never shows: the autoscaling/v2beta2 HPA of 1.20-1.22 clusters and
    the Deployment with a surge replica while a pod is replaced."""
    docs = [c for spec in SPECS for c in children.get_children(
        parse(spec), "policy/v1beta1", "autoscaling/v2beta2", keda=True, surge=1,
        prometheus_address=KEDA_PROMETHEUS)]
    assert any(d["apiVersion"] == "autoscaling/v2beta2" for d in docs)
    assert invalid(validate(node, docs)) == []


def test_the_validator_reports_what_breaks_an_owners_schema(node):
    results = validate(node, [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
         "spec": {"replicas": "2", "selector": {}, "template": {"spec": {"containers": []}}}},
        {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "s"},
         "spec": {"scaleTargetRef": {"name": "x"},
                  "triggers": [{"type": "prometheus", "metadata": {"threshold": 5}}]}},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
         "metadata": {"name": "m"},
         "spec": {"selector": {}, "endpoints": [{"port": "metrics", "interval": "30s1m"}]}},
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "p"}},
    ])
    errors = [r["errors"] for r in results]
    assert "data/spec/replicas must be integer" in errors[0]
    assert "data/spec/triggers/0/metadata/threshold must be string" in errors[1]
    assert any("interval must match pattern" in e for e in errors[2])
    assert errors[3] == ["no owner's schema for kopf.dev/v1 KopfPeering"]
