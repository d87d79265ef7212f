"""The chart's and the builders' PromQL against a real Prometheus (Debian's prometheus 2.42, the
session's `monitoring` fixture): it scrapes the operator through the chart's own Service and
Deployment and the simulated vLLM pods, with the scrape configuration the Prometheus Operator
generates from the chart's ServiceMonitor and PodMonitor, and evaluates the chart's
PrometheusRule every second.

One scenario causes what the alerts and panels watch: a scale-up, autoscaler scrape errors,
engine-death restarts until the restart budget is spent, pods without the tokenizer pool and a
child the apiserver refuses. Then every alert expression, every dashboard panel and variable,
the KEDA ScaledObject query and the query prometheus-adapter runs for the HPA metric must return
the series they are meant to, with the labels the dashboard and alerts use. No scenario here
causes reconcile errors: that alert must be quiet while its input series are scraped (promtool's
tests in tests/prometheus/ make it fire). Last, the operator's target goes and VLMOperatorDown
must answer.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from dataclasses import dataclass

import pytest
from kube_helpers import (
    SESSION_NS_PREFIX,
    cr,
    create,
    get_cr,
    make_namespace,
    metric,
    ready_pods,
    sim_post,
    wait_for,
    wait_ready_pods,
)
from kubernetes import client

from vlm_operator.api.validation import parse
from vlm_operator.desired import autoscaler_objects
from vlm_testbed.controlplane import apply_manifests
from vlm_testbed.nodesim import NodeSimulator, default_command
from vlm_testbed.prometheus import adapter_pods_query

NAME = "obs"
WAITING = 8  # requests waiting on one pod: 1.6 replicas at target 5
BOGUS_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Bogus"}]}]}}}
STAND_IN_KINDS = ("ServiceAccount", "Service", "Deployment")


def operator_stand_in(container: dict, pod_ip: str) -> list[str]:
    """The chart's operator container runs idle: the session operator listens on every
    loopback address, so the pod's IP and the chart's ports reach it."""
    if container["name"] == "operator":
        return [sys.executable, "-c", "import signal; signal.pause()"]
    return default_command(container, pod_ip)


@dataclass
class Scenario:
    ns: str
    release_ns: str
    job: str
    operator_pod: str
    loaded_pod: str

    @property
    def vlmd(self) -> dict:
        return {"vlmdeployment_namespace": self.ns, "vlmdeployment": NAME}


def values(result: list[dict]) -> list[float]:
    return [float(r["value"][1]) for r in result]


def eventually(prom, what: str, expr: str, check=bool, timeout: float = 90) -> list[dict]:
    """The query's result once check(result) holds (scrapes and rules run every second)."""
    return wait_for(what, lambda: (r := prom.query(expr)) is not None and check(r) and r,
                    timeout=timeout, interval=1.0)


def operator_counter(operator, name: str, **labels) -> float:
    return metric(operator.metrics(), name, vlmdeployment=NAME, **labels)


