"""The InferencePool child of a VLMDeployment (Gateway API Inference Extension,
inference.networking.k8s.io/v1). Pure, like desired/children.py.

A gateway that implements the extension sends a model's requests to the pods its InferencePool
selects, choosing among them through an endpoint picker. The pool selects exactly what the
Service selects (the pods' labels and the in-service label), so a pod the operator fences, drains
or scales down leaves the picker's choices as soon as its label flips, not when the kubelet's
readiness probe fails some tens of seconds later.
"""

from __future__ import annotations

import copy

from vlm_operator.api import crd
from vlm_operator.api.names import PORT
from vlm_operator.api.validation import VLMDeployment
from vlm_operator.desired import children

API_VERSION = "inference.networking.k8s.io/v1"
KIND = "InferencePool"


def get_inference_pool(vlmd: VLMDeployment) -> dict | None:
    """The InferencePool spec.gateway.inferencePool asks for; None when it asks for none. Its
    name, labels, owner and selector are the Service's, so the two never disagree on which pods
    serve."""
    wanted = crd.inference_pool(vlmd.spec)
    if wanted is None:
        return None
    picker = wanted["endpointPickerRef"]
    service = children.get_service(vlmd)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": copy.deepcopy(service["metadata"]),
        "spec": {
            "selector": {"matchLabels": dict(service["spec"]["selector"])},
            "targetPorts": [{"number": PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker["name"],
                "port": {"number": picker["port"]["number"]},
                "failureMode": picker["failureMode"],
            },
        },
    }


def get_gateway_children(vlmd: VLMDeployment, inference_pools: bool) -> list[dict]:
    """The gateway objects to apply after children.get_children's. `inference_pools`: whether
    InferencePools may be written here (the cluster serves them and this installation manages
    them); without, none."""
    pool = get_inference_pool(vlmd) if inference_pools else None
    return [pool] if pool else []


def unwanted_pool(vlmd: VLMDeployment) -> tuple[str, str, str] | None:
    """(apiVersion, kind, name) of the InferencePool a spec without spec.gateway.inferencePool
    must not have (one this VLMDeployment made before the field was removed)."""
    return None if crd.inference_pool(vlmd.spec) else (API_VERSION, KIND, vlmd.name)
