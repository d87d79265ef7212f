"""Events about a pod, as the kubelet and the controllers write them (core/v1 Events), and Go's
time.Duration text the kubelet prints in them."""

from __future__ import annotations

import uuid
from typing import Any

from .state import log, rfc3339


def go_duration(seconds: float) -> str:
    """Go's time.Duration.String(): 1.5s, 2m3.25s, 250ms, 0s (the kubelet's `in %v`)."""
    ns = round(seconds * 1e9)
    if ns == 0:
        return "0s"
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    if ns < 1_000_000_000:
        for unit, size in (("ms", 1_000_000), ("µs", 1_000), ("ns", 1)):
            if ns >= size:
                whole, frac = divmod(ns, size)
                digits = f"{frac:0{len(str(size)) - 1}d}".rstrip("0") if size > 1 else ""
                return f"{sign}{whole}{'.' + digits if digits else ''}{unit}"
    hours, rest = divmod(ns, 3_600_000_000_000)
    minutes, rest = divmod(rest, 60_000_000_000)
    secs, frac = divmod(rest, 1_000_000_000)
    digits = f"{frac:09d}".rstrip("0")
    text = f"{secs}{'.' + digits if digits else ''}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def record(core: Any, pod: dict, reason: str, message: str, *, warning: bool = False,
           component: str = "kubelet", host: str | None = None,
           container: str | None = None) -> None:
    """Write one Event about `pod` (best effort: an Event that cannot be written is logged)."""
    meta = pod["metadata"]
    now = rfc3339()
    involved = {"apiVersion": "v1", "kind": "Pod", "namespace": meta["namespace"],
                "name": meta["name"], "uid": meta["uid"]}
    if container:
        involved["fieldPath"] = f"spec.containers{{{container}}}"
    body = {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                         "namespace": meta["namespace"]},
            "involvedObject": involved, "reason": reason, "message": message,
            "type": "Warning" if warning else "Normal", "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": component, **({"host": host} if host else {})}}
    try:
        core.create_namespaced_event(meta["namespace"], body)
    except Exception as exc:  # an Event is worth a log line, never a failed pod
        log.warning("event %s for %s/%s: %s", reason, meta["namespace"], meta["name"], exc)