@pytest.fixture(scope="module")
def scenario(api, cluster, operator, monitoring):
    prom = monitoring.prometheus
    job = f"{monitoring.release}-metrics"
    ns = make_namespace(api, SESSION_NS_PREFIX)
    with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=4, backoff_base=1.0,
                       name_prefix=f"sim-{ns}", command_for=operator_stand_in):
        apply_manifests(api, [d for d in monitoring.docs if d["kind"] in STAND_IN_KINDS])
        (target,) = eventually(prom, "the operator's target", f'up{{job="{job}"}} == 1')
        create(api, ns, cr(NAME, replicas=1, vllm={"env": [
                               {"name": "VLM_SIM_PATCHED", "value": "inactive"}]},
                           autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                                        "target": 5, "scaleDownDelaySeconds": 3600},
                           health={"engineDead": {"threshold": 1, "windowSeconds": 60,
                                                  "action": "Restart"},
                                   "maxRestartsPerHour": 2, "minAvailable": 0,
                                   "recovery": "NewPod"}))  # restarts make fresh pods
        create(api, ns, cr(f"{NAME}-refused", replicas=1,
                           scheduling={"affinity": BOGUS_AFFINITY}))

        # a scale-up
        (first,) = wait_ready_pods(api, ns, NAME, 1)
        sim_post(first.status.pod_ip, "/sim/fault", {"fault": "load", "waiting": WAITING})
        pods = wait_ready_pods(api, ns, NAME, 2)
        second = next(p for p in pods if p.metadata.uid != first.metadata.uid)
        # scrape errors: the second pod's /metrics answers after the operator's 1 s deadline
        sim_post(second.status.pod_ip, "/sim/fault", {"fault": "slow_metrics", "seconds": 3})
        wait_for("scrape errors counted", lambda: operator_counter(
            operator, "vlm_operator_autoscaler_scrape_errors_total") >= 3, timeout=60)
        # two engine deaths restarted (maxRestartsPerHour: 2), then one held back
        for pod in (first, second):
            sim_post(pod.status.pod_ip, "/sim/fault", {"fault": "engine_dead"})
        wait_for("two restarts", lambda: operator_counter(
            operator, "vlm_operator_remediations_total", action="Restart") >= 2, timeout=90)
        fresh = wait_for("two fresh ready pods", lambda: len(r := [
            p for p in ready_pods(api, ns, NAME)
            if p.metadata.uid not in (first.metadata.uid, second.metadata.uid)]) == 2 and r,
            timeout=120)
        sim_post(fresh[0].status.pod_ip, "/sim/fault", {"fault": "engine_dead"})
        wait_for("a restart held back", lambda: operator_counter(
            operator, "vlm_operator_remediations_skipped_total",
            reason="budget_exhausted") >= 1, timeout=60)
        sim_post(fresh[1].status.pod_ip, "/sim/fault", {"fault": "load", "waiting": WAITING})
        yield Scenario(ns=ns, release_ns=monitoring.namespace, job=job,
                       operator_pod=target["metric"]["pod"],
                       loaded_pod=fresh[1].metadata.name)
    client.CoreV1Api(api).delete_namespace(ns)


def matches(result: list[dict], want: dict) -> list[dict]:
    return [r for r in result if want.items() <= r["metric"].items()]


# -- the scrape configuration: target labels, and no label collision


def test_targets_carry_the_prometheus_operator_target_labels(monitoring, scenario):
    prom = monitoring.prometheus
    (up,) = prom.query(f'up{{job="{scenario.job}"}}')
    assert {k: v for k, v in up["metric"].items() if k != "instance"} == {
        "__name__": "up", "job": scenario.job, "namespace": scenario.release_ns,
        "service": scenario.job, "pod": scenario.operator_pod, "container": "operator",
        "endpoint": "metrics"}
    (vllm,) = eventually(prom, "the loaded vLLM pod's series",
                         f'vllm:num_requests_waiting{{pod="{scenario.loaded_pod}"}}')
    assert {k: vllm["metric"][k] for k in ("namespace", "pod", "container", "endpoint",
                                            "job")} == {
        "namespace": scenario.ns, "pod": scenario.loaded_pod, "container": "vllm",
        "endpoint": "http", "job": f"{scenario.release_ns}/{monitoring.release}-vllm"}


def test_per_vlmdeployment_series_keep_their_labels_beside_the_targets(monitoring, scenario):
    """The label choice: the operator's per-VLMDeployment series name theirs
    vlmdeployment_namespace/vlmdeployment; `namespace` stays the target's (the operator's), and
    no scraped label was renamed exported_* (honorLabels stays false)."""
    prom = monitoring.prometheus
    result = prom.query(f'vlm_operator_remediations_total{{vlmdeployment="{NAME}",'
                        f'vlmdeployment_namespace="{scenario.ns}"}}')
    assert result and all(r["metric"]["namespace"] == scenario.release_ns for r in result)
    every = prom.query('{__name__=~"vlm_operator_.+|vllm:.+"}')
    assert every
    assert not [r["metric"] for r in every if any(k.startswith("exported_") for k in r["metric"])]


# -- the alerts


def alert_expectations(s: Scenario) -> dict[str, tuple[list[dict], str | None]]:
    """Per alert: the label sets its expression must return in this scenario (none: quiet),
    and for a quiet one the query that shows its inputs are scraped."""
    return {
        "VLMOperatorDown": ([], f'up{{job="{s.job}"}} == 1'),
        "VLMOperatorReconcileErrors": ([], f'vlm_operator_reconciles_total{{job="{s.job}"}}'),
        "VLMRemediationStorm": ([s.vlmd], None),
        "VLMDeploymentDegraded": ([s.vlmd], None),
        "VLMEngineUnpatched": ([s.vlmd], None),
        "VLMAutoscalerScrapeErrors": ([s.vlmd], None),
        "VLMPodsUnreachable": ([], f'vlm_operator_pods_unreachable{{job="{s.job}"}}'),
        "VLMOperatorActionsFailing": ([{"reason": "ApplyFailed"}], None),
    }


