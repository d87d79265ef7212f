"""One watch-fed cache (informer-style) of one kind of object, each kept in a small form.

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

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException

from vlm_operator.k8s.kube import Kube
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
