"""Validation of spec.autoscaling: the replica bounds, and what the HPA and KEDA modes cannot
do (long stabilization windows, ScaleDown actions, zero replicas under KEDA, a Prometheus query
reading other namespaces)."""

from __future__ import annotations

from vlm_operator.api import crd, promql
from vlm_operator.api.schema import section
from vlm_operator.api.validation_health import health_actions

# The HorizontalPodAutoscaler API (and so KEDA's) refuses stabilization windows over an hour.
HPA_MAX_WINDOW_S = 3600


def scaling_problems(spec: dict, namespace: str) -> list[str]:
    scaling = section(spec, "autoscaling")
    problems = []
    low, high = scaling.get("minReplicas"), scaling.get("maxReplicas")
    if isinstance(low, int) and isinstance(high, int) and low > high:
        problems.append(f"spec.autoscaling.minReplicas: {low} is larger than "
                        f"spec.autoscaling.maxReplicas ({high})")
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
        query = section(scaling, "prometheus").get("query")
        if isinstance(query, str) and query:
            problems += promql.namespace_problems(query, namespace,
                                                  "spec.autoscaling.prometheus.query")
    return problems
