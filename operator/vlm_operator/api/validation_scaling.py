"""Validation of spec.autoscaling: the replica bounds, and what the HPA and KEDA modes cannot
do (long stabilization windows, ScaleDown actions, zero replicas under KEDA, a Prometheus query
reading other namespaces: the tenant's, or the ones the operator builds on the metric)."""

from __future__ import annotations

import re

from vlm_operator.api import crd, promql
from vlm_operator.api.schema import section
from vlm_operator.api.validation_health import health_actions

# The HorizontalPodAutoscaler API (and so KEDA's) refuses stabilization windows over an hour.
HPA_MAX_WINDOW_S = 3600


def scaling_problems(spec: dict, namespace: str, name: str) -> list[str]:
    scaling = section(spec, "autoscaling")
    problems = []
    low, high = scaling.get("minReplicas"), scaling.get("maxReplicas")
    if isinstance(low, int) and isinstance(high, int) and low > high:
        problems.append(f"spec.autoscaling.minReplicas: {low} is larger than "
                        f"spec.autoscaling.maxReplicas ({high})")
    metric = scaling.get("metric")
    if isinstance(metric, str) and re.search(promql.METRIC_NAME, metric) and \
            not promql.is_metric_name(metric):  # what the schema's '$' lets by: a last '\n'
        problems.append(f"spec.autoscaling.metric: {metric!r} is not a metric name: it is "
                        "pasted into the autoscaler's queries and read from /metrics by name")
    mode = crd.autoscaling_mode(spec)
    if mode in ("HPA", "KEDA"):
        owner = "the HorizontalPodAutoscaler" if mode == "HPA" else "KEDA's HorizontalPodAutoscaler"
        delay = scaling.get("scaleDownDelaySeconds")
        if isinstance(delay, int) and delay > HPA_MAX_WINDOW_S:
            problems.append(
                f"spec.autoscaling.scaleDownDelaySeconds: {delay} is more than "
                f"{HPA_MAX_WINDOW_S} in {mode} mode: it becomes {owner}'s scale-down "
                f"stabilization window, which the API refuses above {HPA_MAX_WINDOW_S} s; use "
                f"{HPA_MAX_WINDOW_S} or less, or Builtin mode")
        for where, action in health_actions(spec):
            if action == "ScaleDown":
                problems.append(
                    f"{where}: ScaleDown is not available in {mode} mode: {owner} owns "
                    "spec.replicas and would restore the lowered count at once (the pod would "
                    "only be restarted after a drain); use Restart")
    if mode == "KEDA":
        if low == 0:
            problems.append(
                "spec.autoscaling.minReplicas: 0 is not supported in KEDA mode: at zero "
                "replicas the pods' series are gone, so the query reads nothing and the "
                "ScaledObject would never scale back up; use 1 or more")
        problems += _query_problems(scaling, namespace, name)
    return problems


def _query_problems(scaling: dict, namespace: str, name: str) -> list[str]:
    """Every query the ScaledObject would carry must read only this namespace's series. A
    query or metric of the wrong type or over its length is the schema's problem alone (and is
    not tokenized)."""
    query = section(scaling, "prometheus").get("query")
    metric = scaling.get("metric")
    if query is not None and (not isinstance(query, str)
                              or len(query) > promql.MAX_QUERY_LENGTH):
        return []
    if not query and (not isinstance(metric, str) or len(metric) > promql.MAX_METRIC_NAME
                      or not isinstance(scaling.get("multimodalWeight"), int | float)):
        return []  # the schema's problems
    problems = []
    for where, built in promql.keda_queries(scaling, namespace, name):
        problems += promql.namespace_problems(built, namespace, where)
    return problems
