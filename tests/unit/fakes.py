"""In-memory fakes the actors' unit tests share, each recording its calls in order so a test
can say exactly what the glue did:
- FakeKube, of the operator's Kube wrapper (k8s/kube.py): the methods the Remediator and its
  actors call, over a store of VLMDeployments and pods. Reads and writes behave as the
  apiserver's do where the code depends on it: a patch with a stale resourceVersion is a 409, a
  delete of a pod that is gone (or whose uid differs) is False, merge-patched annotations with
  None are removed.
- ChildStore, FakeKube plus the children the reconciler applies.
- what a round reads and calls (runtime/rounds.py, stalls/watch.py): the watch-fed pod cache
  (k8s/caches.ClusterCache), the /metrics scraper and the pod HTTP calls (podreads/reader.py,
  podreads/canary.py), a controllable clock, and recording fakes of the parts a round hands its
  readings to (stall watch, autoscaler, remediator)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable

from kubernetes.client.exceptions import ApiException

from vlm_operator.api import names
from vlm_operator.desired import children
from vlm_operator.podreads import canary, reader

WRITES = ("patch_vlmd_annotations", "patch_vlmd_status", "delete", "patch_pod", "scale_vlmd",
          "post_event")


class FakeKube:
    def __init__(self) -> None:
        self.vlmds: dict[tuple[str, str], dict] = {}
        self.pods: dict[str, list[dict]] = {}  # namespace -> pods
        self.calls: list[tuple] = []
        self.pdb_unhealthy_pod_eviction = False
        # replicas a VLMDeployment's Deployment status counts, where a test sets it; else its
        # active pods (the kube-controller-manager keeping up)
        self.counted: dict[tuple[str, str], int] = {}
        # uids of pods labelled like ours whose owner chain does not lead to the operator:
        # list_pods leaves them out, as Kube.list_pods does (owned_pods)
        self.foreign: set[str] = set()
        self.messages: list[tuple[str, str, str]] = []  # Events posted: kind, reason, message
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
                ready: bool = True, node: str | None = None, owned: bool = True) -> dict:
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
        if not owned:
            self.foreign.add(pod["metadata"]["uid"])
        return pod

    def writes(self) -> list[tuple]:
        """The calls that change something, in order."""
        return [c for c in self.calls if c[0] in WRITES]

    # -- the Kube methods
    def get_vlmd(self, namespace: str, name: str) -> dict | None:
        self.calls.append(("get_vlmd", namespace, name))
        body = self.vlmds.get((namespace, name))
        return copy.deepcopy(body) if body is not None else None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        """A VLMDeployment's Deployment (the only object the actors read this way)."""
        self.calls.append(("get", kind, namespace, name))
        body = self.vlmds.get((namespace, name))
        if kind != "Deployment" or body is None:
            return None
        active = sum(1 for p in self.pods.get(namespace, [])
                     if p["metadata"]["labels"].get(names.INSTANCE_LABEL) == name
                     and not p["metadata"].get("deletionTimestamp")
                     and p["metadata"]["uid"] not in self.foreign)
        return {"apiVersion": api_version, "kind": kind,
                "metadata": {"name": name, "namespace": namespace, "generation": 2,
                             "ownerReferences": [{"kind": names.KIND, "name": name,
                                                  "uid": body["metadata"]["uid"],
                                                  "controller": True}]},
                "status": {"observedGeneration": 2,
                           "replicas": self.counted.get((namespace, name), active)}}

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        self.calls.append(("list_pods", namespace, selector))
        wanted = dict(kv.split("=", 1) for kv in selector.split(","))
        return [copy.deepcopy(p) for p in self.pods.get(namespace, [])
                if wanted.items() <= (p["metadata"].get("labels") or {}).items()
                and p["metadata"]["uid"] not in self.foreign]

    def owned_pods(self, pods: list[dict]) -> list[dict]:
        """Kube.owned_pods (the owner chain, tested in test_kube.py): every pod but `foreign`."""
        return [p for p in pods if p["metadata"]["uid"] not in self.foreign]

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
                kept = pod["metadata"].setdefault("annotations", {})
                for key, value in (annotations or {}).items():  # merge patch: None removes
                    if value is None:
                        kept.pop(key, None)
                    else:
                        kept[key] = value

    def scale_vlmd(self, namespace: str, name: str, replicas: int) -> None:
        self.calls.append(("scale_vlmd", namespace, name, replicas))
        self.vlmds[(namespace, name)]["spec"]["replicas"] = replicas

    def post_event(self, involved: dict, event) -> None:
        self.calls.append(("post_event", involved["kind"], involved["metadata"]["name"],
                           event.reason))
        self.messages.append((involved["kind"], event.reason, event.message))


