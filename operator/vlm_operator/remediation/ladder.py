"""Recovery of a pod that serves nothing, cheapest first. Pure: no I/O, times passed in.

A pod whose engine died or hung (api/health_signals.NOT_SERVING) is fenced first: out of the
Service at once (the in-service label), with a `Fence` kept in the pod's annotation, so no new
request reaches it while it recovers. Then the rungs, each with a deadline:

- AWAIT_EXIT: vLLM exits by itself about 5 s after its engine dies (unless
  VLLM_KEEP_ALIVE_ON_ENGINE_DEATH), and the kubelet restarts the container in place: same node,
  image, weights in HF_HOME and compile cache under HOME (emptyDirs survive a container
  restart). The operator waits EXIT_WAIT_S for that restart.
- RESTART_REQUEST: the process stays up (a hung engine, a kept-alive dead one): the operator
  writes the pod's restart-request annotation; the kubelet projects it into the container
  (a downwardAPI volume, rewritten on the kubelet's sync of the updated pod: about a
  second; seconds after a frozen or restarted kubelet is back; at most a minute, its periodic
  sync) and the engine plugin exits the process, for the same in-place restart. Only where
  the plugin runs in the pod's current container (its startup line was seen); REQUEST_WAIT_S
  covers the kubelet's refresh.
- DELETE: a fresh pod (what a Restart always did): when in-place recovery failed, or would be
  slower (the kubelet's back-off before the next in-place restart is past a cold start), or the
  node is suspect (remediation/suspect.py: a GPU error in the log, or in-place recoveries that
  keep failing): a restart in place would run on the same GPU again.

The kubelet's back-off (kubelet_backoff_s) is estimated as the kubelet keeps it: per container,
initial 10 s doubling to a 5 min cap, the first restart immediate, and forgotten when a
container ran longer than twice the cap (flowcontrol.Backoff: 10 min) before it ended. The pod's
status shows only the last two containers (state: the current one's start; lastState.terminated:
the previous one's start and end), so a run of restarts older than those two is not visible: where
both ran under 10 min, the estimate assumes every earlier restart chained too (the lifetime
restartCount: an upper bound); a pod whose current or previous container ran longer is back to
the first steps, whatever restartCount says. A kubelet restart (which forgets every back-off) is not
visible either.

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
from vlm_operator.k8s.pods import is_ready, parse_time
from vlm_operator.k8s.views import Pod
from vlm_operator.remediation.suspect import Suspect

# vLLM exits about 5 s after its engine dies; the kubelet sees the exit at once (PLEG, ~1 s)
# and restarts the first time without back-off. Slack for a loaded node.
EXIT_WAIT_S = 30.0
# The kubelet rewrites projected downwardAPI files when it syncs the updated pod (about a
# second; a kubelet frozen or restarted over the change within seconds of its return:
# bench/results/downward-api-missed-sync.md), bounded by its periodic sync a minute later; the
# plugin reads the file every second.
REQUEST_WAIT_S = 120.0
# A container restarted in place has the startup probe's budget to load the model again.
READY_WAIT_S = float(children.STARTUP_PERIOD_SECONDS * children.STARTUP_FAILURE_THRESHOLD)
# A new pod's start on real hardware, cold (image, weights, compile): 110 s published for a vLLM
# pod (facts.md). An in-place restart the kubelet delays longer than this is not the cheaper one.
COLD_START_S = 110.0
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


@dataclass(frozen=True, slots=True)
class KubeletBackoff:
    """The nodes' crash-loop back-off: initial_s doubling to max_s; forgotten after a run longer
    than twice max_s (the kubelet's defaults; a kubelet configured otherwise, e.g. with
    KubeletCrashLoopBackOffMax, is told with the operator's --kubelet-backoff-* flags)."""

    initial_s: float = 10.0
    max_s: float = 300.0

    @property
    def reset_after_s(self) -> float:
        return 2 * self.max_s

    def chained(self, restarts: int) -> float:
        """The delay after `restarts` restarts that all followed short runs."""
        return 0.0 if restarts <= 0 else min(self.max_s, self.initial_s * 2 ** (restarts - 1))


KUBELET_BACKOFF = KubeletBackoff()


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
    raw = Pod(pod).annotations.get(ACTED_UNTIL)
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def _run(started: str | None, ended: float | None) -> float | None:
    """How long a container ran (None: its start or end not known)."""
    began = parse_time(started)
    return ended - began if began is not None and ended is not None else None


def kubelet_backoff_s(pod: Mapping, now: float,
                      backoff: KubeletBackoff = KUBELET_BACKOFF) -> float:
    """How long from now the kubelet waits before it restarts the vllm container in place: the
    back-off it will apply when the running container ends now, or what is left of the one it
    applies to the container that ended (waiting in CrashLoopBackOff). See the module's
    docstring for what the status shows and what it cannot."""
    status = Pod(pod).container
    restarts = Pod(pod).restart_count
    state = status.get("state") or {}
    previous = (status.get("lastState") or {}).get("terminated") or {}
    if "running" in state:  # it ends now; the one before it is lastState
        ran = _run(state["running"].get("startedAt"), now)
        ended, before = now, previous
    else:  # it ended (state.terminated), or ended and waits (lastState); the one before: unseen
        last = state.get("terminated") or previous
        ended = parse_time(last.get("finishedAt"))
        ran = _run(last.get("startedAt"), ended)
        before = previous if "terminated" in state else {}
        if not last:
            return 0.0  # no container ended yet: nothing to back off from
    if restarts <= 0 or (ran is not None and ran > backoff.reset_after_s):
        return 0.0  # the first restart, or the kubelet forgot the back-off: immediate
    ran_before = _run(before.get("startedAt"), parse_time(before.get("finishedAt")))
    if ran is None:
        delay = backoff.chained(restarts)  # when the run is unknown, assume the longest
    elif restarts == 1 or (ran_before is not None and ran_before > backoff.reset_after_s):
        delay = backoff.initial_s  # the back-off began again with the previous restart
    else:
        delay = backoff.chained(restarts)
    return max(0.0, ended + delay - now) if ended is not None else delay


def container_since(pod: Mapping) -> float | None:
    """When the newest vllm container that ran started: the running (or ended) one's start, or
    the last one's while the kubelet waits to restart it; None before any started, and for the
    pod's first container (restartCount 0: no earlier one whose late lines could be read, so an
    engine that dies within its first second is still its own). A line logged before this came
    from a container the kubelet has restarted in place since."""
    if Pod(pod).restart_count == 0:
        return None
    status = Pod(pod).container
    state = status.get("state") or {}
    current = state.get("running") or state.get("terminated") or \
        (status.get("lastState") or {}).get("terminated") or {}
    return parse_time(current.get("startedAt"))


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


def first_rung(signature: str, pod: Mapping, now: float, *, plugin_loaded: bool,
               suspect: Suspect | None = None,
               kubelet: KubeletBackoff = KUBELET_BACKOFF) -> tuple[Rung, str]:
    """The cheapest rung that can work for this pod and signal, and why. suspect: why its node
    is suspect (remediation/suspect.py; None: it is not): a new pod at once."""
    if suspect is not None:
        return Rung.DELETE, suspect.why
    backoff = kubelet_backoff_s(pod, now, kubelet)
    if backoff > COLD_START_S:
        return Rung.DELETE, (f"the kubelet would wait {backoff:.0f} s before restarting it in "
                             f"place, longer than a new pod's cold start ({COLD_START_S:.0f} s)")
    if signature == "engine_dead" and not keeps_alive(pod):
        when = f"after its back-off (about {backoff:.0f} s)" if backoff > 0 else "at once"
        return Rung.AWAIT_EXIT, ("vLLM exits after its engine dies: the kubelet restarts the "
                                 f"container in place {when}, caches kept")
    return _after_exit(pod, plugin_loaded)


def _after_exit(pod: Mapping, plugin_loaded: bool) -> tuple[Rung, str]:
    if can_request(pod, plugin_loaded):
        return Rung.RESTART_REQUEST, ("the process stays up: the engine plugin is asked to "
                                      "exit it for an in-place restart, caches kept")
    return Rung.DELETE, ("the process stays up and the engine plugin is not there to restart "
                         "it in place: a new pod")


def deadline_for(rung: Rung, now: float, backoff_s: float = 0.0) -> float:
    """When the rung has failed; awaiting the exit also waits out the kubelet's back-off
    (kubelet_backoff_s) before its in-place restart."""
    return now + {Rung.AWAIT_EXIT: EXIT_WAIT_S + backoff_s,
                  Rung.RESTART_REQUEST: REQUEST_WAIT_S}.get(rung, 0.0)


def climb(fence: Fence, rung: Rung, now: float, restarts: int) -> Fence:
    return replace(fence, rung=rung.value, deadline=deadline_for(rung, now), restarts=restarts)


def next_step(fence: Fence, pod: Mapping | None, now: float, *, plugin_loaded: bool,
              suspect: Suspect | None = None,
              kubelet: KubeletBackoff = KUBELET_BACKOFF) -> tuple[Next, Rung | None, str]:
    """The fenced pod's next step: (what, the rung it climbs to, why). suspect: why its node is
    suspect (None: it is not): a new pod, even after an in-place restart (the same GPU)."""
    if pod is None or Pod(pod).deleting:
        return Next.FORGET, None, "the pod is going away"
    if fence.rung == Rung.DELETE:  # the deletion did not take (an API error): again
        return Next.DELETE, Rung.DELETE, "the pod is still there after its deletion"
    if suspect is not None:
        return Next.DELETE, Rung.DELETE, suspect.why
    if Pod(pod).restart_count > fence.restarts:
        if is_ready(pod):
            return Next.UNFENCE, None, "it restarted in place and is Ready again"
        started = parse_time(((Pod(pod).container.get("state") or {}).get("running")
                              or {}).get("startedAt"))
        if started is not None and now - started > READY_WAIT_S:
            return Next.DELETE, Rung.DELETE, (f"it restarted in place but is not Ready after "
                                              f"{READY_WAIT_S:.0f} s")
        if started is None and kubelet_backoff_s(pod, now, kubelet) > COLD_START_S:
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
