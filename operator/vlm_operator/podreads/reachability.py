"""What the operator's reads of pods say about the pods' reachability, for status: the
conditions PodsReachable and PodsReadable, their Events, and the metrics
vlm_operator_pod_read_errors_total{kind}, vlm_operator_pods_unreachable and
vlm_operator_pods_unreadable (per VLMDeployment, never per pod).

Fed by every round's /metrics reads (runtime/rounds.py), one per running pod per second, of the pods
whose server started (the startup probe passed: a loading vLLM refuses connections for
minutes, which is no news):
- PodsReachable=False (reason PodsUnreachable) names the Ready pods the operator cannot connect
  to (podhttp.UNREACHABLE: connect timed out, refused, reset): the kubelet's probes reach them,
  the operator does not, which is what a NetworkPolicy that drops or rejects the operator's
  traffic looks like (a pod that is not Ready and refuses is down, not cut off: not counted).
  Nothing is done to those pods for it. Stall detection and Builtin autoscaling cannot read them
  meanwhile (their load counts as unknown).
- PodsReadable=False names the pods that accept the connection but whose answers fail: a
  timeout, an answer over the cap, a redirect, a malformed answer or an HTTP error (the reason
  is the kind most of them show).
A pod enters a state after ENTER reads in a row say so and leaves it after LEAVE reads in a
row say otherwise, so one slow read does not flip the conditions (each flip is a status write
and an Event). Pure functions decide; `PodReads` holds the state.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from vlm_operator.api.reports import Report
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.metrics import POD_READ_ERRORS, PODS_UNREACHABLE, PODS_UNREADABLE
from vlm_operator.podreads import reader
from vlm_operator.podreads.podhttp import BAD_ANSWER, REDIRECT, TIMEOUT, TOO_LARGE, UNREACHABLE

ENTER, LEAVE = 3, 3
REACHABLE, READABLE = "PodsReachable", "PodsReadable"
KINDS = (UNREACHABLE, TIMEOUT, TOO_LARGE, REDIRECT, BAD_ANSWER, reader.HTTP_ERROR)
REASONS = {TIMEOUT: "ReadTimeout", TOO_LARGE: "AnswerTooLarge", REDIRECT: "RedirectRefused",
           BAD_ANSWER: "BadAnswer", reader.HTTP_ERROR: "HTTPError"}
NAMED = 10  # pods named in a message; the rest are counted
Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class PodState:
    name: str
    kind: str | None = None  # the kind reported now; None: reads work
    detail: str = ""
    streak: int = 0  # reads in a row that disagree with what is reported


def observe(prev: PodState | None, name: str, kind: str | None, detail: str) -> PodState:
    """After one read of the pod: kind None when it worked, else its error kind. A failing pod
    whose kind changes (timeout, then unreachable) reports the new one at once; while the kind
    stays, so does the detail first reported (what a pod answers must not rewrite status every
    second)."""
    state = prev or PodState(name)
    if kind is not None and kind == state.kind:
        return PodState(name, kind, state.detail)
    if (kind is None) == (state.kind is None):
        return PodState(name, kind, detail if kind else "")
    streak = state.streak + 1
    if streak >= (LEAVE if kind is None else ENTER):
        return PodState(name, kind, detail if kind else "")
    return replace(state, name=name, streak=streak)


def _listing(states: list[PodState]) -> str:
    named = sorted(states, key=lambda s: s.name)
    text = ", ".join(f"{s.name} ({s.detail})" for s in named[:NAMED])
    return text + (f" and {len(named) - NAMED} more" if len(named) > NAMED else "")


def reports(states: list[PodState], started: int) -> list[Report]:
    """The two conditions for a VLMDeployment's pod states; started: its started pods."""
    unreachable = [s for s in states if s.kind == UNREACHABLE]
    unreadable = [s for s in states if s.kind not in (None, UNREACHABLE)]
    if unreachable:
        reachable = Report(REACHABLE, "False", "PodsUnreachable", (
            f"the operator cannot connect to {len(unreachable)} of {started} started pods on "
            f"port 8000, which the kubelet's probes reach (Ready): {_listing(unreachable)}. "
            "Nothing is done to them for it; stall detection and Builtin autoscaling cannot "
            "read them meanwhile. A NetworkPolicy that drops or rejects the operator's traffic "
            "does this: admit it (the chart's networkPolicy.enabled)"))
    else:
        reachable = Report(REACHABLE, "True", "PodsReachable",
                           "the operator connects to every Ready pod")
    if unreadable:
        kinds = Counter(s.kind for s in unreadable)
        top = max(KINDS[1:], key=lambda k: (kinds[k], -KINDS.index(k)))
        readable = Report(READABLE, "False", REASONS[top], (
            f"{len(unreadable)} of {started} started pods accept the operator's connection but "
            f"their /metrics answers fail: {_listing(unreadable)}. Their load and progress are "
            "unknown meanwhile; redirects are never followed and answers are cut at "
            f"{reader.METRICS_CAP} bytes and {reader.METRICS_TIMEOUT_S:g} s"))
    else:
        readable = Report(READABLE, "True", "PodsReadable",
                          "every started pod the operator reaches answers its /metrics")
    return [reachable, readable]


