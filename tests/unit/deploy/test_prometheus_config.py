"""The test bed's Prometheus configuration: the scrape jobs vlm_testbed.prometheus generates from
the chart's ServiceMonitor and PodMonitor are the ones the Prometheus Operator writes for them
(read off pkg/prometheus/promcfg.go), promtool accepts them, and kubernetes_sd serves the
targets and meta labels Prometheus' Kubernetes discovery gives the same objects."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from vlm_operator.api import scaling_signals
from vlm_testbed import kubernetes_sd, prometheus
from vlm_testbed.chart import template

MONITORS = ["--set", "metrics.serviceMonitor.enabled=true,metrics.vllmPodMonitor.enabled=true"]


def monitor(kind: str, *args: str) -> dict:
    (doc,) = [d for d in template(*MONITORS, *args) if d["kind"] == kind]
    return doc


SHARDING = [{"source_labels": ["__address__"], "target_label": "__tmp_hash", "modulus": 1,
             "action": "hashmod"},
            {"source_labels": ["__tmp_hash"], "regex": "0", "action": "keep"}]


def selector(meta: str, labels: dict) -> list[dict]:
    return [{"action": "keep", "source_labels": [f"{meta}_label_{k}", f"{meta}_labelpresent_{k}"],
             "regex": f"({v});true"} for k, v in labels.items()]


@pytest.mark.parametrize("role", [prometheus.ENDPOINTSLICE, prometheus.ENDPOINTS])
def test_the_operator_service_monitor_job(role):
    (job,) = prometheus.service_monitor_jobs(monitor("ServiceMonitor"), role)
    port = ("__meta_kubernetes_endpointslice_port_name" if role == prometheus.ENDPOINTSLICE
            else "__meta_kubernetes_endpoint_port_name")
    target = [f"__meta_kubernetes_{role}_address_target_kind",
              f"__meta_kubernetes_{role}_address_target_name"]
    assert job == {
        "job_name": "serviceMonitor/vlm-system/rel-vlm-operator/0",
        "honor_labels": False,
        "kubernetes_sd_configs": [{"role": role, "namespaces": {"names": ["vlm-system"]}}],
        "scrape_interval": "30s",
        "metrics_path": "/metrics",
        "relabel_configs": [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            *selector("__meta_kubernetes_service", {
                "app_kubernetes_io_component": "metrics",
                "app_kubernetes_io_instance": "rel",
                "app_kubernetes_io_name": "vlm-operator"}),
            {"action": "keep", "source_labels": [port], "regex": "metrics"},
            {"source_labels": target, "separator": ";", "regex": "Node;(.*)",
             "replacement": "${1}", "target_label": "node"},
            {"source_labels": target, "separator": ";", "regex": "Pod;(.*)",
             "replacement": "${1}", "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"],
             "target_label": "container"},
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
             "regex": "(Failed|Succeeded)"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job",
             "replacement": "${1}"},
            {"target_label": "endpoint", "replacement": "metrics"},
            *SHARDING,
        ],
    }


def test_the_vllm_pod_monitor_job():
    (job,) = prometheus.pod_monitor_jobs(monitor("PodMonitor"))
    assert job == {
        "job_name": "podMonitor/vlm-system/rel-vlm-operator-vllm/0",
        "honor_labels": False,
        "kubernetes_sd_configs": [{"role": "pod"}],  # namespaceSelector any: every namespace
        "scrape_interval": "15s",
        "metrics_path": "/metrics",
        "relabel_configs": [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
             "regex": "(Failed|Succeeded)"},
            *selector("__meta_kubernetes_pod", {
                "app_kubernetes_io_component": "engine",
                "app_kubernetes_io_managed_by": "vlm-operator",
                "app_kubernetes_io_name": "vllm"}),
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
             "regex": "http"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"],
             "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": "vlm-system/rel-vlm-operator-vllm"},
            {"target_label": "endpoint", "replacement": "http"},
            *SHARDING,
        ],
    }
    (namespaced,) = prometheus.pod_monitor_jobs(
        monitor("PodMonitor", "--set", "watchNamespaces={team-a,team-b}"))
    assert namespaced["kubernetes_sd_configs"] == [
        {"role": "pod", "namespaces": {"names": ["team-a", "team-b"]}}]


def test_selector_expressions_job_labels_and_relabelings_as_the_operator_writes_them():
    sm = {"metadata": {"name": "m", "namespace": "ns"}, "spec": {
        "selector": {"matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["a", "b"]},
            {"key": "canary", "operator": "DoesNotExist"}]},
        "jobLabel": "app.kubernetes.io/name", "targetLabels": ["team"],
        "endpoints": [{"port": "web", "honorLabels": True, "relabelings": [
            {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node",
             "action": "Replace"}]}]}}
    (job,) = prometheus.service_monitor_jobs(sm)
    rules = job["relabel_configs"]
    assert job["honor_labels"] is True
    assert rules[1:3] == [
        {"action": "keep", "source_labels": ["__meta_kubernetes_service_label_tier",
                                             "__meta_kubernetes_service_labelpresent_tier"],
         "regex": "(a|b);true"},
        {"action": "drop", "source_labels": ["__meta_kubernetes_service_labelpresent_canary"],
         "regex": "true"}]
    assert {"source_labels": ["__meta_kubernetes_service_label_team"], "target_label": "team",
            "regex": "(.+)", "replacement": "${1}"} in rules
    assert rules[-5:-2] == [
        {"source_labels": ["__meta_kubernetes_service_label_app_kubernetes_io_name"],
         "target_label": "job", "regex": "(.+)", "replacement": "${1}"},
        {"target_label": "endpoint", "replacement": "web"},
        {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node",
         "action": "replace"}]


@pytest.mark.parametrize("change", [{"tlsConfig": {}}, {"bearerTokenSecret": {"name": "x"}}])
def test_fields_the_generator_does_not_reproduce_are_refused(change):
    sm = monitor("ServiceMonitor")
    sm["spec"]["endpoints"][0].update(change)
    with pytest.raises(ValueError, match="not reproduced"):
        prometheus.service_monitor_jobs(sm)


def test_promtool_accepts_the_configuration_with_the_test_beds_discovery(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run hack/install-deps.sh"
    docs = template(*MONITORS)
    jobs = kubernetes_sd.with_http_sd(prometheus.scrape_configs(docs), "http://127.0.0.1:1")
    assert [j["http_sd_configs"] for j in jobs] == [
        [{"url": "http://127.0.0.1:1/endpointslice?namespace=vlm-system",
          "refresh_interval": "1s"}],
        [{"url": "http://127.0.0.1:1/pod?", "refresh_interval": "1s"}]]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": jobs}))
    result = subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# -- kubernetes_sd: the targets and meta labels of Prometheus' Kubernetes discovery

POD = {
    "metadata": {"name": "m-6d4f-abcde", "namespace": "team-a", "uid": "u1",
                 "labels": {"app.kubernetes.io/name": "vllm"},
                 "annotations": {"a/b": "c"},
                 "ownerReferences": [{"kind": "ReplicaSet", "name": "m-6d4f", "controller": True}]},
    "spec": {"nodeName": "n1", "containers": [
        {"name": "vllm", "image": "vllm/vllm-openai:v0.33.0",
         "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]},
        {"name": "sidecar", "image": "busybox"}]},
    "status": {"podIP": "10.0.0.7", "hostIP": "192.168.0.1", "phase": "Running",
               "conditions": [{"type": "Ready", "status": "True"}],
               "containerStatuses": [{"name": "vllm", "containerID": "containerd://1"}]},
}
POD_LABELS = {
    "__meta_kubernetes_namespace": "team-a", "__meta_kubernetes_pod_name": "m-6d4f-abcde",
    "__meta_kubernetes_pod_ip": "10.0.0.7", "__meta_kubernetes_pod_ready": "true",
    "__meta_kubernetes_pod_phase": "Running", "__meta_kubernetes_pod_node_name": "n1",
    "__meta_kubernetes_pod_host_ip": "192.168.0.1", "__meta_kubernetes_pod_uid": "u1",
    "__meta_kubernetes_pod_label_app_kubernetes_io_name": "vllm",
    "__meta_kubernetes_pod_labelpresent_app_kubernetes_io_name": "true",
    "__meta_kubernetes_pod_annotation_a_b": "c",
    "__meta_kubernetes_pod_annotationpresent_a_b": "true",
    "__meta_kubernetes_pod_controller_kind": "ReplicaSet",
    "__meta_kubernetes_pod_controller_name": "m-6d4f",
}
VLLM_PORT = {
    "__meta_kubernetes_pod_container_name": "vllm",
    "__meta_kubernetes_pod_container_image": "vllm/vllm-openai:v0.33.0",
    "__meta_kubernetes_pod_container_init": "false",
    "__meta_kubernetes_pod_container_id": "containerd://1",
    "__meta_kubernetes_pod_container_port_name": "http",
    "__meta_kubernetes_pod_container_port_number": "8000",
    "__meta_kubernetes_pod_container_port_protocol": "TCP",
}


def test_pod_role_targets_each_port_and_each_portless_container():
    assert kubernetes_sd.pod_targets(POD) == [
        {"__address__": "10.0.0.7:8000", **POD_LABELS, **VLLM_PORT},
        {"__address__": "10.0.0.7", **POD_LABELS,
         "__meta_kubernetes_pod_container_name": "sidecar",
         "__meta_kubernetes_pod_container_image": "busybox",
         "__meta_kubernetes_pod_container_init": "false",
         "__meta_kubernetes_pod_container_id": ""}]
    assert kubernetes_sd.pod_targets({**POD, "status": {"phase": "Pending"}}) == []


def test_endpointslice_role_joins_the_service_and_the_pod():
    pod = {**POD, "spec": {**POD["spec"], "containers": [
        {**POD["spec"]["containers"][0], "ports": [
            *POD["spec"]["containers"][0]["ports"],
            {"name": "debug", "containerPort": 9999, "protocol": "TCP"}]}]}}
    service = {"metadata": {"name": "m", "namespace": "team-a", "labels": {"tier": "x"}}}
    eps = {"metadata": {"name": "m-abc", "namespace": "team-a",
                        "labels": {"kubernetes.io/service-name": "m"}},
           "addressType": "IPv4",
           "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
           "endpoints": [{"addresses": ["10.0.0.7"], "conditions": {"ready": True},
                          "targetRef": {"kind": "Pod", "name": "m-6d4f-abcde"}}]}
    slice_labels = {
        "__meta_kubernetes_namespace": "team-a",
        "__meta_kubernetes_endpointslice_name": "m-abc",
        "__meta_kubernetes_endpointslice_address_type": "IPv4",
        "__meta_kubernetes_endpointslice_label_kubernetes_io_service_name": "m",
        "__meta_kubernetes_endpointslice_labelpresent_kubernetes_io_service_name": "true",
        "__meta_kubernetes_service_name": "m",
        "__meta_kubernetes_service_label_tier": "x",
        "__meta_kubernetes_service_labelpresent_tier": "true",
    }
    served, uncovered = kubernetes_sd.endpointslice_targets(
        eps, service, {pod["metadata"]["name"]: pod})
    assert served == {
        "__address__": "10.0.0.7:8000", **slice_labels, **POD_LABELS, **VLLM_PORT,
        "__meta_kubernetes_endpointslice_endpoint_conditions_ready": "true",
        "__meta_kubernetes_endpointslice_address_target_kind": "Pod",
        "__meta_kubernetes_endpointslice_address_target_name": "m-6d4f-abcde",
        "__meta_kubernetes_endpointslice_port": "8000",
        "__meta_kubernetes_endpointslice_port_name": "http",
        "__meta_kubernetes_endpointslice_port_protocol": "TCP"}
    # the pod's port no endpoint covers: a target without endpointslice port labels
    assert uncovered["__address__"] == "10.0.0.7:9999"
    assert uncovered["__meta_kubernetes_pod_container_port_name"] == "debug"
    assert "__meta_kubernetes_endpointslice_port_name" not in uncovered


@pytest.mark.parametrize("metric", ["vllm:num_requests_waiting",
                                    *(s.metric for s in scaling_signals.SIGNALS)])
def test_the_adapter_rule_serves_the_metric_the_hpa_asks_for(metric):
    from vlm_operator.desired.autoscaler_objects import PROMETHEUS_ADAPTER_RULE, adapter_metric_name

    query = prometheus.adapter_pods_query(
        PROMETHEUS_ADAPTER_RULE, adapter_metric_name(metric),
        ["vllm:num_requests_running", metric, "up"], "ns", ["p-1", "p-2"])
    assert query == f'sum({metric}{{namespace="ns",pod=~"p-1|p-2"}}) by (pod)'