def rules(monitoring) -> dict[str, dict]:
    return {r["alert"]: r for d in monitoring.docs if d["kind"] == "PrometheusRule"
            for g in d["spec"]["groups"] for r in g["rules"]}


def ours(result: list[dict], s: Scenario) -> list[dict]:
    """Series of this scenario: other modules' VLMDeployments count in the same operator."""
    return [r for r in result if r["metric"].get("vlmdeployment_namespace", s.ns) == s.ns]


def test_every_alert_expression_returns_what_it_is_meant_to(monitoring, scenario):
    prom = monitoring.prometheus
    expected = alert_expectations(scenario)
    assert set(expected) == set(rules(monitoring))
    for alert, rule in rules(monitoring).items():
        want, inputs = expected[alert]
        if want:
            result = eventually(prom, alert, rule["expr"], lambda r, w=want: all(
                matches(r, x) for x in w))
            if "vlmdeployment" in want[0]:  # exactly these labels, nothing else of ours
                assert [r["metric"] for r in ours(result, scenario)] == want, alert
        else:
            assert eventually(prom, f"{alert}'s inputs", inputs), alert
            assert ours(prom.query(rule["expr"]), scenario) == [], alert


def test_prometheus_evaluates_the_rules_into_alerts(monitoring, scenario):
    """The PrometheusRule as Prometheus loads it: the alerts this scenario causes are pending or
    firing with the labels the expressions keep, and their descriptions name the
    VLMDeployment."""
    prom = monitoring.prometheus
    for alert, (want, _) in alert_expectations(scenario).items():
        for labels in want:
            (active,) = wait_for(f"{alert} active", lambda a=alert, x=labels: [
                r for r in prom.alerts() if r["labels"]["alertname"] == a
                and x.items() <= r["labels"].items()], timeout=60, interval=1.0)
            assert active["state"] in ("pending", "firing")
            if "vlmdeployment" in labels:
                assert f"{scenario.ns}/{NAME}" in active["annotations"]["description"], alert


# -- the dashboard


def dashboard(monitoring) -> dict:
    (cm,) = [d for d in monitoring.docs if d["kind"] == "ConfigMap"
             and d["metadata"]["name"].endswith("-dashboard")]
    return json.loads(cm["data"]["vlm-operator.json"])


def panel_expectations(s: Scenario) -> dict[tuple[str, str], list[dict]]:
    """(panel title, refId) -> label sets the target must return, `$namespace` set to the
    scenario's namespace."""
    vlmd = s.vlmd
    return {
        ("Reconciles by result", "A"): [{"result": "ok"}],
        ("Detections in vLLM logs and stall checks, by signature (15 min)", "A"): [
            {**vlmd, "signature": "engine_dead"}, {**vlmd, "signature": "plugin_inactive"}],
        ("Remediations by action (1 h)", "A"): [{**vlmd, "action": "Restart"}],
        ("Remediations held back, by guard (1 h)", "A"): [{**vlmd, "reason": "budget_exhausted"}],
        ("Autoscaler: desired vs current replicas", "A"): [vlmd],
        ("Autoscaler: desired vs current replicas", "B"): [vlmd],
        ("Autoscaler: free GPUs", "A"): [{}],
        ("Autoscaler: failed scrapes of vLLM pods", "A"): [vlmd],
        ("Operator Warning Events by reason (1 h)", "A"): [{"reason": "ApplyFailed"}],
        ("vLLM requests waiting", "A"): [{"namespace": s.ns, "pod": s.loaded_pod}],
        ("vLLM KV cache usage", "A"): [{"namespace": s.ns, "pod": s.loaded_pod}],
    }