class ChildStore(FakeKube):
    """FakeKube plus the children: what the reconciler applies is kept and read back (the
    Deployment read as FakeKube makes it)."""

    hpa_api_version = "autoscaling/v2"
    pdb_api_version = "policy/v1"

    def __init__(self, pools_served: bool | None = True) -> None:
        super().__init__()
        self.children: dict[tuple[str, str], dict] = {}
        self.pools_served = pools_served  # None: discovery fails (503)

    def keda_served(self) -> bool:
        return False

    def inference_pools_served(self) -> bool:
        self.calls.append(("discovery", "inferencepools"))
        if self.pools_served is None:
            raise ApiException(status=503, reason="Service Unavailable")
        return self.pools_served

    def get(self, api_version, kind, namespace, name):
        if kind == "Deployment":
            return super().get(api_version, kind, namespace, name)
        self.calls.append(("get", kind, namespace, name))
        return copy.deepcopy(self.children.get((kind, name)))

    def apply(self, obj):
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"]))
        self.children[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)
        return copy.deepcopy(obj)

    def delete(self, api_version, kind, namespace, name, uid=None, grace_s=None):
        self.calls.append(("delete", kind, namespace, name, grace_s))
        return self.children.pop((kind, name), None) is not None


NAMESPACE = "team"


def vlmd_body(name: str = "vl", namespace: str = NAMESPACE, **spec) -> dict:
    """A VLMDeployment as runtime/periodic.py hands it to a round (a plain dict)."""
    return {"apiVersion": names.API_VERSION, "kind": names.KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                         "generation": 1, "resourceVersion": "1", "annotations": {}},
            "spec": {"model": "org/model", **spec}}


def pod(name: str, owner: str = "vl", namespace: str = NAMESPACE, *, ready: bool = True,
        running: bool = True, ip: str | None = "10.0.0.1", restarts: int = 0) -> dict:
    """A pod of VLMDeployment `owner`, labelled as the operator labels them."""
    state = {"running": {"startedAt": "2026-01-01T00:00:00Z"}} if running else {
        "waiting": {"reason": "ContainerCreating"}}
    status: dict = {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": names.CONTAINER, "restartCount": restarts,
                               "ready": ready, "started": running, "state": state}],
    }
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                         "labels": dict(children.get_selector_labels(owner)),
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"nodeName": "node-1"},
            "status": status}


def counters(generated: float, prompt: float = 0.0, done: float = 0.0) -> reader.Scrape:
    """A /metrics reading with the progress counters stall detection reads."""
    return reader.Scrape(values={"vllm:generation_tokens_total": generated,
                                 "vllm:prompt_tokens_total": prompt,
                                 "vllm:request_success_total": done})


