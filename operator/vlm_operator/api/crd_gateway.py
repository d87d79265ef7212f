"""The CRD's spec.gateway: routing through an inference gateway (Gateway API Inference
Extension). With spec.gateway.inferencePool the operator creates and owns an InferencePool
(inference.networking.k8s.io/v1) that selects the pods in service, so the gateway's endpoint
picker stops choosing a pod the moment the operator fences, drains or scales it down."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlm_operator.api import schema as s

FAILURE_MODES = ["FailClose", "FailOpen"]


def inference_pool(spec: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """spec.gateway.inferencePool, or None when the spec asks for no InferencePool."""
    return ((spec or {}).get("gateway") or {}).get("inferencePool")


def gateway() -> s.Schema:
    return s.obj(
        "Routing through an inference gateway (Gateway API Inference Extension: Envoy "
        "Gateway, kgateway, Istio, GKE): docs/gateway.md.",
        {
            "inferencePool": s.obj(
                "An InferencePool (inference.networking.k8s.io/v1) of this VLMDeployment's "
                "name, created and owned by the operator: it selects the pods in service "
                "(a pod the operator fences, drains or scales down leaves it at once, as it "
                "leaves the Service) on port 8000. An HTTPRoute's backendRef names it. "
                "Needs the InferencePool CRD on the cluster (Degraded says when it is "
                "missing); the operator runs no endpoint picker.",
                {
                    "endpointPickerRef": s.obj(
                        "The endpoint picker (EPP) the gateway asks which pod serves a "
                        "request: an existing Service of this namespace.",
                        {
                            "name": s.string(
                                "Name of the picker's Service.", min_length=1,
                                max_length=63, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$"),
                            "port": s.obj("The picker Service's port (its gRPC ext-proc "
                                          "port, 9002 in the extension's charts).", {
                                "number": s.integer("Port number.", minimum=1,
                                                    maximum=65535),
                            }, required=["number"]),
                            "failureMode": s.string(
                                "What the gateway does while the picker does not answer: "
                                "FailClose refuses the request, FailOpen routes it to any "
                                "pod of the pool.", default="FailClose",
                                enum=FAILURE_MODES),
                        },
                        required=["name", "port"],
                    ),
                },
                required=["endpointPickerRef"],
            ),
        },
    )
