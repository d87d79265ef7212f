"""Pods on a real node for benches and tests: a stand-in pod shaped like the operator's (same
probes, a downwardAPI file of one annotation, one GPU, non-root), and waiting on what the real
kubelet reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from vlm_operator.api import crd
from vlm_operator.desired.children import STARTUP_FAILURE_THRESHOLD, STARTUP_PERIOD_SECONDS

from .imagebuild import VLLM_IMAGE
from .node import GPU

T = TypeVar("T")
ANNOTATION = "vlm-testbed/request"
CONTROL_DIR = "/etc/vlm-control"
CONTROL_FILE = "request"


def standin_pod(name: str, labels: dict[str, str] | None = None, gpus: int = 1,
                env: dict[str, str] | None = None) -> dict:
    """The vLLM stand-in with the operator's probe settings (startup every 10 s, readiness
    every 5 s x 3, liveness every 10 s x 6 on /health) and a downwardAPI file of ANNOTATION."""

    def probe(period: int, failures: int) -> dict:
        return {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": period,
                "failureThreshold": failures, "timeoutSeconds": 5}

    env = {"VLM_SIM_STARTUP_SECONDS": "0", "VLM_SIM_STATS_INTERVAL": "0", **(env or {})}
    container = {
        "name": "vllm", "image": VLLM_IMAGE, "imagePullPolicy": "IfNotPresent",
        "command": ["vllm", "serve"], "args": ["org/tiny", "--port", "8000"],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
        "resources": {"limits": {GPU: str(gpus)}} if gpus else {},
        "startupProbe": probe(STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD),
        "readinessProbe": probe(5, 3), "livenessProbe": probe(10, 6),
        "volumeMounts": [{"name": "control", "mountPath": CONTROL_DIR, "readOnly": True}],
    }
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": "standin"},
                     "annotations": {ANNOTATION: "0"}},
        "spec": {
            "containers": [container], "automountServiceAccountToken": False,
            "enableServiceLinks": False, "terminationGracePeriodSeconds": 30,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001},
            "volumes": [{"name": "control", "downwardAPI": {"items": [{
                "path": CONTROL_FILE,
                "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION}']"}}]}}],
        },
    }


def wait_for(what: str, fn: Callable[[], T | None], timeout_s: float, step_s: float = 0.05) -> T:
    """Poll `fn` until it returns something truthy; raise naming `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(step_s)


def is_ready(pod: Any) -> bool:
    return pod.metadata.deletion_timestamp is None and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def events(core: Any, namespace: str, name: str, reason: str) -> list[str]:
    """The messages of the Events of this reason about the object `name` (core: a
    CoreV1Api)."""
    return [e.message for e in core.list_namespaced_event(namespace).items
            if e.reason == reason and e.involved_object.name == name]


def vlmd_status(custom: Any, namespace: str, name: str) -> dict:
    """The status of the VLMDeployment `name` ({} before the operator wrote one; custom: a
    CustomObjectsApi)."""
    return custom.get_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, name).get("status") or {}


def condition(custom: Any, namespace: str, name: str, kind: str) -> dict:
    """The VLMDeployment's condition of type `kind` ({} while it has none)."""
    return next((c for c in vlmd_status(custom, namespace, name).get("conditions") or []
                 if c["type"] == kind), {})


def container_status(pod: Any, name: str = "vllm") -> Any:
    for st in pod.status.container_statuses or []:
        if st.name == name:
            return st
    return None


def running_id(pod: Any) -> str | None:
    """The container id while the container runs, else None."""
    st = container_status(pod)
    return st.container_id if st is not None and st.state.running else None


def endpoint_conditions(custom: Any, namespace: str, ip: str) -> dict | None:
    """The EndpointSlice conditions of the address `ip` ({} without conditions), None when no
    slice holds it. `custom`: a CustomObjectsApi (1.20 serves discovery.k8s.io/v1beta1 only,
    which the Python client no longer has a typed API for)."""
    slices = custom.list_namespaced_custom_object("discovery.k8s.io", "v1beta1", namespace,
                                                  "endpointslices")
    for s in slices.get("items", []):
        for e in s.get("endpoints") or []:
            if ip in (e.get("addresses") or []):
                return dict(e.get("conditions") or {})
    return None
