"""HPA and KEDA children of a VLMDeployment. Pure, like builders.py.

Both target the VLMDeployment's scale subresource (not the Deployment), so spec.replicas stays
the one source of the replica count and the reconciler keeps applying it.

HPA mode scales on a Pods metric served by prometheus-adapter through the custom metrics API.
Kubernetes metric names cannot hold ':' there, so the HPA asks for the vLLM name with ':' made
'_' (vllm:num_requests_waiting -> vllm_num_requests_waiting); PROMETHEUS_ADAPTER_RULE exposes
it under that name. KEDA mode queries Prometheus itself.
"""

from __future__ import annotations

from vlm_operator import crd
from vlm_operator.spec import VLMDeployment

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
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": vlmd.name}


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
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": adapter_metric_name(scaling["metric"])},
                "target": {"type": "AverageValue",
                           "averageValue": _quantity(scaling["target"])},
            }}],
            "behavior": _behavior(scaling),
        },
    }


def default_query(vlmd: VLMDeployment) -> str:
    """Total of the metric over this VLMDeployment's pods (KEDA divides by the replicas)."""
    metric = vlmd.spec["autoscaling"]["metric"]
    return (f'sum({metric}{{namespace="{vlmd.namespace}",'
            f'pod=~"{vlmd.name}-[a-z0-9]+-[a-z0-9]+"}})')


def get_scaled_object(vlmd: VLMDeployment, metadata: dict) -> dict:
    scaling = vlmd.spec["autoscaling"]
    prom = scaling.get("prometheus") or {}
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
            "triggers": [{
                "type": "prometheus",
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": prom.get("serverAddress", ""),
                    "query": prom.get("query") or default_query(vlmd),
                    "threshold": str(scaling["target"]),
                },
            }],
        },
    }


def wanted_kind(vlmd: VLMDeployment) -> str | None:
    """HorizontalPodAutoscaler, ScaledObject or None (Builtin mode or autoscaling off)."""
    scaling = vlmd.spec["autoscaling"]
    if not scaling["enabled"]:
        return None
    return {"HPA": HPA_KIND, "KEDA": KEDA_KIND}.get(scaling["mode"])


def get_autoscaling_children(vlmd: VLMDeployment, metadata: dict, hpa_api_version: str,
                             keda: bool) -> list[dict]:
    """The HPA or ScaledObject this spec asks for; none for KEDA when KEDA is not installed."""
    kind = wanted_kind(vlmd)
    if kind == HPA_KIND:
        return [get_hpa(vlmd, metadata, hpa_api_version)]
    if kind == KEDA_KIND and keda:
        return [get_scaled_object(vlmd, metadata)]
    return []


def get_unwanted(vlmd: VLMDeployment, hpa_api_version: str,
                 keda: bool) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of autoscaling objects that must not exist (mode off/changed).

    A ScaledObject makes its own HPA (keda-hpa-<name>), so in KEDA mode only ours goes.
    """
    kind = wanted_kind(vlmd)
    out = []
    if kind != HPA_KIND:
        out.append((hpa_api_version, HPA_KIND, vlmd.name))
    if kind != KEDA_KIND and keda:
        out.append((KEDA_API_VERSION, KEDA_KIND, vlmd.name))
    return out
