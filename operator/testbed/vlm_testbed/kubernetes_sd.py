"""Prometheus' Kubernetes service discovery for the test bed, served as HTTP SD.

Debian's prometheus is built without `kubernetes_sd_configs`, so the test bed's Prometheus gets
its targets from this server (`http_sd_configs`) instead: for the roles `pod` and
`endpointslice` it answers with the targets and `__meta_kubernetes_*` labels Prometheus' own
discovery gives the same objects (discovery/kubernetes/pod.go and endpointslice.go, 2.42), read
from the apiserver at each request, so the Prometheus Operator's relabelling runs unchanged on
them. `with_http_sd` swaps a generated job's Kubernetes discovery for this server.
"""

from __future__ import annotations

import http.server
import json
import re
import sys
import threading
import urllib.parse
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

META = "__meta_kubernetes_"


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _object_labels(prefix: str, meta: dict) -> dict[str, str]:
    """<prefix>_label_*, _labelpresent_*, _annotation_*, _annotationpresent_* of an object."""
    out = {}
    for kind, values in (("label", meta.get("labels")), ("annotation", meta.get("annotations"))):
        for key, value in (values or {}).items():
            out[f"{prefix}_{kind}_{_sanitize(key)}"] = value
            out[f"{prefix}_{kind}present_{_sanitize(key)}"] = "true"
    return out


def _ready(pod: dict) -> str:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status", "unknown").lower()
    return "unknown"


def pod_labels(pod: dict) -> dict[str, str]:
    """The labels every target of a pod carries."""
    meta, status = pod["metadata"], pod.get("status") or {}
    out = {f"{META}namespace": meta["namespace"], f"{META}pod_name": meta["name"],
           f"{META}pod_ip": status.get("podIP", ""), f"{META}pod_ready": _ready(pod),
           f"{META}pod_phase": status.get("phase", ""),
           f"{META}pod_node_name": (pod.get("spec") or {}).get("nodeName", ""),
           f"{META}pod_host_ip": status.get("hostIP", ""), f"{META}pod_uid": meta.get("uid", ""),
           **_object_labels(f"{META}pod", meta)}
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    if owner:
        out[f"{META}pod_controller_kind"] = owner["kind"]
        out[f"{META}pod_controller_name"] = owner["name"]
    return out


def _container_labels(pod: dict, container: dict, init: bool) -> dict[str, str]:
    statuses = (pod.get("status") or {}).get(
        "initContainerStatuses" if init else "containerStatuses") or []
    cid = next((s.get("containerID", "") for s in statuses
                if s.get("name") == container["name"]), "")
    return {f"{META}pod_container_name": container["name"],
            f"{META}pod_container_image": container.get("image", ""),
            f"{META}pod_container_init": str(init).lower(),
            f"{META}pod_container_id": cid or ""}


def _port_labels(port: dict) -> dict[str, str]:
    return {f"{META}pod_container_port_name": port.get("name", ""),
            f"{META}pod_container_port_number": str(port["containerPort"]),
            f"{META}pod_container_port_protocol": port.get("protocol", "TCP")}


def _containers(pod: dict):
    spec = pod.get("spec") or {}
    for init, key in ((False, "containers"), (True, "initContainers")):
        for container in spec.get(key) or []:
            yield container, init


