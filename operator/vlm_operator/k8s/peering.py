"""Whether this replica may act, by kopf's peering rule, read from the peering object.

kopf pauses its own handlers, timers and daemons while another live replica has a higher or the
same priority. The log followers are our own threads, so they ask here before they remediate:
otherwise a paused replica's followers and the active replica's would both act on one incident.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid

from kubernetes.client.exceptions import ApiException

from vlm_operator.k8s.kube import Kube

CACHE_SECONDS = 2.0
log = logging.getLogger(__name__)


def get_identity() -> str:
    """This replica's peer id: the pod name in a cluster, else host and pid; unique per start."""
    who = os.environ.get("POD_NAME") or f"{socket.gethostname()}/{os.getpid()}"
    return f"{who}/{uuid.uuid4().hex[:8]}"


def may_act(peers: dict, identity: str, priority: int, now: dt.datetime) -> bool:
    """kopf's rule: act unless another live peer has a priority >= ours.

    `peers` is the peering object's status: {identity: {priority, lifetime, lastseen}}. A peer
    whose lastseen + lifetime has passed is dead; an entry that cannot be read counts as live
    (when unsure, do not act: the active replica will).
    """
    for peer, info in peers.items():
        if peer == identity:
            continue
        try:
            seen = dt.datetime.fromisoformat(info["lastseen"])
            alive = seen + dt.timedelta(seconds=int(info.get("lifetime", 60))) > now
            higher = int(info.get("priority", 0)) >= priority
        except (KeyError, TypeError, ValueError):
            return False
        if alive and higher:
            return False
    return True


class Peering:
    """Reads the (Cluster)KopfPeering this replica takes part in, cached for CACHE_SECONDS."""

    def __init__(self, kube: Kube, name: str, identity: str, priority: int,
                 namespaced: bool) -> None:
        self.kube, self.name, self.identity, self.priority = kube, name, identity, priority
        self.namespaced = namespaced
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, bool]] = {}

    def _path(self, namespace: str) -> str:
        if self.namespaced:
            return f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings/{self.name}"
        return f"/apis/kopf.dev/v1/clusterkopfpeerings/{self.name}"

    def may_act(self, namespace: str, fresh: bool = False) -> bool:
        """`fresh`: read the peering object now (before a remediation); else a read up to
        CACHE_SECONDS old will do (the periodic loops ask every second)."""
        key = namespace if self.namespaced else ""
        with self._lock:
            cached = self._cache.get(key)
        if not fresh and cached and time.monotonic() - cached[0] < CACHE_SECONDS:
            return cached[1]
        try:
            body = self.kube._call("GET", self._path(namespace))
            verdict = may_act(body.get("status") or {}, self.identity, self.priority,
                              dt.datetime.now(dt.UTC))
        except ApiException as exc:
            log.warning("reading the peering object %s: %s %s; not acting", self.name,
                        exc.status, exc.reason)
            verdict = False
        with self._lock:
            self._cache[key] = (time.monotonic(), verdict)
        return verdict
