"""Applying manifests to the control plane (CRDs waited for until established) and namespaces
ready for pods (their default ServiceAccount there)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import yaml

from .build import ControlPlaneError


def load_manifests(items: Iterable[dict | str | os.PathLike]) -> list[dict]:
    """Dicts are taken as they are; paths are read as (multi-document) YAML."""
    docs: list[dict] = []
    for item in items:
        if isinstance(item, dict):
            docs.append(item)
            continue
        with open(item) as f:
            docs.extend(d for d in yaml.safe_load_all(f) if d)
    return docs


def _crd_established(obj: dict) -> bool:
    conds = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conds)


def apply_manifests(api_client: Any, manifests: Iterable[dict | str | os.PathLike],
                    timeout_s: float = 60.0) -> None:
    """Create (or merge-patch when present) each object; CRDs first, waited until Established."""
    from kubernetes.dynamic import DynamicClient
    from kubernetes.dynamic.exceptions import ConflictError

    docs = load_manifests(manifests)
    crds = [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
    rest = [d for d in docs if d.get("kind") != "CustomResourceDefinition"]
    for group in (crds, rest):
        if not group:
            continue
        dyn = DynamicClient(api_client)
        for doc in group:
            res = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            meta = doc.get("metadata") or {}
            ns = meta.get("namespace") if res.namespaced else None
            if res.namespaced and not ns:
                ns = "default"
            try:
                res.create(body=doc, namespace=ns)
            except ConflictError:
                res.patch(body=doc, name=meta["name"], namespace=ns,
                          content_type="application/merge-patch+json")
        if group is crds:
            crd_res = dyn.resources.get(api_version="apiextensions.k8s.io/v1",
                                        kind="CustomResourceDefinition")
            deadline = time.monotonic() + timeout_s
            for doc in crds:
                name = doc["metadata"]["name"]
                while not _crd_established(crd_res.get(name=name).to_dict()):
                    if time.monotonic() > deadline:
                        raise ControlPlaneError(f"CRD {name} not Established in {timeout_s} s")
                    time.sleep(0.1)


def ready_namespace(api_client: Any, name: str, timeout_s: float = 120.0) -> str:
    """Create a namespace and wait until pods can be created in it: its default ServiceAccount
    exists (and, before Kubernetes 1.24, has its token Secret)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(api_client)
    core.create_namespace({"metadata": {"name": name}})
    need_secret = int(client.VersionApi(api_client).get_code().minor.rstrip("+")) < 24
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            sa = core.read_namespaced_service_account("default", name)
            if sa.secrets or not need_secret:
                return name
        except ApiException as exc:
            if exc.status != 404:
                raise
        time.sleep(0.2)
    raise TimeoutError(f"default ServiceAccount in {name} not ready in {timeout_s} s")
