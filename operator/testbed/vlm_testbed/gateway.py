"""The Gateway API Inference Extension's InferencePool CRD (v1) on the test bed.

data/inference.networking.k8s.io_inferencepools.yaml is the CRD as the extension publishes it
(kubernetes-sigs/gateway-api-inference-extension, config/crd/bases/ at commit
84436a96b9e6ce2b59ddacd3d04c31b4fbd442de, Apache License 2.0). Its CEL rules
(x-kubernetes-validations) need Kubernetes 1.25+: an older apiserver (the test bed's 1.20)
refuses the whole CRD with them, so install_crd strips them there. They are two (a picker
Service needs a port; target port numbers are unique), and cel_problems checks both in Python so
tests still hold rendered pools to them. The 1.20 apiserver also refuses the one empty-string
default (endpointPickerRef.group: "", read there as null); it goes too: the operator never
writes that field, and "" is what an absent group means to the extension anyway.
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import yaml

CRD_PATH = (pathlib.Path(__file__).parent / "data"
            / "inference.networking.k8s.io_inferencepools.yaml")
CEL_MIN_MINOR = 25  # x-kubernetes-validations: beta (on by default) from Kubernetes 1.25


def crd(strip_cel: bool = False) -> dict:
    """The CRD as published (its status dropped); `strip_cel`: for an apiserver older than
    1.25, without its CEL rules and its empty-string default."""
    doc = yaml.safe_load(CRD_PATH.read_text())
    doc.pop("status", None)
    return _for_old_apiservers(doc) if strip_cel else doc


def schema() -> dict:
    """The owner's openAPIV3Schema of inference.networking.k8s.io/v1 InferencePool."""
    (version,) = [v for v in crd()["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def _for_old_apiservers(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _for_old_apiservers(v) for k, v in node.items()
                if k != "x-kubernetes-validations" and not (k == "default" and v == "")}
    if isinstance(node, list):
        return [_for_old_apiservers(v) for v in node]
    return copy.deepcopy(node)


def cel_problems(pool: dict) -> list[str]:
    """The CRD's two CEL rules, as Python: what a 1.25+ apiserver would refuse."""
    spec = pool.get("spec") or {}
    problems = []
    picker = spec.get("endpointPickerRef")
    if picker is not None and picker.get("kind", "Service") == "Service" and "port" not in picker:
        problems.append("spec.endpointPickerRef: port is required when kind is 'Service' or "
                        "unspecified (defaults to 'Service')")
    numbers = [p.get("number") for p in spec.get("targetPorts") or []]
    if len(numbers) != len(set(numbers)):
        problems.append("spec.targetPorts: port number must be unique")
    return problems


def install_crd(api_client: Any) -> bool:
    """Install the InferencePool CRD on the cluster (waited until Established); its CEL rules
    only where the apiserver is 1.25 or newer. Returns whether they were stripped."""
    from kubernetes import client

    from vlm_testbed.controlplane.manifests import apply_manifests

    minor = int(client.VersionApi(api_client).get_code().minor.rstrip("+"))
    strip = minor < CEL_MIN_MINOR
    apply_manifests(api_client, [crd(strip_cel=strip)])
    return strip
