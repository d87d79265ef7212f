"""Watch-fed caches (informer-style) of what the operator reads across the cluster.

- Nodes, as the GPU budget sees them (k8s/nodes.py, Node: readiness, labels, taints, extended
  resources) and whether they are leaving (a drain, the cluster autoscaler, Karpenter), and
  the pods bound to them that hold extended resources such as GPUs (PodUse): the
  GPU budget of the Builtin autoscaler and of surge replacements, and the node drains every
  round looks for. With them, the managed pods no node holds yet (what the GPUs left Pending
  for a node autoscaler are counted from; only those whose owner chain leads to the operator).
- The managed vLLM pods, for every VLMDeployment's once-a-second round (runtime/rounds.py):
  only pods whose owner chain leads to a VLMDeployment (Kube.owned_pods), in the small form
  of pods.kept_pod.

Each cache is one paged LIST, then a WATCH from the list's resourceVersion, which the apiserver
ends after WATCH_S and which is resumed from the last resourceVersion seen (bookmarks keep it
recent). An apiserver that has forgotten that version (410 Gone) brings a fresh LIST, and so
does RELIST_S, a safety net. So the steady state costs one request per cache per WATCH_S,
whatever the cluster's size, and each object is kept in a small form.

Unknown is not zero: a cache that has not listed yet, or whose watch has been failing for
STALE_S, raises Stale instead of answering from old data. Where RBAC grants list but not watch,
a cache lists every POLL_S instead, and says so once.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException

from vlm_operator.api.names import INSTANCE_LABEL
from vlm_operator.k8s.kube import Kube
from vlm_operator.k8s.nodes import (
    Leaving,
    Marker,
    Node,
    PodUse,
    free_by_node,
    node_state,
    pending_use,
    pod_use,
)
from vlm_operator.k8s.pods import kept_pod
from vlm_operator.metrics import CACHE_LISTS, CACHE_OBJECTS

log = logging.getLogger(__name__)

WATCH_S = 60  # the apiserver ends each watch after this (timeoutSeconds); resumed at once
WATCH_GRACE_S = 30  # no byte for WATCH_S + this: the connection is dead
RELIST_S = 15 * 60
STALE_S = 60.0
POLL_S = 10.0
SYNC_WAIT_S = 5.0  # a first read waits this long for the first LIST
PAGE = 500
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 10.0
IDLE_S = 600.0  # a namespace's managed-pod cache nobody asked for this long is stopped
MANAGED = "app.kubernetes.io/managed-by=vlm-operator"
BOUND_AND_RUNNING = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
UNBOUND = "spec.nodeName=,status.phase=Pending"


class Stale(RuntimeError):
    """The cache cannot say what the cluster holds now."""


class Gone(Exception):
    """The apiserver no longer has the resourceVersion the watch resumes from."""


class Watchdog(Protocol):
    """Where a loop says it completed a round (runtime/watchdog.py's Watchdog, which runner.py
    passes in)."""

    def beat(self, name: str, period_s: float) -> None: ...

    def forget(self, name: str) -> None: ...


class _Unwatched:
    """No watchdog: the rounds go unreported."""

    def beat(self, name: str, period_s: float) -> None:
        pass

    def forget(self, name: str) -> None:
        pass


class Informer:
    """One resource (LIST + WATCH) kept in memory: key -> keep(object), keep returning None for
    objects not worth holding. `index(value)` files values under keys for `indexed`."""

    def __init__(self, kube: Kube, name: str, path: str, keep: Callable[[dict], Any],
                 query: tuple[tuple[str, str], ...] = (),
                 index: Callable[[Any], Any] | None = None,
                 watchdog: Watchdog | None = None) -> None:
        self.kube, self.name, self.path, self.query = kube, name, path, list(query)
        self._keep, self._index = keep, index
        self._watchdog = watchdog or _Unwatched()
        self._lock = threading.Lock()
        self._items: dict[str, Any] = {}
        self._by: dict[Any, dict[str, Any]] = {}
        self._rv: str | None = None
        self._listed_at: float | None = None  # monotonic time of the last full LIST
        self._failing_since: float | None = None
        self._error = "not listed yet"
        self._poll = False  # watch not permitted: LIST every POLL_S
        self._synced = threading.Event()
        self._stop = threading.Event()
        self.used_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"cache {name}")

    def start(self) -> Informer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._watchdog.forget(f"cache {self.name}")

    # -- reads
    def _fresh(self, wait: bool = True) -> None:
        self.used_at = time.monotonic()
        if not self._synced.is_set() and wait:
            self._synced.wait(SYNC_WAIT_S)
        with self._lock:
            failing = self._failing_since
            if self._listed_at is None or (
                    failing is not None and time.monotonic() - failing > STALE_S):
                raise Stale(f"the {self.name} cache is not current: {self._error}")

    def values(self) -> list[Any]:
        self._fresh()
        with self._lock:
            return list(self._items.values())

    def indexed(self, key: Any, wait: bool = True) -> list[Any]:
        """The values filed under key; wait=False: raise Stale at once, rather than wait for
        the first LIST, when it has not come yet."""
        self._fresh(wait)
        with self._lock:
            return list(self._by.get(key, {}).values())

    # -- the loop
    def _run(self) -> None:
        delay = BACKOFF_MIN_S
        while not self._stop.is_set():
            try:
                if self._rv is None or time.monotonic() - (self._listed_at or 0) > RELIST_S:
                    self._list()
                if self._poll:
                    self._stop.wait(POLL_S)
                    self._rv = None
                else:
                    self._watch()
                delay = BACKOFF_MIN_S
            except Gone:
                self._rv = None
            except ApiException as exc:
                if exc.status == 403 and self._rv is not None and not self._poll:
                    log.warning("%s cache: watch not permitted (%s); listing every %g s "
                                "instead: grant watch on it", self.name, exc.reason, POLL_S)
                    self._poll = True
                    continue
                self._failed(f"{exc.status} {exc.reason}")
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
            except Exception as exc:  # a broken stream, a bad event: never end the loop
                self._failed(f"{type(exc).__name__}: {exc}")
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
            finally:
                if not self._stop.is_set():
                    self._watchdog.beat(f"cache {self.name}", WATCH_S + WATCH_GRACE_S)

    def _failed(self, why: str) -> None:
        with self._lock:
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                log.warning("%s cache: %s; retrying", self.name, why)
            self._error = why

    def _ok(self) -> None:
        with self._lock:
            if self._failing_since is not None:
                log.info("%s cache: current again after %.0f s", self.name,
                         time.monotonic() - self._failing_since)
            self._failing_since = None

    def _list(self) -> None:
        items: dict[str, Any] = {}
        token = None
        while True:
            query = [*self.query, ("limit", str(PAGE))] + ([("continue", token)] if token else [])
            page = self.kube.list_page(self.path, query)
            for obj in page.get("items") or []:
                value = self._keep(obj)
                if value is not None:
                    items[obj["metadata"]["uid"]] = value
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break
        CACHE_LISTS.labels(self.name).inc()
        with self._lock:
            self._items = items
            self._by = {}
            for uid, value in items.items():
                self._file(uid, value)
            self._rv = page["metadata"]["resourceVersion"]
            self._listed_at = time.monotonic()
            CACHE_OBJECTS.labels(self.name).set(len(items))
        self._ok()
        self._synced.set()

    def _watch(self) -> None:
        query = [*self.query, ("watch", "true"), ("resourceVersion", self._rv),
                 ("allowWatchBookmarks", "true"), ("timeoutSeconds", str(WATCH_S))]
        raw = self.kube.watch(self.path, query, WATCH_S + WATCH_GRACE_S)
        self._ok()
        rest = b""
        try:
            for chunk in raw.stream(65536):
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop()
                for line in lines:
                    if line.strip():
                        self._event(json.loads(line))
                if self._stop.is_set():
                    return
        finally:
            raw.release_conn()

    def _event(self, event: dict) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", ""))
            raise ApiException(status=obj.get("code"), reason=obj.get("message"))
        meta = obj.get("metadata") or {}
        if kind != "BOOKMARK":
            value = None if kind == "DELETED" else self._keep(obj)
            with self._lock:
                self._unfile(meta["uid"])
                if value is None:
                    self._items.pop(meta["uid"], None)
                else:
                    self._items[meta["uid"]] = value
                    self._file(meta["uid"], value)
                CACHE_OBJECTS.labels(self.name).set(len(self._items))
        if meta.get("resourceVersion"):
            self._rv = meta["resourceVersion"]

    def _file(self, uid: str, value: Any) -> None:
        if self._index is not None:
            self._by.setdefault(self._index(value), {})[uid] = value

    def _unfile(self, uid: str) -> None:
        old = self._items.get(uid)
        if self._index is not None and old is not None:
            bucket = self._by.get(self._index(old))
            if bucket is not None:
                bucket.pop(uid, None)
                if not bucket:
                    del self._by[self._index(old)]


def _keep_unbound(pod: dict) -> dict | None:
    """An unbound managed pod: what its owner check reads, and what it asks for."""
    use = pending_use(pod)
    if use is None:
        return None
    meta = pod["metadata"]
    return {"metadata": {k: meta[k] for k in ("namespace", "name", "uid", "ownerReferences")
                         if k in meta} | {"labels": {
                             INSTANCE_LABEL: (meta.get("labels") or {}).get(INSTANCE_LABEL, "")}},
            "use": use}


def _pod_key(pod: dict) -> tuple[str, str]:
    meta = pod["metadata"]
    return meta["namespace"], (meta.get("labels") or {}).get(INSTANCE_LABEL, "")


def _labels(selector: str) -> dict[str, str]:
    """An equality-based label selector (builders.get_selector) as a dict."""
    return dict(term.split("=", 1) for term in selector.split(",") if term)


class ClusterCache:
    """The operator's caches, started when first needed. `namespaces`: the operator's (None:
    cluster-wide); managed pods are then watched per namespace, where the operator's
    namespaced permissions are."""

    def __init__(self, kube: Kube, namespaces: list[str] | None = None,
                 watchdog: Watchdog | None = None,
                 owns: Callable[[str, str], bool] = lambda namespace, name: True,
                 drain_markers: tuple[Marker, ...] = ()) -> None:
        """`owns(namespace, name)`: the VLMDeployments whose pods are kept (runtime/sharding.py);
        `drain_markers`: the admin's node drain markers (k8s/nodes.py, leaving)."""
        self.kube, self.namespaced, self.watchdog = kube, bool(namespaces), watchdog
        self.drain_markers = drain_markers
        self.owns = owns
        self._lock = threading.Lock()
        self._informers: dict[str, Informer] = {}
        self._swept = time.monotonic()

    def _informer(self, name: str, path: str, keep, query=(), index=None) -> Informer:
        with self._lock:
            informer = self._informers.get(name)
            if informer is None:
                informer = self._informers[name] = Informer(
                    self.kube, name, path, keep, query, index, self.watchdog).start()
            return informer

    def _nodes(self) -> Informer:
        return self._informer("nodes", "/api/v1/nodes",
                              functools.partial(node_state, markers=self.drain_markers))

    def _gpu_pods(self) -> Informer:
        return self._informer("gpu-pods", "/api/v1/pods", pod_use,
                              (("fieldSelector", BOUND_AND_RUNNING),))

    def _unbound_pods(self) -> Informer:
        return self._informer("unbound-gpu-pods", "/api/v1/pods", _keep_unbound,
                              (("fieldSelector", UNBOUND), ("labelSelector", MANAGED)))

    def start_budget(self, unbound: bool = False) -> None:
        """Start the caches the GPU budget reads (without waiting for them); `unbound`: the
        unbound managed pods too (read only where a node autoscaler adds nodes)."""
        self._nodes()
        self._gpu_pods()
        if unbound:
            self._unbound_pods()

    def pod_uses(self) -> list[PodUse]:
        """What the bound GPU pods hold, where; raises Stale."""
        return self._gpu_pods().values()

    def unbound_uses(self) -> list[PodUse]:
        """What the managed pods no node holds yet ask for, of those whose owner chain leads to
        the operator (node ""); raises Stale."""
        return [pod["use"] for pod in self.kube.owned_pods(self._unbound_pods().values())]

    def budget(self) -> tuple[list[Node], dict[str, dict[str, int]]]:
        """Schedulable nodes and the extended resources free on each; raises Stale."""
        nodes = [state.budget for state in self._nodes().values() if state.budget is not None]
        return nodes, free_by_node(nodes, self._gpu_pods().values())

    def leaving_nodes(self) -> dict[str, Leaving]:
        """Nodes about to go (k8s/nodes.py, leaving) -> why, and whether a drain; raises
        Stale."""
        return {state.name: state.leaving for state in self._nodes().values()
                if state.leaving is not None}

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        """Managed pods of `namespace` matching an equality `selector` whose owner chain leads
        to the operator, as Kube.list_pods (runtime/rounds.py reads these every second); raises
        Stale."""
        wanted = _labels(selector)
        pods = self._managed(namespace).indexed(
            (namespace, wanted.get(INSTANCE_LABEL, "")))
        return self.kube.owned_pods([p for p in pods if all(
            (p["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())])

    def has_pods(self, namespace: str, name: str) -> bool | None:
        """Whether the VLMDeployment `name` has pods labelled as its (list_pods then checks
        their owners), without waiting and without a request: None while the cache cannot say
        (not listed yet, or stale)."""
        try:
            return bool(self._managed(namespace).indexed((namespace, name), wait=False))
        except Stale:
            return None

    def _managed(self, namespace: str) -> Informer:
        if self.namespaced:
            self._stop_idle()
            return self._informer(f"managed-pods {namespace}",
                                  f"/api/v1/namespaces/{namespace}/pods", self._keep_pod,
                                  (("labelSelector", MANAGED),), _pod_key)
        return self._informer("managed-pods", "/api/v1/pods", self._keep_pod,
                              (("labelSelector", MANAGED),), _pod_key)

    def _keep_pod(self, pod: dict) -> dict | None:
        """Only pods whose owner chain leads to a VLMDeployment of this shard, and of those
        only what the operator reads (pods.kept_pod): a tenant's pods labelled like ours, with
        big annotations, cost nothing. A pod whose owners could not be read is kept in that
        small form; list_pods asks again before anything uses it."""
        if not self.owns(*_pod_key(pod)):
            return None
        try:
            if not self.kube.owned_pods([pod]):
                return None
        except ApiException:
            pass
        return kept_pod(pod)

    def _stop_idle(self) -> None:
        """Stop per-namespace caches nobody read for IDLE_S (their VLMDeployments are gone)."""
        now = time.monotonic()
        with self._lock:
            if now - self._swept < IDLE_S / 10:
                return
            self._swept = now
            idle = [n for n, i in self._informers.items()
                    if n.startswith("managed-pods ") and now - i.used_at > IDLE_S]
            for name in idle:
                self._informers.pop(name).stop()

    def stop(self) -> None:
        with self._lock:
            for informer in self._informers.values():
                informer.stop()

