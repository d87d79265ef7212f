"""Thin Kubernetes actions: server-side apply, reads, status patches and Events.

Everything that talks to the apiserver for the reconciler lives here, so the deciding code stays
pure and this stays small.

No call without a deadline: every request gets CONNECT_TIMEOUT_S to connect and READ_TIMEOUT_S
for each read of the answer, connections carry TCP keepalive and a TCP user timeout (a
connection to an apiserver that vanished, or a frozen one, fails instead of hanging a thread and
the locks it holds), and a request that got no answer is raised as ApiException with status
None, like every other API failure, so callers need one except clause and back off or retry.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from functools import cached_property
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.utils.keepalive import tcp_keepalive_socket_options

from vlm_operator.api import names
from vlm_operator.api.reports import Event
from vlm_operator.k8s.pods import controller_of, rfc3339
from vlm_operator.k8s.views import Body
from vlm_operator.metrics import API_REQUESTS, EVENTS

FIELD_MANAGER = "vlm-operator"
COMPONENT = "vlm-operator"
log = logging.getLogger(__name__)

_PLURALS = {
    "Deployment": "deployments",
    "ReplicaSet": "replicasets",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Pod": "pods",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",
    "InferencePool": "inferencepools",
    names.KIND: names.PLURAL,
}
SERVED_RECHECK_SECONDS = 10  # optional APIs (KEDA, InferencePools) may be installed any time
OWNERS_KEPT = 20_000  # controller references remembered by object uid (a few MB at most)
NO_OWNER_RECHECK_S = 10.0  # an object that could not be read is asked for again after this
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 20.0  # per read: the apiserver answers ordinary requests in milliseconds
REQUEST_TIMEOUT = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
# An idle connection is probed after 30 s and dropped after 3 unanswered probes 10 s apart;
# data sent and never acknowledged fails the connection after 30 s.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3
TCP_USER_TIMEOUT_MS = 30_000


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{_PLURALS[kind]}"
    return f"{path}/{name}" if name else path


def now_iso() -> str:
    return rfc3339(time.time())


def configure_connections(configuration: client.Configuration) -> client.Configuration:
    """Keepalive on every connection, and no retry of a request that was sent: a timeout is
    final (the caller decides), only a failed connect is tried once more."""
    options = tcp_keepalive_socket_options(KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S,
                                           KEEPALIVE_PROBES)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
        options.append((socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS))
    configuration.socket_options = options
    configuration.retries = urllib3.Retry(total=1, read=0, redirect=0, status=0)
    return configuration


def no_answer(exc: BaseException) -> ApiException:
    """A request that got no HTTP answer (refused, reset, timed out), as an ApiException with
    status None."""
    return ApiException(status=None, reason=f"no answer from the apiserver: "
                                            f"{type(exc).__name__}: {exc}")


def call(api: client.ApiClient, method: str, url: str, header_params=None, body=None,
         post_params=None, timeout=None):
    """ApiClient.call_api with a deadline (REQUEST_TIMEOUT unless given), counted in
    vlm_operator_api_requests_total."""
    try:
        response = client.ApiClient.call_api(api, method, url, header_params, body,
                                             post_params,
                                             _request_timeout=timeout or REQUEST_TIMEOUT)
    except ApiException as exc:
        API_REQUESTS.labels(method, str(exc.status)).inc()
        raise
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        API_REQUESTS.labels(method, "none").inc()
        raise no_answer(exc) from exc
    API_REQUESTS.labels(method, str(response.status)).inc()
    return response


def schema_has(openapi_v3: dict, definition: str, field: str) -> bool:
    """Whether an OpenAPI v3 document defines `field` on the schema `definition`."""
    schemas = (openapi_v3.get("components") or {}).get("schemas") or {}
    return field in ((schemas.get(definition) or {}).get("properties") or {})


class ApiClient(client.ApiClient):
    """kubernetes' ApiClient for the operator's own calls outside Kube (the generated API
    classes, log streams): a deadline for every call that brings none, and no answer raised as
    ApiException."""

    def call_api(self, method, url, header_params=None, body=None, post_params=None,
                 _request_timeout=None):
        return call(self, method, url, header_params, body, post_params, _request_timeout)


class Kube:
    """The operator's API calls, on one ApiClient (thread-safe: kopf runs handlers in threads)."""

    def __init__(self, api_client: client.ApiClient):
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self._owners: dict[str, tuple[dict | None, float]] = {}  # uid -> (controller ref, when)
        self._owners_lock = threading.Lock()
        # (apiVersion, resource) -> (served, when asked): optional APIs, see served()
        self._served: dict[tuple[str, str], tuple[bool, float]] = {}

    def _call(self, method: str, path: str, *, body=None, query=None, content_type=None):
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        # kubernetes >= 31 (openapi-generator 7): serialize, call, then raise on non-2xx here
        params = self.api.param_serialize(method, path, query_params=query or [],
                                          header_params=headers, body=body,
                                          auth_settings=["BearerToken"])
        response = call(self.api, *params)
        try:
            response.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # the answer stopped midway
            raise no_answer(exc) from exc
        if not 200 <= response.status <= 299:
            raise ApiException(http_resp=response)
        return json.loads(response.data) if response.data else {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._call("GET", object_path(api_version, kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, obj: dict) -> dict:
        """Server-side apply `obj` (forcing our fields); returns the object after. Callers
        check first that the object is theirs (reconcile/reconciler.py): a forced apply takes over
        any object of that name."""
        meta = Body(obj)
        path = object_path(obj["apiVersion"], obj["kind"], meta.namespace, meta.name)
        return self._call("PATCH", path, body=obj,
                          query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
                          content_type="application/apply-patch+yaml")

    def get_vlmd(self, namespace: str, name: str) -> dict | None:
        return self.get(names.API_VERSION, names.KIND, namespace, name)

    def patch_vlmd_status(self, namespace: str, name: str, status: dict) -> None:
        path = object_path(names.API_VERSION, names.KIND, namespace, name) + "/status"
        self._call("PATCH", path, body={"status": status},
                   content_type="application/merge-patch+json")

    def patch_vlmd_annotations(self, namespace: str, name: str,
                               annotations: dict[str, str | None],
                               resource_version: str | None = None) -> dict:
        """Merge-patch annotations (None removes one); with resource_version, only onto that
        version of the object (409 Conflict otherwise)."""
        meta: dict = {"annotations": annotations}
        if resource_version:
            meta["resourceVersion"] = resource_version
        return self._call("PATCH", object_path(names.API_VERSION, names.KIND, namespace, name),
                          body={"metadata": meta}, content_type="application/merge-patch+json")

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        """The pods `selector` matches that are really ours (owned_pods)."""
        result = self._call("GET", object_path("v1", "Pod", namespace),
                            query=[("labelSelector", selector)])
        return self.owned_pods(result.get("items", []))

    def owned_pods(self, pods: list[dict]) -> list[dict]:
        """The pods whose owner chain leads to the operator: controlled by a ReplicaSet that a
        Deployment controls, which the VLMDeployment of the pod's instance label controls.
        Labels alone prove nothing (anyone who may create pods may copy them), and every action
        on a pod (a canary, a drain, a deletion) starts from these lists. Controller references
        are remembered by uid, so a steady state costs no request."""
        return [pod for pod in pods if self._leads_to_us(pod)]

    def _leads_to_us(self, pod: dict) -> bool:
        meta = Body(pod)
        namespace, name = meta.namespace, meta.labels.get(
            names.INSTANCE_LABEL)
        replicaset = controller_of(pod)
        if not name or not replicaset or replicaset.get("kind") != "ReplicaSet":
            return False
        deployment = self._controller("apps/v1", "ReplicaSet", namespace, replicaset)
        if not deployment or (deployment.get("kind"), deployment.get("name")) != (
                "Deployment", name):
            return False
        owner = self._controller("apps/v1", "Deployment", namespace, deployment)
        return bool(owner) and (owner.get("kind"), owner.get("name")) == (names.KIND, name) \
            and owner.get("apiVersion", "").startswith(names.GROUP + "/")

    def _controller(self, api_version: str, kind: str, namespace: str,
                    ref: dict) -> dict | None:
        """The controller reference of the object `ref` points to (same uid), remembered."""
        uid, now = ref.get("uid", ""), time.monotonic()
        with self._owners_lock:
            known = self._owners.get(uid)
        if known is not None and (known[0] is not None or now - known[1] < NO_OWNER_RECHECK_S):
            return known[0]
        obj = self.get(api_version, kind, namespace, ref.get("name", ""))
        found = (controller_of(obj)
                 if obj is not None and Body(obj).uid == uid else None)
        with self._owners_lock:
            if len(self._owners) >= OWNERS_KEPT:
                self._owners.clear()
            self._owners[uid] = (found, now)
        return found

    @cached_property
    def pdb_api_version(self) -> str:
        """policy/v1 where served (Kubernetes 1.21+), else policy/v1beta1."""
        versions = self._call("GET", "/apis/policy").get("versions", [])
        return "policy/v1" if any(v.get("version") == "v1" for v in versions) \
            else "policy/v1beta1"

    @cached_property
    def pdb_unhealthy_pod_eviction(self) -> bool:
        """Whether the apiserver's PodDisruptionBudget schema has unhealthyPodEvictionPolicy
        (Kubernetes 1.26+), read from its OpenAPI v3 document of policy/v1 (older apiservers
        serve none, or one without the field)."""
        try:
            doc = self._call("GET", "/openapi/v3/apis/policy/v1")
        except ApiException as exc:
            if exc.status in (403, 404, 503):
                return False
            raise
        return schema_has(doc, "io.k8s.api.policy.v1.PodDisruptionBudgetSpec",
                          "unhealthyPodEvictionPolicy")

    @cached_property
    def hpa_api_version(self) -> str:
        """autoscaling/v2 where served (Kubernetes 1.23+), else autoscaling/v2beta2."""
        versions = self._call("GET", "/apis/autoscaling").get("versions", [])
        return "autoscaling/v2" if any(v.get("version") == "v2" for v in versions) \
            else "autoscaling/v2beta2"

    def keda_served(self) -> bool:
        """Whether keda.sh/v1alpha1 ScaledObjects are served."""
        return self.served("keda.sh/v1alpha1", "scaledobjects")

    def inference_pools_served(self) -> bool:
        """Whether inference.networking.k8s.io/v1 InferencePools are served. Asked only for a
        VLMDeployment that wants a pool (or may have dropped one), so a "no" is asked again
        each time: the pass after the CRD is installed makes the pool."""
        return self.served("inference.networking.k8s.io/v1", "inferencepools",
                           recheck_absent=True)

    def served(self, api_version: str, resource: str, recheck_absent: bool = False) -> bool:
        """Whether the apiserver serves `resource` of the optional API `api_version` (a CRD);
        rechecked every SERVED_RECHECK_SECONDS, since it can be installed while the operator
        runs (`recheck_absent`: a "no" is not kept at all). Only a 404 means not served: any
        other failure is raised (unknown is not no)."""
        now = time.monotonic()
        cached = self._served.get((api_version, resource))
        if cached is None or now - cached[1] > SERVED_RECHECK_SECONDS or (
                recheck_absent and not cached[0]):
            try:
                resources = self._call("GET", f"/apis/{api_version}").get("resources", [])
                found = any(r.get("name") == resource for r in resources)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                found = False
            cached = self._served[(api_version, resource)] = (found, now)
        return cached[0]

    def delete(self, api_version: str, kind: str, namespace: str, name: str,
               uid: str | None = None, grace_s: int | None = None) -> bool:
        """Delete an object (only the one with `uid` when given; a pod with `grace_s` seconds
        to stop instead of its own terminationGracePeriodSeconds); False when it did not exist
        (or was replaced by another of the same name)."""
        body: dict | None = {"preconditions": {"uid": uid}} if uid else None
        if grace_s is not None:
            body = {**(body or {}), "gracePeriodSeconds": int(grace_s)}
        try:
            self._call("DELETE", object_path(api_version, kind, namespace, name), body=body)
        except ApiException as exc:
            if exc.status == 404 or (uid and exc.status == 409):
                return False
            raise
        return True

    def list_cluster(self, path: str, selector: str | None = None) -> list[dict]:
        """Items of a cluster-wide list, e.g. /apis/scheduling.k8s.io/v1/priorityclasses."""
        query = [("labelSelector", selector)] if selector else []
        return self._call("GET", path, query=query).get("items", [])

    def list_page(self, path: str, query: list[tuple[str, str]]) -> dict:
        """One page of a LIST (items, metadata.continue, metadata.resourceVersion)."""
        return self._call("GET", path, query=query)

    def watch(self, path: str, query: list[tuple[str, str]], read_timeout_s: float):
        """Open a WATCH (query carries watch=true); the raw urllib3 response, whose stream
        gives newline-separated JSON events. A read that waits read_timeout_s raises."""
        params = self.api.param_serialize("GET", path, query_params=query,
                                          header_params={"Accept": "application/json"},
                                          auth_settings=["BearerToken"])
        response = call(self.api, *params, timeout=(CONNECT_TIMEOUT_S, read_timeout_s))
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException(http_resp=response)
        return response.response

    def patch_pod(self, namespace: str, name: str, *, labels: dict | None = None,
                  annotations: dict | None = None) -> None:
        """Merge-patch a pod's labels and annotations (a None value removes one)."""
        meta = {k: v for k, v in (("labels", labels), ("annotations", annotations)) if v}
        self._call("PATCH", object_path("v1", "Pod", namespace, name), body={"metadata": meta},
                   content_type="application/merge-patch+json")

    def scale_vlmd(self, namespace: str, name: str, replicas: int) -> None:
        """Write spec.replicas through the scale subresource, as HPA and kubectl scale do."""
        path = object_path(names.API_VERSION, names.KIND, namespace, name) + "/scale"
        self._call("PATCH", path, body={"spec": {"replicas": replicas}},
                   content_type="application/merge-patch+json")

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
            EVENTS.labels(type=event.type, reason=event.reason).inc()
        except ApiException as exc:
            log.warning("could not post event %s on %s: %s", event.reason, meta["name"],
                        exc.reason)


# Secret metadata only: the operator never holds a Secret's data, even with `get` on Secrets.
_METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


def priority_value(api: Any, name: str) -> int | None:
    """A PriorityClass's value (None: no such PriorityClass)."""
    try:
        return int(client.SchedulingV1Api(api).read_priority_class(name).value)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def secret_labels(api: Any, namespace: str, name: str) -> dict[str, str] | None:
    """A Secret's labels (None: no such Secret), read as metadata only."""
    try:
        response = client.CoreV1Api(api).read_namespaced_secret(
            name, namespace, _preload_content=False, _headers={"Accept": _METADATA_ONLY})
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return json.loads(response.data).get("metadata", {}).get("labels") or {}
