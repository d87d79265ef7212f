"""The cluster admin's policy on what a VLMDeployment may ask for (`vlm-operator run` flags,
the chart's `policy` values): allowed image prefixes, allowed PriorityClasses, and Secrets
referable only when labelled for it. All off by default.

A VLMDeployment makes the operator create pods, so without a policy its author gets what a
Deployment author gets in the namespace (docs/security.md). Violations are spec problems:
SpecValid=False with a message naming the field and the rule, and nothing is rolled out.
`problems` decides (pure); `secret_labels` is the one API read it needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vlm_operator import crd

# Secret metadata only: the operator never holds a Secret's data, even with `get` on Secrets.
_METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


@dataclass(frozen=True)
class Policy:
    image_prefixes: tuple[str, ...] = ()
    priority_classes: tuple[str, ...] = ()
    secret_label: str = ""  # "key=value" or "key" (any value); "": any Secret may be used

    @property
    def secret_selector(self) -> tuple[str, str | None] | None:
        if not self.secret_label:
            return None
        key, eq, value = self.secret_label.partition("=")
        return key, (value if eq else None)


def image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """`image` starts with a prefix at a boundary: `reg.example/vllm` allows
    `reg.example/vllm:v1` and `reg.example/vllm/x`, never `reg.example/vllm-evil`."""
    for prefix in prefixes:
        if image == prefix or (image.startswith(prefix) and (
                prefix[-1] in "/:@" or image[len(prefix)] in "/:@")):
            return True
    return False


def secret_refs(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(field, Secret name) for every Secret the pods would read."""
    refs = []
    token = spec.get("hfTokenSecretRef")
    if isinstance(token, dict) and isinstance(token.get("name"), str):
        refs.append(("spec.hfTokenSecretRef.name", token["name"]))
    env = (spec.get("vllm") or {}).get("env") if isinstance(spec.get("vllm"), dict) else None
    for i, var in enumerate(env if isinstance(env, list) else []):
        ref = ((var.get("valueFrom") or {}).get("secretKeyRef") or {}) if isinstance(
            var, dict) else {}
        if isinstance(ref, dict) and isinstance(ref.get("name"), str):
            refs.append((f"spec.vllm.env[{i}].valueFrom.secretKeyRef.name", ref["name"]))
    return refs


def problems(spec: Mapping[str, Any], policy: Policy,
             labels_of: Callable[[str], Mapping[str, str] | None]) -> list[str]:
    """Every way a (schema-valid, defaulted) spec breaks the policy, as `field: why` lines.

    `labels_of(secret)` gives a Secret's labels, None when it does not exist; it is only
    called when the Secret rule is on."""
    out = []
    image = spec.get("image") or crd.DEFAULT_IMAGE
    if policy.image_prefixes and not image_allowed(image, policy.image_prefixes):
        out.append(f"spec.image: {image!r} is not allowed by the operator's policy: images must "
                   f"start with one of {_listing(policy.image_prefixes)}")
    pc = (spec.get("scheduling") or {}).get("priorityClassName")
    if policy.priority_classes and pc and pc not in policy.priority_classes:
        out.append(f"spec.scheduling.priorityClassName: {pc!r} is not allowed by the operator's "
                   f"policy: allowed PriorityClasses are {_listing(policy.priority_classes)}")
    selector = policy.secret_selector
    if selector is not None:
        key, value = selector
        wanted = f"{key}={value}" if value is not None else key
        for where, name in secret_refs(spec):
            labels = labels_of(name)
            if labels is None:
                out.append(f"{where}: Secret {name!r} does not exist; the operator's policy "
                           f"only allows Secrets labelled {wanted}")
            elif key not in labels or (value is not None and labels[key] != value):
                out.append(f"{where}: Secret {name!r} is not labelled {wanted}; the operator's "
                           "policy only lets a VLMDeployment use Secrets labelled for it")
    return out


def _listing(values: tuple[str, ...]) -> str:
    return ", ".join(repr(v) for v in values)


def secret_labels(api: Any, namespace: str, name: str) -> dict[str, str] | None:
    """A Secret's labels (None: no such Secret), read as metadata only."""
    from kubernetes import client  # here: `render` validates without the client's import cost
    from kubernetes.client.exceptions import ApiException

    try:
        response = client.CoreV1Api(api).read_namespaced_secret(
            name, namespace, _preload_content=False, _headers={"Accept": _METADATA_ONLY})
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return json.loads(response.data).get("metadata", {}).get("labels") or {}
