"""Recovery of a pod that serves nothing, cheapest first. Pure: no I/O, times passed in.

A pod whose engine died or hung (remediation/policy.NOT_SERVING) is fenced first: out of the
Service at once (the in-service label), with a `Fence` kept in the pod's annotation, so no new
request reaches it while it recovers. Then the rungs, each with a deadline:

- AWAIT_EXIT: vLLM exits by itself about 5 s after its engine dies (unless
  VLLM_KEEP_ALIVE_ON_ENGINE_DEATH), and the kubelet restarts the container in place: same node,
  image, weights in HF_HOME and compile cache under HOME (emptyDirs survive a container
  restart). The operator waits EXIT_WAIT_S for that restart.
- RESTART_REQUEST: the process stays up (a hung engine, a kept-alive dead one): the operator
  writes the pod's restart-request annotation; the kubelet projects it into the container
  (a downwardAPI volume, rewritten on the kubelet's sync of the updated pod: about a
  second, its periodic sync a minute later where that is missed) and the engine plugin exits the
  process, for the same in-place restart. Only where the plugin runs in the pod's current
  container (its startup line was seen); REQUEST_WAIT_S covers the kubelet's refresh.
- DELETE: a fresh pod (what a Restart always did): when in-place recovery failed, or would be
  slower (the kubelet's back-off before the next in-place restart is past a cold start), or the
  node is suspect (remediation/suspect.py: a GPU error in the log, or in-place recoveries that
  keep failing): a restart in place would run on the same GPU again.

A container that restarted in place gets READY_WAIT_S (the startup probe's budget) to be Ready;
then the fence is lifted. Everything the next step needs is in the pod's annotation and status,
so a fresh operator process carries on where another stopped.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

from vlm_operator.api import annotation_json
from vlm_operator.api.names import ACTED_UNTIL, FENCE
from vlm_operator.desired import children
from vlm_operator.k8s.pods import container_status, is_ready, parse_time, restart_count
from vlm_operator.remediation.suspect import Suspect

# vLLM exits about 5 s after its engine dies; the kubelet sees the exit at once (PLEG, ~1 s)
# and restarts the first time without back-off. Slack for a loaded node.
EXIT_WAIT_S = 30.0
# The kubelet rewrites projected downwardAPI files when it syncs the updated pod (about a
# second), at worst on its periodic sync a minute later; the plugin reads the file every second.
REQUEST_WAIT_S = 120.0
# A container restarted in place has the startup probe's budget to load the model again.
READY_WAIT_S = float(children.STARTUP_PERIOD_SECONDS * children.STARTUP_FAILURE_THRESHOLD)
# A new pod's start on real hardware, cold (image, weights, compile): 110 s published for a vLLM
# pod (facts.md). An in-place restart the kubelet delays longer than this is not the cheaper one.
COLD_START_S = 110.0
KUBELET_BACKOFF_BASE_S, KUBELET_BACKOFF_CAP_S = 10.0, 300.0
KEEP_ALIVE_ENV = "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"
MAX_FENCE_CHARS = 4096  # a fence's annotation text, at most (the operator writes some 300)


class Rung(enum.StrEnum):
    AWAIT_EXIT = "await-exit"
    RESTART_REQUEST = "restart-request"
    DELETE = "delete"


class Next(enum.StrEnum):
    """What a fenced pod needs now."""

    WAIT = "wait"
    REQUEST = "request"  # write the restart request (climbing to RESTART_REQUEST)
    DELETE = "delete"  # delete the pod (climbing to DELETE)
    UNFENCE = "unfence"  # it restarted in place and is Ready: back into the Service
    FORGET = "forget"  # the pod is going away or gone: nothing left to do


@dataclass(frozen=True, slots=True)
class Fence:
    """A fenced pod's recovery, kept in its FENCE annotation. incident: the detection's time
    (the budget and lastRemediation count it once); restarts: the container's restartCount when
    the rung began (a higher one is an in-place restart); deadline: when the rung has failed."""

    signature: str
    incident: float
    at: float
    rung: str
    deadline: float
    restarts: int
    reason: str


def fence_value(fence: Fence) -> str:
    return json.dumps(asdict(fence), separators=(",", ":"), sort_keys=True)


def parse_fence(annotations: Mapping[str, str] | None) -> Fence | None:
    """The pod's fence, or None (none, or not one the operator wrote: ignored, never acted on)."""
    data = annotation_json.read((annotations or {}).get(FENCE), max_chars=MAX_FENCE_CHARS)
    if not isinstance(data, dict):
        return None
    try:
        fence = Fence(str(data["signature"])[:64], float(data["incident"]), float(data["at"]),
                      Rung(data["rung"]).value, float(data["deadline"]), int(data["restarts"]),
                      str(data["reason"])[:1024])
    except (ValueError, KeyError, TypeError, OverflowError):
        return None
    numbers = (fence.incident, fence.at, fence.deadline)
    return fence if all(math.isfinite(n) for n in numbers) and fence.restarts >= 0 else None


