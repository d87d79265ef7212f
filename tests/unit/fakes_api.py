"""In-memory stand-ins for what the round's actors read and call: the watch-fed pod cache
(k8s/caches.ClusterCache), the /metrics scraper and the pod HTTP calls (engine/reader.py), a
controllable clock, and recording fakes of the parts a round hands its readings to (stall watch,
autoscaler, remediator). Shared by the unit tests of runtime/rounds.py and stalls/watch.py.

Every fake records its calls in `calls` as (method, args...) tuples so a test can say exactly
what the glue did, and nothing else."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vlm_operator.api import names
from vlm_operator.desired.children import get_selector_labels
from vlm_operator.engine import reader

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
                         "labels": dict(get_selector_labels(owner)),
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
        return bool(self._selected(namespace, get_selector_labels(name)))


class FakeScraper:
    """engine/reader.Scraper: each pod's reading from `readings` (pod name -> Scrape, or a
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
    """engine/reader's calls to a pod (the canary, /health) answered from a script, in
    place of HTTP: `install(monkeypatch)` puts it in."""

    def __init__(self, canary: str = reader.ANSWERED, health: str | None = None) -> None:
        self.canary_result = canary
        self.health_result = health
        self.calls: list[tuple] = []

    def install(self, monkeypatch) -> FakePodHTTP:
        monkeypatch.setattr(reader, "canary", self.canary)
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

    def _post(self, namespace: str, name: str, pod: dict | None, event, body=None) -> None:
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