def pod_targets(pod: dict) -> list[dict]:
    """Role pod: one target per container port (podIP:port), one per portless container."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return []
    base, out = pod_labels(pod), []
    for container, init in _containers(pod):
        labels = {**base, **_container_labels(pod, container, init)}
        ports = container.get("ports") or []
        for port in ports:
            out.append({"__address__": f"{ip}:{port['containerPort']}", **labels,
                        **_port_labels(port)})
        if not ports:
            out.append({"__address__": ip, **labels})
    return out


def endpointslice_targets(eps: dict, service: dict | None,
                          pods: dict[str, dict]) -> list[dict]:
    """Role endpointslice: one target per endpoint address and port, with the Service's and
    the target pod's labels; then the target pods' container ports no endpoint covers."""
    meta = eps["metadata"]
    base = {f"{META}namespace": meta["namespace"], f"{META}endpointslice_name": meta["name"],
            f"{META}endpointslice_address_type": eps.get("addressType", ""),
            **_object_labels(f"{META}endpointslice", meta)}
    if service is not None:
        base[f"{META}service_name"] = service["metadata"]["name"]
        base.update(_object_labels(f"{META}service", service["metadata"]))
    out, seen = [], {}
    for endpoint in eps.get("endpoints") or []:
        ref = endpoint.get("targetRef") or {}
        pod = pods.get(ref.get("name", "")) if ref.get("kind") == "Pod" else None
        ep_labels = {}
        for cond, value in (endpoint.get("conditions") or {}).items():
            if value is not None:
                ep_labels[f"{META}endpointslice_endpoint_conditions_{_sanitize(cond)}"] = \
                    str(value).lower()
        if endpoint.get("hostname"):
            ep_labels[f"{META}endpointslice_endpoint_hostname"] = endpoint["hostname"]
        for key, value in (endpoint.get("topology") or {}).items():
            ep_labels[f"{META}endpointslice_endpoint_topology_{_sanitize(key)}"] = value
            ep_labels[f"{META}endpointslice_endpoint_topology_present_{_sanitize(key)}"] = "true"
        if ref:
            ep_labels[f"{META}endpointslice_address_target_kind"] = ref.get("kind", "")
            ep_labels[f"{META}endpointslice_address_target_name"] = ref.get("name", "")
        for address in endpoint.get("addresses") or []:
            for port in eps.get("ports") or []:
                target = {"__address__": f"{address}:{port['port']}", **base, **ep_labels,
                          f"{META}endpointslice_port": str(port["port"]),
                          f"{META}endpointslice_port_name": port.get("name") or "",
                          f"{META}endpointslice_port_protocol": port.get("protocol", "TCP")}
                if port.get("appProtocol"):
                    target[f"{META}endpointslice_port_app_protocol"] = port["appProtocol"]
                if pod is not None:
                    target.update(pod_labels(pod))
                    covered = seen.setdefault(pod["metadata"]["name"], set())
                    for container, init in _containers(pod):
                        for cport in container.get("ports") or []:
                            if cport["containerPort"] == port["port"]:
                                target.update(_container_labels(pod, container, init))
                                target.update(_port_labels(cport))
                                covered.add((container["name"], cport["containerPort"]))
                out.append(target)
    for name, covered in seen.items():
        pod = pods[name]
        ip = pod["status"]["podIP"]
        for container, init in _containers(pod):
            for cport in container.get("ports") or []:
                if (container["name"], cport["containerPort"]) not in covered:
                    out.append({"__address__": f"{ip}:{cport['containerPort']}", **base,
                                **pod_labels(pod), **_container_labels(pod, container, init),
                                **_port_labels(cport)})
    return out


def with_http_sd(jobs: list[dict], sd_url: str, refresh: str = "1s") -> list[dict]:
    """The jobs with each kubernetes_sd_config replaced by this server's URL for its role and
    namespaces."""
    out = []
    for job in jobs:
        job = dict(job)
        configs = job.pop("kubernetes_sd_configs", [])
        if configs:
            job["http_sd_configs"] = [{
                "url": f"{sd_url}/{c['role']}?" + urllib.parse.urlencode(
                    [("namespace", n) for n in (c.get("namespaces") or {}).get("names", [])]),
                "refresh_interval": refresh} for c in configs]
        out.append(job)
    return out


class KubernetesSD(http.server.ThreadingHTTPServer):
    """GET /pod or /endpointslice [?namespace=...] -> HTTP SD target groups, from the
    apiserver. A context manager serving on a loopback port."""

    daemon_threads = True

    def __init__(self, api_client: Any) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.api = api_client
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._slice_version: str | None = None

    def __enter__(self) -> KubernetesSD:
        threading.Thread(target=self.serve_forever, daemon=True, name="kubernetes-sd").start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()

    def handle_error(self, request, client_address) -> None:
        """Prometheus hanging up on a slow answer (its scrape timeout) is not an error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def _list(self, kind: str, namespaces: list[str]) -> list[dict]:
        core, sanitize = client.CoreV1Api(self.api), self.api.sanitize_for_serialization
        if kind == "endpointslices":
            custom = client.CustomObjectsApi(self.api)
            version = self.slice_version()
            if not namespaces:
                return custom.list_cluster_custom_object("discovery.k8s.io", version,
                                                         kind)["items"]
            return [i for n in namespaces for i in custom.list_namespaced_custom_object(
                "discovery.k8s.io", version, n, kind)["items"]]
        if not namespaces:
            return sanitize(getattr(core, f"list_{kind}_for_all_namespaces")().items)
        return [i for n in namespaces
                for i in sanitize(getattr(core, f"list_namespaced_{kind}")(n).items)]

    def slice_version(self) -> str:
        """discovery.k8s.io/v1 from Kubernetes 1.21, v1beta1 before (the test bed's 1.20)."""
        if self._slice_version is None:
            groups = client.ApisApi(self.api).get_api_versions().groups
            served = {v.version for g in groups if g.name == "discovery.k8s.io"
                      for v in g.versions}
            self._slice_version = "v1" if "v1" in served else "v1beta1"
        return self._slice_version

    def targets(self, role: str, namespaces: list[str]) -> list[dict]:
        pods = self._list("pod", namespaces)
        if role == "pod":
            return [t for p in pods for t in pod_targets(p)]
        if role != "endpointslice":
            raise ValueError(f"role {role!r} is not served")
        by_name = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        services = {(s["metadata"]["namespace"], s["metadata"]["name"]): s
                    for s in self._list("service", namespaces)}
        out = []
        for eps in self._list("endpointslices", namespaces):
            ns = eps["metadata"]["namespace"]
            service = services.get(
                (ns, (eps["metadata"].get("labels") or {}).get("kubernetes.io/service-name")))
            out += endpointslice_targets(
                eps, service, {n: p for (pns, n), p in by_name.items() if pns == ns})
        return out


class _Handler(http.server.BaseHTTPRequestHandler):
    server: KubernetesSD

    def log_message(self, *args) -> None:
        """Quiet: Prometheus asks every second."""

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        namespaces = urllib.parse.parse_qs(url.query).get("namespace", [])
        try:
            targets = self.server.targets(url.path.strip("/"), namespaces)
        except (ApiException, ValueError) as exc:
            self.send_error(500, str(exc))
            return
        body = json.dumps([{"targets": [t.pop("__address__")], "labels": t}
                           for t in targets]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
