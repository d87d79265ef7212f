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
from vlm_operator.api.reports import Report
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


def asks_cluster(vlmd: VLMDeployment, managed: bool, drift: bool) -> bool:
    """Whether a pass needs to know if the cluster serves InferencePools: only where this
    installation manages them (`managed`) and the spec asks for a pool, or a new spec (not
    `drift`) may have dropped one; a resync of any other spec costs no request."""
    return managed and (crd.inference_pool(vlmd.spec) is not None or not drift)


def get_pool_plan(vlmd: VLMDeployment, managed: bool, served: bool) -> tuple[bool, list[Report]]:
    """Whether InferencePools may be written and deleted for `vlmd` (this installation manages
    them and the cluster serves them), and the Degraded report when its spec asks for a pool
    that cannot be made, naming what is missing."""
    if managed and served:
        return True, []
    if crd.inference_pool(vlmd.spec) is None:
        return False, []
    missing = (
        "this installation does not manage InferencePools (chart value rbac.inferencePools, "
        "flag --inference-pools); no pool was made" if not managed else
        f"the cluster does not serve {API_VERSION} InferencePools: install the Gateway API "
        "Inference Extension's CRD (the pool is made once it is served)")
    return False, [Report("Degraded", "True", "InferencePoolUnavailable",
                          f"spec.gateway.inferencePool: {missing}")]


def unwanted_pool(vlmd: VLMDeployment) -> tuple[str, str, str] | None:
    """(apiVersion, kind, name) of the InferencePool a spec without spec.gateway.inferencePool
    must not have (one this VLMDeployment made before the field was removed)."""
    return None if crd.inference_pool(vlmd.spec) else (API_VERSION, KIND, vlmd.name)