class PodReads:
    """The pod states of every VLMDeployment this replica runs rounds for; a report provider
    (runner.py registers it). `refresh(namespace, name)` publishes status when what the
    conditions say changes (Reconciler.refresh)."""

    def __init__(self, refresh: Callable[[str, str], None] = lambda ns, name: None) -> None:
        self.refresh = refresh
        self._lock = threading.Lock()
        self._states: dict[Key, dict[str, PodState]] = {}  # uid -> state, started pods only

    def observe(self, namespace: str, name: str, pods: list[dict],
                scrapes: dict[str, reader.Scrape]) -> None:
        """One round: `scrapes` holds a reading for each running pod (reader.Scraper). Pods
        not started (or not running) are dropped; readings that say nothing about the pod
        (BUSY, NO_IP, or a refused connection to a pod that is not Ready) keep its last
        state."""
        key = (namespace, name)
        for reading in scrapes.values():
            if reading.error in KINDS:
                POD_READ_ERRORS.labels(namespace, name, reading.error).inc()
        with self._lock:
            before = self._states.get(key, {})
            after = {}
            for pod in pods:
                meta = Body(pod)
                reading = scrapes.get(meta.name)
                if reading is None or not _started(pod):
                    continue
                prev = before.get(meta.uid)
                if reading.values is not None:
                    after[meta.uid] = observe(prev, meta.name, None, "")
                elif reading.error == UNREACHABLE and not Pod(pod).ready:
                    after[meta.uid] = prev or PodState(meta.name)  # down, not cut off
                elif reading.error in KINDS:
                    after[meta.uid] = observe(prev, meta.name, reading.error,
                                                 reading.detail)
                else:
                    after[meta.uid] = prev or PodState(meta.name)
            changed = _published(before) != _published(after)
            if after:
                self._states[key] = after
            else:
                self._states.pop(key, None)
        PODS_UNREACHABLE.labels(namespace, name).set(
            sum(1 for s in after.values() if s.kind == UNREACHABLE))
        PODS_UNREADABLE.labels(namespace, name).set(
            sum(1 for s in after.values() if s.kind not in (None, UNREACHABLE)))
        if changed:
            self.refresh(namespace, name)

    def tracks(self, namespace: str, name: str) -> bool:
        """Whether anything is held for the VLMDeployment (a round with no pods clears it)."""
        with self._lock:
            return (namespace, name) in self._states

    def reports(self, namespace: str, name: str) -> list[Report]:
        with self._lock:
            states = list(self._states.get((namespace, name), {}).values())
        return reports(states, len(states))

    def forget(self, namespace: str, name: str) -> None:
        """The VLMDeployment is gone (or no longer this replica's); its metric series go with
        metrics.forget_vlmd."""
        with self._lock:
            self._states.pop((namespace, name), None)


def _started(pod: dict) -> bool:
    """The server's container runs and passed its startup probe (clusters that do not say so
    count a running container as started)."""
    status = Pod(pod).container
    return "running" in (status.get("state") or {}) and status.get("started", True) is not False


def _published(states: dict[str, PodState]) -> list[tuple[str, str | None, str]]:
    """What the conditions say about these states (a detail's change included)."""
    return sorted((s.name, s.kind, s.detail) for s in states.values() if s.kind)