class Clock:
    """Wall-clock time the tests move by hand; `time()` as the time module has it."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class FakeClusterCache:
    """k8s/caches.ClusterCache as a round reads it: pods by label selector, and whether a
    VLMDeployment has any (None: the cache cannot say yet)."""

    def __init__(self, pods: Iterable[dict] = ()) -> None:
        self.pods = list(pods)
        self.unknown: set[tuple[str, str]] = set()  # VLMDeployments the cache cannot vouch for
        self.calls: list[tuple] = []

    def _selected(self, namespace: str, labels: dict[str, str]) -> list[dict]:
        return [p for p in self.pods if p["metadata"]["namespace"] == namespace and all(
            (p["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())]

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        self.calls.append(("list_pods", namespace, selector))
        labels = dict(part.split("=", 1) for part in selector.split(","))
        return self._selected(namespace, labels)

    def has_pods(self, namespace: str, name: str) -> bool | None:
        self.calls.append(("has_pods", namespace, name))
        if (namespace, name) in self.unknown:
            return None
        return bool(self._selected(namespace, children.get_selector_labels(name)))


class FakeScraper:
    """podreads/reader.Scraper: each pod's reading from `readings` (pod name -> Scrape, or a
    function of the pod name); a pod with none reads as unreachable."""

    def __init__(self, readings: dict[str, reader.Scrape] | Callable[[str], reader.Scrape]
                 | None = None) -> None:
        self.readings = readings if readings is not None else {}
        self.calls: list[tuple] = []

    def scrape(self, owner: tuple[str, str], pods: list[dict],
               metric_names: Iterable[str]) -> dict[str, reader.Scrape]:
        pod_names = [p["metadata"]["name"] for p in pods]
        self.calls.append(("scrape", owner, tuple(pod_names), frozenset(metric_names)))
        out = {}
        for name in pod_names:
            if callable(self.readings):
                out[name] = self.readings(name)
            else:
                out[name] = self.readings.get(name, reader.Scrape(error="unreachable"))
        return out


class FakePodHTTP:
    """The stall watch's calls to a pod (podreads/canary.send, podreads/reader.health) answered
    from a script, in place of HTTP: `install(monkeypatch)` puts it in."""

    def __init__(self, canary: str = canary.ANSWERED, health: str | None = None) -> None:
        self.canary_result = canary
        self.health_result = health
        self.calls: list[tuple] = []

    def install(self, monkeypatch) -> FakePodHTTP:
        monkeypatch.setattr(canary, "send", self.canary)
        monkeypatch.setattr(reader, "health", self.health)
        return self

    def canary(self, ip: str, timeout_s: float, request_id: str) -> str:
        self.calls.append(("canary", ip))
        return self.canary_result

    def health(self, ip: str | None, timeout_s: float = 1.0) -> str | None:
        self.calls.append(("health", ip))
        return self.health_result

    def count(self, what: str) -> int:
        return sum(1 for call in self.calls if call[0] == what)


class RecordingRemediator:
    """What stall detection and the rounds call on remediation/remediator.Remediator,
    recorded and nothing done."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def report(self, namespace: str, name: str, *, uid: str, pod: str, signature: str,
               t: float, count: Callable[[str, float], int], detail: str = "") -> None:
        self.calls.append(("report", namespace, name, pod, signature, t))

    def reconcile(self, namespace: str, name: str) -> None:
        self.calls.append(("reconcile", namespace, name))

    def post_event(self, namespace: str, name: str, pod: dict | None, event, body=None) -> None:
        self.calls.append(("event", namespace, name, event.reason))

    def round(self, body: dict, pods: list[dict]) -> None:
        self.calls.append(("round", body["metadata"]["name"],
                           tuple(p["metadata"]["name"] for p in pods)))

    def reports(self, what: str | None = None) -> list[tuple]:
        """The detections reported, (namespace, name, pod, signature, t) each."""
        return [c[1:] for c in self.calls if c[0] == "report" and what in (None, c[4])]


class RecordingStallWatch:
    """stalls/watch.StallWatch as the rounds call it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def observe(self, vlmd, pods: list[dict], scrapes: dict[str, reader.Scrape]) -> None:
        self.calls.append(("observe", vlmd.name, tuple(p["metadata"]["name"] for p in pods),
                           tuple(sorted(scrapes))))

    def forget(self, namespace: str, name: str) -> None:
        self.calls.append(("forget", namespace, name))


class RecordingAutoscaler:
    """autoscaling/autoscaler.Autoscaler as the rounds call it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def tick(self, body: dict, pods: list[dict], scrapes: dict[str, reader.Scrape]) -> None:
        self.calls.append(("tick", body["metadata"]["name"],
                           tuple(p["metadata"]["name"] for p in pods), tuple(sorted(scrapes))))

    def forget(self, namespace: str, name: str) -> None:
        self.calls.append(("forget", namespace, name))