def test_every_dashboard_panel_returns_its_series(monitoring, scenario):
    prom = monitoring.prometheus
    board = dashboard(monitoring)
    expected = panel_expectations(scenario)
    targets = {(p["title"], t["refId"]): t for p in board["panels"] for t in p["targets"]}
    assert set(targets) == set(expected)
    for key, target in targets.items():
        expr = target["expr"].replace("$namespace", scenario.ns)
        result = eventually(prom, str(key), expr, lambda r, w=expected[key]: all(
            matches(r, x) for x in w))
        for r in result:  # each legend's labels are on every series it draws
            for label in re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]):
                assert label in r["metric"], (key, label, r["metric"])
        if key == ("vLLM requests waiting", "A"):
            assert values(matches(result, {"pod": scenario.loaded_pod})) == [WAITING]
        if key[0] == "Autoscaler: desired vs current replicas":
            assert values(matches(result, scenario.vlmd)) == [2]


def test_the_namespace_variable_offers_the_scenario_namespace(monitoring, scenario):
    """`label_values(metric, label)`: Grafana lists `label` of the series of `metric`."""
    (variable,) = [v for v in dashboard(monitoring)["templating"]["list"]
                   if v["name"] == "namespace"]
    metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"]).groups()
    offered = {r["metric"].get(label) for r in monitoring.prometheus.query(metric)}
    assert scenario.ns in offered


# -- the builders' queries: KEDA's ScaledObject and the HPA's metric through prometheus-adapter


def vlmd_in_mode(api, ns: str, **autoscaling):
    """The scenario's VLMDeployment as it would be in another autoscaling mode."""
    body = copy.deepcopy(get_cr(api, ns, NAME))
    body["spec"]["autoscaling"].update(autoscaling)
    return parse(body)


def test_the_keda_query_sums_the_load_of_the_vlmdeployment(api, monitoring, scenario):
    vlmd = vlmd_in_mode(api, scenario.ns, mode="KEDA")
    so = autoscaler_objects.get_scaled_object(vlmd, {"name": NAME}, monitoring.prometheus.url)
    load, kv = so["spec"]["triggers"]
    assert {t["metadata"]["serverAddress"] for t in (load, kv)} == {monitoring.prometheus.url}
    result = eventually(monitoring.prometheus, "the KEDA query", load["metadata"]["query"],
                        lambda r: values(r) == [WAITING])
    assert [r["metric"] for r in result] == [{}]
    # the second trigger, the KV-cache usage Builtin mode also scales on, reads a value too
    result = eventually(monitoring.prometheus, "the KEDA KV-cache query", kv["metadata"]["query"],
                        lambda r: len(values(r)) == 1)
    assert [r["metric"] for r in result] == [{}]


def test_the_hpa_metric_through_prometheus_adapter_gives_each_pod_its_load(
        api, monitoring, scenario):
    prom = monitoring.prometheus
    vlmd = vlmd_in_mode(api, scenario.ns, mode="HPA")
    hpa = autoscaler_objects.get_hpa(vlmd, {"name": NAME})
    metric, kv_metric = (m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"])
    assert kv_metric == "vllm_kv_cache_usage_perc"
    rule = autoscaler_objects.PROMETHEUS_ADAPTER_RULE
    names = [s["__name__"] for s in prom.series(rule["seriesQuery"])]
    pods = [p.metadata.name for p in ready_pods(api, scenario.ns, NAME)]
    query = adapter_pods_query(rule, metric, names, scenario.ns, pods)
    result = eventually(prom, "the adapter's query", query,
                        lambda r: matches(r, {"pod": scenario.loaded_pod}))
    assert {r["metric"]["pod"] for r in result} <= set(pods)
    assert values(matches(result, {"pod": scenario.loaded_pod})) == [WAITING]


# -- last: the operator's target goes


def test_operator_down_answers_when_the_target_is_gone(api, monitoring, scenario):
    prom = monitoring.prometheus
    rule = rules(monitoring)["VLMOperatorDown"]
    client.AppsV1Api(api).patch_namespaced_deployment_scale(
        monitoring.release, scenario.release_ns, {"spec": {"replicas": 0}})
    result = eventually(prom, "VLMOperatorDown's expression", rule["expr"], timeout=120)
    assert [r["metric"] for r in result] == [{"job": scenario.job}]
    wait_for("VLMOperatorDown pending", lambda: [
        a for a in prom.alerts() if a["labels"]["alertname"] == "VLMOperatorDown"
        and a["labels"]["job"] == scenario.job], timeout=60, interval=1.0)