def recovered_until(pod: Mapping) -> float | None:
    """Detections up to this time on the pod were acted on by an in-place recovery."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(ACTED_UNTIL)
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def kubelet_backoff_s(restarts: int) -> float:
    """How long the kubelet waits before the next in-place restart of a container that has
    restarted `restarts` times (10 s doubling to 5 min; the first restart is immediate)."""
    if restarts <= 0:
        return 0.0
    return min(KUBELET_BACKOFF_CAP_S, KUBELET_BACKOFF_BASE_S * 2 ** (restarts - 1))


def keeps_alive(pod: Mapping) -> bool:
    """The vllm container stays up after its engine dies (/health answers 503 instead)."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == children.CONTAINER:
            for env in c.get("env") or []:
                if env.get("name") == KEEP_ALIVE_ENV:
                    return str(env.get("value", "")).strip().lower() in ("1", "true")
    return False


def can_request(pod: Mapping, plugin_loaded: bool) -> bool:
    """An in-place restart can be asked: the pod mounts the request and the plugin runs."""
    volumes = (pod.get("spec") or {}).get("volumes") or []
    return plugin_loaded and any(v.get("name") == children.CONTROL_VOLUME and "downwardAPI" in v
                                 for v in volumes)


def first_rung(signature: str, pod: Mapping, *, plugin_loaded: bool,
               suspect: Suspect | None = None) -> tuple[Rung, str]:
    """The cheapest rung that can work for this pod and signal, and why. suspect: why its node
    is suspect (remediation/suspect.py; None: it is not): a new pod at once."""
    if suspect is not None:
        return Rung.DELETE, suspect.why
    backoff = kubelet_backoff_s(restart_count(pod))
    if backoff > COLD_START_S:
        return Rung.DELETE, (f"the kubelet would wait {backoff:.0f} s before restarting it in "
                             f"place, longer than a new pod's cold start ({COLD_START_S:.0f} s)")
    if signature == "engine_dead" and not keeps_alive(pod):
        return Rung.AWAIT_EXIT, ("vLLM exits after its engine dies: the kubelet restarts the "
                                 "container in place, caches kept")
    return _after_exit(pod, plugin_loaded)


def _after_exit(pod: Mapping, plugin_loaded: bool) -> tuple[Rung, str]:
    if can_request(pod, plugin_loaded):
        return Rung.RESTART_REQUEST, ("the process stays up: the engine plugin is asked to "
                                      "exit it for an in-place restart, caches kept")
    return Rung.DELETE, ("the process stays up and the engine plugin is not there to restart "
                         "it in place: a new pod")


def deadline_for(rung: Rung, now: float) -> float:
    return now + {Rung.AWAIT_EXIT: EXIT_WAIT_S, Rung.RESTART_REQUEST: REQUEST_WAIT_S}.get(
        rung, 0.0)


def climb(fence: Fence, rung: Rung, now: float, restarts: int) -> Fence:
    return replace(fence, rung=rung.value, deadline=deadline_for(rung, now), restarts=restarts)


def next_step(fence: Fence, pod: Mapping | None, now: float, *, plugin_loaded: bool,
              suspect: Suspect | None = None) -> tuple[Next, Rung | None, str]:
    """The fenced pod's next step: (what, the rung it climbs to, why). suspect: why its node is
    suspect (None: it is not): a new pod, even after an in-place restart (the same GPU)."""
    if pod is None or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return Next.FORGET, None, "the pod is going away"
    if fence.rung == Rung.DELETE:  # the deletion did not take (an API error): again
        return Next.DELETE, Rung.DELETE, "the pod is still there after its deletion"
    if suspect is not None:
        return Next.DELETE, Rung.DELETE, suspect.why
    if restart_count(pod) > fence.restarts:
        if is_ready(pod):
            return Next.UNFENCE, None, "it restarted in place and is Ready again"
        started = parse_time(((container_status(pod).get("state") or {}).get("running")
                              or {}).get("startedAt"))
        if started is not None and now - started > READY_WAIT_S:
            return Next.DELETE, Rung.DELETE, (f"it restarted in place but is not Ready after "
                                              f"{READY_WAIT_S:.0f} s")
        if kubelet_backoff_s(restart_count(pod)) > COLD_START_S and started is None:
            return Next.DELETE, Rung.DELETE, "the kubelet backs off past a cold start"
        return Next.WAIT, None, "restarted in place, loading"
    if now < fence.deadline:
        return Next.WAIT, None, f"{fence.rung} until its deadline"
    if fence.rung == Rung.AWAIT_EXIT:
        rung, why = _after_exit(pod, plugin_loaded)
        why = f"it did not exit within {EXIT_WAIT_S:.0f} s; {why}"
    else:
        rung, why = Rung.DELETE, (f"it did not restart within {REQUEST_WAIT_S:.0f} s of the "
                                  "request: a new pod")
    return (Next.REQUEST if rung == Rung.RESTART_REQUEST else Next.DELETE), rung, why
