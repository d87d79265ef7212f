"""A small in-memory fake of the operator's Kube wrapper (k8s/kube.py): the methods the
Remediator and its actors call, over a store of VLMDeployments and pods, recording every call
in order. Reads and writes behave as the apiserver's do where the code depends on it: a patch
with a stale resourceVersion is a 409, a delete of a pod that is gone (or whose uid differs) is
False, merge-patched annotations with None are removed."""

from __future__ import annotations

import copy
import itertools

from kubernetes.client.exceptions import ApiException

from vlm_operator.api import names
from vlm_operator.desired import children

WRITES = ("patch_vlmd_annotations", "patch_vlmd_status", "delete", "patch_pod", "scale_vlmd",
          "post_event")


class FakeKube:
    def __init__(self) -> None:
        self.vlmds: dict[tuple[str, str], dict] = {}
        self.pods: dict[str, list[dict]] = {}  # namespace -> pods
        self.calls: list[tuple] = []
        self.pdb_unhealthy_pod_eviction = False
        self._versions = itertools.count(1)

    # -- the store
    def add_vlmd(self, namespace: str, name: str, *, replicas: int = 1, **spec) -> dict:
        body = {"apiVersion": names.API_VERSION, "kind": names.KIND,
                "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                             "resourceVersion": str(next(self._versions)), "annotations": {}},
                "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2",
                         "replicas": replicas, **spec},
                "status": {}}
        self.vlmds[(namespace, name)] = body
        return body

    def add_pod(self, namespace: str, name: str, *, owner: str, uid: str | None = None,
                ready: bool = True, node: str | None = None) -> dict:
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}",
                            "labels": children.get_labels(owner),
                            "creationTimestamp": "2026-01-01T00:00:00Z"},
               "spec": {"nodeName": node} if node else {},
               "status": {"phase": "Running", "conditions": [
                   {"type": "Ready", "status": "True" if ready else "False",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"}],
                   "containerStatuses": [{"name": children.CONTAINER, "ready": ready,
                                          "restartCount": 0, "state": {"running": {}}}]}}
        self.pods.setdefault(namespace, []).append(pod)
        return pod

    def writes(self) -> list[tuple]:
        """The calls that change something, in order."""
        return [c for c in self.calls if c[0] in WRITES]

    # -- the Kube methods
    def get_vlmd(self, namespace: str, name: str) -> dict | None:
        self.calls.append(("get_vlmd", namespace, name))
        body = self.vlmds.get((namespace, name))
        return copy.deepcopy(body) if body is not None else None

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        self.calls.append(("list_pods", namespace, selector))
        wanted = dict(kv.split("=", 1) for kv in selector.split(","))
        return [copy.deepcopy(p) for p in self.pods.get(namespace, [])
                if wanted.items() <= (p["metadata"].get("labels") or {}).items()]

    def patch_vlmd_annotations(self, namespace: str, name: str,
                               annotations: dict[str, str | None],
                               resource_version: str | None = None) -> dict:
        self.calls.append(("patch_vlmd_annotations", namespace, name, dict(annotations)))
        body = self.vlmds.get((namespace, name))
        if body is None:
            raise ApiException(status=404, reason="Not Found")
        if resource_version and resource_version != body["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        kept = body["metadata"]["annotations"]
        for key, value in annotations.items():
            if value is None:
                kept.pop(key, None)
            else:
                kept[key] = value
        body["metadata"]["resourceVersion"] = str(next(self._versions))
        return copy.deepcopy(body)

    def patch_vlmd_status(self, namespace: str, name: str, status: dict) -> None:
        self.calls.append(("patch_vlmd_status", namespace, name, copy.deepcopy(status)))
        self.vlmds[(namespace, name)]["status"].update(status)

    def delete(self, api_version: str, kind: str, namespace: str, name: str,
               uid: str | None = None, grace_s: int | None = None) -> bool:
        self.calls.append(("delete", kind, namespace, name, grace_s))
        pods = self.pods.get(namespace, [])
        found = next((p for p in pods if p["metadata"]["name"] == name
                      and (uid is None or p["metadata"]["uid"] == uid)), None)
        if found is None:
            return False
        pods.remove(found)
        return True

    def patch_pod(self, namespace: str, name: str, *, labels: dict | None = None,
                  annotations: dict | None = None) -> None:
        self.calls.append(("patch_pod", namespace, name, dict(labels or {})))
        for pod in self.pods.get(namespace, []):
            if pod["metadata"]["name"] == name:
                pod["metadata"]["labels"].update(labels or {})

    def scale_vlmd(self, namespace: str, name: str, replicas: int) -> None:
        self.calls.append(("scale_vlmd", namespace, name, replicas))
        self.vlmds[(namespace, name)]["spec"]["replicas"] = replicas

    def post_event(self, involved: dict, event) -> None:
        self.calls.append(("post_event", involved["kind"], involved["metadata"]["name"],
                           event.reason))
