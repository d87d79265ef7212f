"""The CRD's spec.autoscaling: scaling on vLLM's own load signals, by the operator itself
(Builtin), a HorizontalPodAutoscaler (HPA) or KEDA; and `autoscaling_mode`, how every reader
tells which of them a spec runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlm_operator.api import promql
from vlm_operator.api import schema as s

AUTOSCALING_MODES = ["Builtin", "HPA", "KEDA"]


def autoscaling_mode(spec: Mapping[str, Any] | None) -> str | None:
    """The autoscaling mode a spec runs (Builtin, HPA, KEDA; Builtin when it names none, the
    CRD's default); None with autoscaling off. Defaulted or not, every reader asks here."""
    scaling = (spec or {}).get("autoscaling") or {}
    return scaling.get("mode", "Builtin") if scaling.get("enabled") else None


def autoscaling() -> s.Schema:
    return s.obj(
        "Scaling on vLLM's own load signals.",
        {
            "enabled": s.boolean("Turn autoscaling on.", default=False),
            "mode": s.string(
                "Builtin: the operator scrapes the pods itself; HPA: a "
                "HorizontalPodAutoscaler on a Pods metric (prometheus-adapter); KEDA: "
                "a ScaledObject with a Prometheus trigger.",
                default="Builtin", enum=AUTOSCALING_MODES),
            "minReplicas": s.integer("Fewest replicas.", default=1, minimum=0),
            "maxReplicas": s.integer("Most replicas.", default=1, minimum=1),
            "metric": s.string("The vLLM metric scaled on: a Prometheus metric name.",
                               default="vllm:num_requests_waiting",
                               pattern=promql.METRIC_NAME, max_length=promql.MAX_METRIC_NAME),
            "target": s.number("Target value of the metric per replica.",
                               default=5, minimum=0),
            "multimodalWeight": s.number(
                "Builtin mode: extra load of one image, in requests: a request carrying "
                "k images counts as 1 + k * multimodalWeight. Images per request are "
                "observed per pod from vllm:mm_cache_queries_total over "
                "vllm:request_success_total.", default=1, minimum=0, maximum=100),
            "scaleDownDelaySeconds": s.integer(
                "How long load must stay low before replicas are removed.",
                default=300, minimum=0, maximum=86400),
            "priority": s.integer(
                "Rank among VLMDeployments competing for free GPUs (higher first); "
                "defaults to the pods' PriorityClass value.",
                minimum=-1000000, maximum=1000000),
            "prometheus": s.obj(
                "Prometheus for KEDA mode.",
                {
                    "serverAddress": s.string("Prometheus URL.", pattern=r"^https?://"),
                    "query": s.string("PromQL query; a default on the metric is used "
                                      "when empty. Every selector must carry "
                                      "namespace=\"<the VLMDeployment's namespace>\".",
                                      max_length=promql.MAX_QUERY_LENGTH),
                },
            ),
        },
        default={},
    )
