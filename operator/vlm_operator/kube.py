"""Thin Kubernetes actions: server-side apply, reads, status patches and Events.

Everything that talks to the apiserver for the reconciler lives here, so the deciding code stays
pure and this stays small.
"""

from __future__ import annotations

import datetime as dt
import logging
from functools import cached_property

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from vlm_operator import crd
from vlm_operator.status import Event

FIELD_MANAGER = "vlm-operator"
COMPONENT = "vlm-operator"
log = logging.getLogger(__name__)

_PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Pod": "pods",
    crd.KIND: crd.PLURAL,
}


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{_PLURALS[kind]}"
    return f"{path}/{name}" if name else path


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kube:
    """The operator's API calls, on one ApiClient (thread-safe: kopf runs handlers in threads)."""

    def __init__(self, api_client: client.ApiClient):
        self.api = api_client
        self.core = client.CoreV1Api(api_client)

    def _call(self, method: str, path: str, *, body=None, query=None, content_type=None):
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        return self.api.call_api(
            path, method, query_params=query or [], header_params=headers, body=body,
            response_type="object", auth_settings=["BearerToken"],
            _return_http_data_only=True, _preload_content=True)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._call("GET", object_path(api_version, kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, obj: dict) -> tuple[dict | None, dict]:
        """Server-side apply `obj`; returns (object before, object after)."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        before = self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        after = self._call("PATCH", path, body=obj,
                           query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
                           content_type="application/apply-patch+yaml")
        return before, after

    def get_vlmd(self, namespace: str, name: str) -> dict | None:
        return self.get(crd.API_VERSION, crd.KIND, namespace, name)

    def patch_vlmd_status(self, namespace: str, name: str, status: dict) -> None:
        path = object_path(crd.API_VERSION, crd.KIND, namespace, name) + "/status"
        self._call("PATCH", path, body={"status": status},
                   content_type="application/merge-patch+json")

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        result = self._call("GET", object_path("v1", "Pod", namespace),
                            query=[("labelSelector", selector)])
        return result.get("items", [])

    @cached_property
    def pdb_api_version(self) -> str:
        """policy/v1 where served (Kubernetes 1.21+), else policy/v1beta1."""
        versions = self._call("GET", "/apis/policy").get("versions", [])
        return "policy/v1" if any(v.get("version") == "v1" for v in versions) \
            else "policy/v1beta1"

    def post_event(self, involved: dict, event: Event) -> None:
        """Record an Event on `involved`; a failure to post is logged, never raised."""
        meta = involved["metadata"]
        stamp = now_iso()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": involved["apiVersion"], "kind": involved["kind"],
                               "name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta.get("uid")},
            "type": event.type, "reason": event.reason, "message": event.message[:1024],
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        try:
            self._call("POST", f"/api/v1/namespaces/{meta['namespace']}/events", body=body)
        except ApiException as exc:
            log.warning("could not post event %s on %s: %s", event.reason, meta["name"],
                        exc.reason)
