"""HPA and KEDA children of a VLMDeployment. Pure, like desired/children.py.

Both target the VLMDeployment's scale subresource (not the Deployment), so spec.replicas stays
the one source of the replica count and the reconciler keeps applying it.

HPA mode scales on Pods metrics served by prometheus-adapter through the custom metrics API.
Kubernetes metric names cannot hold ':' there, so the HPA asks for the vLLM name with ':' made
'_' (vllm:num_requests_waiting -> vllm_num_requests_waiting); PROMETHEUS_ADAPTER_RULE exposes
it under that name. KEDA mode queries Prometheus itself.

Both get the load signals Builtin mode uses where they can read them: the configured metric
and, as further metrics (the HPA acts on the larger recommendation), each capacity signal of
api/scaling_signals.py (the KV-cache usage, so replicas that are busy without a queue are not
scaled away) with its value per full replica. KEDA's default query also weighs the metric by
the images per request, as Builtin does per pod (here over the whole VLMDeployment); the HPA
cannot (a Pods metric is one series).
"""

from __future__ import annotations

from vlm_operator.api import crd, names, promql, scaling_signals
from vlm_operator.api.validation import VLMDeployment

HPA_KIND = "HorizontalPodAutoscaler"
KEDA_API_VERSION = "keda.sh/v1alpha1"
KEDA_KIND = "ScaledObject"
KEDA_POLLING_SECONDS = 15


# The prometheus-adapter rule HPA mode needs (docs/install.md): every vLLM series that carries
# the namespace and pod target labels becomes the Pods metric vllm_<name>, summed per pod.
PROMETHEUS_ADAPTER_RULE = {
    "seriesQuery": '{__name__=~"^vllm:.*",namespace!="",pod!=""}',
    "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                "pod": {"resource": "pod"}}},
    "name": {"matches": "^vllm:(.*)$", "as": "vllm_${1}"},
    "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
}


def _target_ref(vlmd: VLMDeployment) -> dict:
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": vlmd.name}


def adapter_metric_name(metric: str) -> str:
    return metric.replace(":", "_")


def _behavior(scaling: dict) -> dict:
    """Scale up at once, scale down only after scaleDownDelaySeconds of lower recommendations."""
    return {
        "scaleUp": {"stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}]},
        "scaleDown": {"stabilizationWindowSeconds": scaling["scaleDownDelaySeconds"],
                      "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
    }


def _quantity(value: float) -> str:
    """A Kubernetes quantity for a metric target: integers as is, fractions in milli-units."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def get_hpa(vlmd: VLMDeployment, metadata: dict,
            api_version: str = "autoscaling/v2") -> dict:
    """autoscaling/v2 and v2beta2 share this shape for Pods metrics and behavior."""
    scaling = vlmd.spec["autoscaling"]
    return {
        "apiVersion": api_version,
        "kind": HPA_KIND,
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": _target_ref(vlmd),
            "minReplicas": max(1, scaling["minReplicas"]),  # HPA cannot scale to zero
            "maxReplicas": scaling["maxReplicas"],
            "metrics": [_pods_metric(scaling["metric"], scaling["target"]),
                        *(_pods_metric(signal.metric, signal.full)
                          for signal in scaling_signals.SIGNALS)],
            "behavior": _behavior(scaling),
        },
    }


def _pods_metric(metric: str, target: float) -> dict:
    return {"type": "Pods", "pods": {
        "metric": {"name": adapter_metric_name(metric)},
        "target": {"type": "AverageValue", "averageValue": _quantity(target)}}}


def get_scaled_object(vlmd: VLMDeployment, metadata: dict, prometheus_address: str) -> dict:
    """`prometheus_address`: policy.prometheus_address (the admin's, never the tenant's own).
    The queries are promql.keda_queries, which validation checks stay in the namespace."""
    scaling = vlmd.spec["autoscaling"]
    (_, main), *capacity = promql.keda_queries(scaling, vlmd.namespace, vlmd.name)

    def trigger(query: str, threshold: float) -> dict:
        return {"type": "prometheus", "metricType": "AverageValue",
                "metadata": {"serverAddress": prometheus_address, "query": query,
                             "threshold": f"{threshold:g}"}}

    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": KEDA_KIND,
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": _target_ref(vlmd),
            "minReplicaCount": scaling["minReplicas"],
            "maxReplicaCount": scaling["maxReplicas"],
            "pollingInterval": KEDA_POLLING_SECONDS,
            "cooldownPeriod": scaling["scaleDownDelaySeconds"],
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(scaling)}},
            "triggers": [trigger(main, scaling["target"]),
                         *(trigger(query, signal.full) for (_, query), signal
                           in zip(capacity, scaling_signals.SIGNALS, strict=True))],
        },
    }


def wanted_kind(vlmd: VLMDeployment) -> str | None:
    """HorizontalPodAutoscaler, ScaledObject or None (Builtin mode or autoscaling off)."""
    return {"HPA": HPA_KIND, "KEDA": KEDA_KIND}.get(crd.autoscaling_mode(vlmd.spec))


def get_autoscaling_children(vlmd: VLMDeployment, metadata: dict, hpa_api_version: str,
                             keda: bool, prometheus_address: str | None) -> list[dict]:
    """The HPA or ScaledObject this spec asks for; none for KEDA when KEDA is not installed or
    no Prometheus is known (validation says so)."""
    kind = wanted_kind(vlmd)
    if kind == HPA_KIND:
        return [get_hpa(vlmd, metadata, hpa_api_version)]
    if kind == KEDA_KIND and keda and prometheus_address:
        return [get_scaled_object(vlmd, metadata, prometheus_address)]
    return []


def get_unwanted(vlmd: VLMDeployment, hpa_api_version: str, keda: bool,
                 served: tuple[str, ...] = ("HPA", "KEDA")) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of autoscaling objects that must not exist (mode off/changed).

    A ScaledObject makes its own HPA (keda-hpa-<name>), so in KEDA mode only ours goes. Modes
    this installation does not serve (`served`, policy.autoscaling_modes) never made any, and
    its RBAC may not read them.
    """
    kind = wanted_kind(vlmd)
    out = []
    if kind != HPA_KIND and "HPA" in served:
        out.append((hpa_api_version, HPA_KIND, vlmd.name))
    if kind != KEDA_KIND and keda and "KEDA" in served:
        out.append((KEDA_API_VERSION, KEDA_KIND, vlmd.name))
    return out
