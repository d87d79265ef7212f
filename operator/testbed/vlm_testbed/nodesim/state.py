"""Container and pod state as the simulated kubelet reports it (pure), and the node
simulator's shared constants."""

from __future__ import annotations

import datetime as dt
import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("vlm_testbed.nodesim")


SIM_LABEL = "vlm-testbed/simulated"
NO_PROCESS = "vlm-testbed/process"  # pod annotation: "none" = a LightPod
STATUS_EVERY = 3  # heartbeats per Node status write (the Lease is renewed every heartbeat)
GPU = "nvidia.com/gpu"
NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
SMP = "application/strategic-merge-patch+json"  # the client would default to json-patch
MIN_GRACE_S = 2  # the kubelet always leaves a container this long between SIGTERM and SIGKILL


def rfc3339nano(ns: int) -> str:
    """Go's time.RFC3339Nano in UTC (trailing zeros of the fraction trimmed), as the kubelet
    stamps container log lines."""
    secs, frac = divmod(ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
    digits = f"{frac:09d}".rstrip("0")
    return f"{base}.{digits}Z" if digits else f"{base}Z"


def rfc3339(ns: int | None = None) -> str:
    secs = (time.time_ns() if ns is None else ns) // 1_000_000_000
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(secs))


def parse_rfc3339_ns(text: str) -> int:
    """RFC3339 / RFC3339Nano -> nanoseconds since the epoch (fractions up to ns kept)."""
    text = text.strip().replace("z", "Z")
    main, frac, tz = text, "", "+00:00"
    if text.endswith("Z"):
        main = text[:-1]
    elif len(text) > 6 and text[-6] in "+-" and text[-3] == ":":
        main, tz = text[:-6], text[-6:]
    if "." in main:
        main, frac = main.split(".", 1)
    when = dt.datetime.fromisoformat(main + tz)
    return int(when.timestamp()) * 1_000_000_000 + int((frac + "000000000")[:9])


def backoff_delay(crashes: int, base: float, cap: float) -> float:
    """The kubelet's restart back-off: the first restart is immediate, then base, 2*base, ...
    capped. `crashes` counts exits since the last reset (1 for the first exit)."""
    if crashes <= 1:
        return 0.0
    return min(cap, base * 2 ** (crashes - 2))


def crashes_after_exit(crashes: int, ran_s: float, cap: float) -> int:
    """The exit count back-off is computed from, after an exit of a container that ran `ran_s`
    seconds: the kubelet forgets a container's back-off once it ran longer than twice the cap
    (flowcontrol.Backoff's hasExpired: 10 min at the default 5 min cap), so an exit after a long
    run restarts at once again."""
    return 1 if ran_s > 2 * cap else crashes + 1


def should_restart(policy: str, exit_code: int, init: bool = False) -> bool:
    if init:
        return exit_code != 0 and policy != "Never"
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def exit_code_of(returncode: int) -> int:
    """A process killed by signal N reports 128+N, like a container's exit code."""
    return 128 - returncode if returncode < 0 else returncode


def field_value(pod: dict, path: str, pod_ip: str) -> str | None:
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName"),
              "status.podIP": pod_ip, "status.hostIP": "127.0.0.1", "status.podIPs": pod_ip}
    if path in simple:
        return simple[path]
    for prefix, key in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        if path.startswith(prefix + "['") and path.endswith("']"):
            return (meta.get(key) or {}).get(path[len(prefix) + 2:-2])
        if path == prefix:  # the whole map, as the kubelet writes it to a file: k="v" lines
            items = sorted((meta.get(key) or {}).items())
            return "\n".join(f"{k}={json.dumps(v)}" for k, v in items)
    return None


def resolve_env(pod: dict, container: dict, pod_ip: str,
                lookup: Callable[[str, str, str], str | None]) -> dict[str, str]:
    """The container's environment; lookup(kind, name, key) reads Secrets/ConfigMaps
    (kind is "secret" or "configmap"; key None means the whole object as a dict)."""
    env: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind, ref_key in (("configmap", "configMapRef"), ("secret", "secretRef")):
            ref = src.get(ref_key)
            if ref:
                for k, v in (lookup(kind, ref["name"], None) or {}).items():
                    env[prefix + k] = v
    for item in container.get("env") or []:
        name, value = item["name"], item.get("value")
        source = item.get("valueFrom") or {}
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = lookup("secret", ref["name"], ref["key"])
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = lookup("configmap", ref["name"], ref["key"])
        elif "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"], pod_ip)
        elif "resourceFieldRef" in source:
            res = source["resourceFieldRef"]["resource"]
            kind, _, rname = res.partition(".")
            value = str(((container.get("resources") or {}).get(kind) or {}).get(rname, "0"))
        if value is not None:
            env[name] = _expand(str(value), env)
    return env


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion against variables defined earlier."""
    for k, v in env.items():
        value = value.replace(f"$({k})", v)
    return value


def probe_port(container: dict, port: Any) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


def overwritten(pod: dict, sent: dict | None) -> bool:
    """Whether someone else changed the pod's conditions since the kubelet wrote them (the
    node controller marks an unreachable node's pods NotReady; the kubelet writes them back)."""
    if sent is None:
        return False
    def view(conditions):
        return {c.get("type"): c.get("status") for c in conditions or []}
    return view((pod.get("status") or {}).get("conditions")) != view(sent.get("conditions"))


def terminated_state(t: Terminated) -> dict:
    """A terminated state as the kubelet writes it; one the runtime lost (ContainerStatusUnknown)
    has no times and no containerID."""
    if not t.container_id:
        return {"terminated": {"exitCode": t.exit_code, "reason": t.reason,
                               "message": t.message}}
    return {"terminated": {"exitCode": t.exit_code, "reason": t.reason,
                           "startedAt": rfc3339(t.started_ns), "finishedAt": rfc3339(t.finished_ns),
                           "containerID": t.container_id}}


def pod_phase(restart_policy: str, init_done: bool, statuses: list[ContainerView]) -> str:
    """The kubelet's pod phase from its containers' states."""
    if not init_done or any(not s.ever_started for s in statuses):
        return "Failed" if any(s.failed_for_good for s in statuses) else "Pending"
    if any(s.running or s.will_restart for s in statuses):
        return "Running"
    if all(s.last_exit == 0 for s in statuses):
        return "Succeeded"
    return "Failed" if restart_policy != "Always" else "Running"


@dataclass
class Terminated:
    exit_code: int
    reason: str
    started_ns: int
    finished_ns: int
    container_id: str  # "": the runtime has no record of it (LOST)
    message: str = ""


# What the kubelet reports for a container that was running when the runtime lost its record
# of it (kubelet_pods.go, convertToAPIContainerStatuses: a node restart that wiped the
# runtime's state): no containerID, so `kubectl logs --previous` has nothing to read.
LOST = Terminated(137, "ContainerStatusUnknown", 0, 0, "",
                  "The container could not be located when the pod was deleted.  The container "
                  "used to be Running")


@dataclass
class ContainerView:
    """What pod_phase needs to know about one container."""

    ever_started: bool
    running: bool
    will_restart: bool
    last_exit: int | None
    failed_for_good: bool


@dataclass
class Instance:
    """One run of a container (the kubelet's 'container' as opposed to the spec)."""

    index: int
    log_path: Path
    container_id: str
    started_ns: int = 0
    proc: subprocess.Popen | None = None
    done: threading.Event = field(default_factory=threading.Event)
    appended: threading.Condition | None = None  # notified per write (LightContainer)
    lines: int = 0  # lines written, where `appended` is set
    lost: bool = False  # the runtime lost its record (lose_container): its log cannot be read
