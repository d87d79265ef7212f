"""Stall detection, the acting side: each round's /metrics readings go through verdicts.py;
canaries and /health checks run on CHECK_WORKERS workers shared fairly between namespaces (one
at a time per pod, each with its deadline), and verdicts reach the Remediator as engine_stalled
or api_unresponsive incidents, with the same guards as log signatures.

Where the vlm-operator plugin runs, the engine's own heartbeat (a log line every few seconds,
read by the log followers into `Heartbeats`) decides first (verdicts.by_heartbeat): it tells a
long step from a wedged one, needs no network path to the pod and no API key. The counters and
the canary decide for pods without it. A pod where neither can work (no heartbeat, the canary
refused for want of an API key) is named in the StallDetection condition and an Event.

A canary is a 1-token completion with request id `vlm-operator-canary-*` (header X-Request-Id,
user "vlm-operator-canary"): it shows in vLLM's request logs and in vllm:request_success_total
like any request, and in the operator's vlm_operator_canaries_total{result}. An idle pod gets
one per stallSeconds - canaryTimeoutSeconds; a pod whose counters move gets none.

Only timeouts on connections the pod accepted are evidence (podreads/podhttp.py): a /metrics read
that could not connect starts no check, and api_unresponsive is acted on only while the kubelet
agrees (the pod is not Ready); until then it is logged once and left alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Protocol

from vlm_operator.api.reports import Event, Report
from vlm_operator.api.validation import VLMDeployment
from vlm_operator.k8s.views import Pod
from vlm_operator.metrics import CANARIES, DETECTIONS
from vlm_operator.podreads import canary, reader
from vlm_operator.podreads.fairpool import FairPool
from vlm_operator.podreads.podhttp import TIMEOUT
from vlm_operator.remediation.context import Reporter
from vlm_operator.stalls import verdicts

log = logging.getLogger(__name__)

API_HEALTH_TIMEOUT_S = 5.0  # as the generated liveness probe's timeout
CHECK_WORKERS = 16  # canaries and /health checks running at once, shared fairly between
# namespaces (podreads/fairpool.py): one tenant's many slow pods do not hold back another's canaries


class LogSource(Protocol):
    """A pod's log follower (logs/stream.Follower): the log time (the kubelet's timestamp) of
    the last line it delivered."""

    last_line_stamp: float | None


MAX_ENGINES = 16  # engine processes per pod kept (data-parallel ranks); a bound, not a limit


class Heartbeats:
    """The engine heartbeats the log followers saw, per pod and container instance (its
    restart count): written by follower threads (logs/watcher.LogWatch.detected), read by the
    rounds. Bounded: one entry per followed pod, MAX_ENGINES engine processes each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # pod uid -> (container instance, engine process name -> beat, the pod's log follower)
        self._pods: dict[str, tuple[int, dict[str, verdicts.Beat], LogSource]] = {}

    def beat(self, uid: str, instance: int, proc: str, fields: Mapping[str, str],
             source: LogSource, stamp: float) -> None:
        now = time.time()
        with self._lock:
            held, beats, _ = self._pods.get(uid, (instance, {}, source))
            if held != instance:  # a new container: the old one's beats say nothing now
                beats = {}
            beats = {**beats, proc: verdicts.beat(fields, beats.get(proc), now, stamp)}
            while len(beats) > MAX_ENGINES:
                del beats[min(beats, key=lambda k: beats[k].at)]
            self._pods[uid] = (instance, beats, source)

    def of(self, uid: str, instance: int) -> tuple[dict[str, verdicts.Beat], float | None]:
        """(engine process -> latest beat, the log time of the last line the pod's log
        delivered) for the pod's container `instance`; no beats for another instance."""
        with self._lock:
            held, beats, source = self._pods.get(uid, (instance, {}, None))
        if held != instance or source is None:
            return {}, None
        return beats, source.last_line_stamp

    def forget(self, uid: str) -> None:
        with self._lock:
            self._pods.pop(uid, None)


class StallWatch:
    def __init__(self, remediator: Reporter, heartbeats: Heartbeats) -> None:
        self.remediator = remediator
        self.heartbeats = heartbeats
        self._pool = FairPool(CHECK_WORKERS, "check")
        self._lock = threading.Lock()
        # (namespace, name) -> pod uid -> progress, of running containers (canaries only for
        # ready ones); replaced whole every round
        self._progress: dict[tuple[str, str], dict[str, verdicts.Progress]] = {}
        self._pods: dict[tuple[str, str], dict[str, dict]] = {}  # the same, uid -> the pod
        # object as last seen by a round (the kubelet's view for api_unresponsive)
        self._checking: set[str] = set()  # pod uids with a canary or /health check running
        # the same, pod uids logged as unresponsive without the kubelet agreeing, until they
        # answer again (logged once)
        self._uncorroborated: dict[tuple[str, str], set[str]] = {}
        # (namespace, name) -> pod name -> verdicts.detector() of its running containers
        self._detectors: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}
        self._publishing: set[tuple[str, str]] = set()  # VLMDeployments with a refresh running

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._progress.pop((namespace, name), None)
            self._pods.pop((namespace, name), None)
            self._uncorroborated.pop((namespace, name), None)
            self._detectors.pop((namespace, name), None)

    def reports(self, namespace: str, name: str) -> list[Report]:
        """The StallDetection condition (report provider of the Reconciler)."""
        with self._lock:
            pods = self._detectors.get((namespace, name))
        report = verdicts.detection_report(pods or {})
        return [report] if report else []

    def observe(self, vlmd: VLMDeployment, pods: list[dict],
                scrapes: dict[str, reader.Scrape]) -> None:
        """One round of a VLMDeployment: its pods and their readings (reader.Scraper)."""
        health = vlmd.spec["health"]
        stalled, unresponsive = health["engineStalled"], health["apiUnresponsive"]
        watching = stalled["action"] != "Ignore"
        key = (vlmd.namespace, vlmd.name)
        now = time.time()
        due, stalls_found, detectors = [], [], {}
        with self._lock:
            before = self._progress.get(key, {})
            after = {}
            for pod in pods:
                uid = Pod(pod).uid
                reading = scrapes.get(Pod(pod).name)
                if reading is None:  # not running: a new container starts afresh
                    continue
                progress = verdicts.observe(before.get(uid), reading.values, now)
                if reading.values is not None:
                    progress = verdicts.after_health(progress, False, None)
                beats, line_at = self.heartbeats.of(uid, Pod(pod).restart_count)
                verdict = None
                if watching and Pod(pod).ready:
                    verdict, why = verdicts.by_heartbeat(beats, line_at, now,
                                                       stalled["stallSeconds"],
                                                       stalled["minTokensPerSecond"])
                    progress = verdicts.after_heartbeat(progress, verdict, now)
                    if verdict == verdicts.STALLED and verdicts.stall_report_due(
                            progress, now, stalled["stallSeconds"]):
                        progress = verdicts.told(progress, now)
                        stalls_found.append((pod, why))
                after[uid] = progress
                detectors[Pod(pod).name] = verdicts.detector(bool(beats), progress)
                if reading.error == TIMEOUT and unresponsive["action"] != "Ignore":
                    due.append((uid, self._check_api, pod, unresponsive["timeouts"]))
                elif verdict == verdicts.UNKNOWN and verdicts.canary_due(
                        progress, now, stalled["stallSeconds"], stalled["canaryTimeoutSeconds"]):
                    due.append((uid, self._canary, pod, stalled["canaryTimeoutSeconds"]))
            self._progress[key] = after
            self._pods[key] = {Pod(p).uid: p for p in pods
                               if Pod(p).uid in after}
            answered = {uid for uid in after if after[uid].read_at == now}
            self._uncorroborated[key] = self._uncorroborated.get(key, set()) & (
                set(after) - answered)
            detectors = detectors if watching else {}
            changed = ({n: d[0] for n, d in detectors.items()}
                       != {n: d[0] for n, d in self._detectors.get(key, {}).items()})
            self._detectors[key] = detectors
        if changed:  # the StallDetection condition changes: publish it
            self._publish(key)
        for pod, why in stalls_found:
            log.warning("%s/%s: %s stalled: %s", vlmd.namespace, vlmd.name,
                        Pod(pod).name, why)
            self._report(vlmd, pod, "engine_stalled", now, why)
        for uid, check, pod, arg in due:
            self._start(uid, check, vlmd, pod, arg)

    def _store(self, vlmd: VLMDeployment, uid: str, judge):
        """(progress, verdict) = judge(progress) for a tracked pod, stored; None when the pod
        is no longer tracked (gone or unready meanwhile: its verdict is moot)."""
        with self._lock:
            pods = self._progress.get((vlmd.namespace, vlmd.name), {})
            if uid not in pods:
                return None
            progress, verdict = judge(pods[uid])
            self._progress[(vlmd.namespace, vlmd.name)] = {**pods, uid: progress}
            return progress, verdict

    def _start(self, uid: str, check, vlmd: VLMDeployment, *args) -> None:
        with self._lock:
            if uid in self._checking:
                return
            self._checking.add(uid)

        def run() -> None:
            try:
                check(vlmd, *args)
            except Exception:  # a check must never take the watch down
                log.exception("stall check of %s failed", uid)

        def done(_future) -> None:  # ran, failed, or dropped at shutdown
            with self._lock:
                self._checking.discard(uid)

        self._pool.submit((vlmd.namespace, vlmd.name), run).add_done_callback(done)

    def _canary(self, vlmd: VLMDeployment, pod: dict, timeout_s: float) -> None:
        uid, name = Pod(pod).uid, Pod(pod).name
        request_id = canary.new_id()
        sent = time.time()
        result = canary.send(Pod(pod).pod_ip, timeout_s, request_id)
        CANARIES.labels(vlmd.namespace, vlmd.name, result).inc()
        now = time.time()
        judged = self._store(vlmd, uid, lambda p: verdicts.after_canary(p, result, sent, now))
        if judged is not None and result == verdicts.UNAUTHORIZED:
            self._detector_off(vlmd, pod, judged[0])
        if judged is None or judged[1] != verdicts.STALLED:
            return
        progress = judged[0]
        detail = verdicts.stall_detail(progress, now, timeout_s, request_id)
        log.warning("%s/%s: %s stalled: %s", vlmd.namespace, vlmd.name, name, detail)
        self._report(vlmd, pod, "engine_stalled", now, detail)

    def _publish(self, key: tuple[str, str]) -> None:
        """Refresh the VLMDeployment's status off the round's thread, one refresh at a time
        per VLMDeployment (the Reconciler coalesces what comes meanwhile)."""
        with self._lock:
            if key in self._publishing:
                return
            self._publishing.add(key)

        def run() -> None:
            try:
                self.remediator.reconcile(*key)
            finally:
                with self._lock:
                    self._publishing.discard(key)

        threading.Thread(target=run, daemon=True, name=f"detection {key[1]}").start()

    def _detector_off(self, vlmd: VLMDeployment, pod: dict, progress: verdicts.Progress) -> None:
        """The canary was refused and the pod logs no heartbeat: say so (the StallDetection
        condition, an Event) instead of going silently blind. Once per container: a refused
        canary is never sent to it again."""
        uid, name = Pod(pod).uid, Pod(pod).name
        beats, _ = self.heartbeats.of(uid, Pod(pod).restart_count)
        how, why = verdicts.detector(bool(beats), progress)
        with self._lock:
            detectors = self._detectors.get((vlmd.namespace, vlmd.name))
            if how != verdicts.OFF or detectors is None:
                return
            self._detectors[(vlmd.namespace, vlmd.name)] = {**detectors, name: (how, why)}
        log.warning("%s/%s: hung-engine detection off for %s: %s", vlmd.namespace, vlmd.name,
                    name, why)
        self.remediator.post_event(vlmd.namespace, vlmd.name, pod, Event(
            "Warning", "StallDetectionOff", f"{name}: hung engines cannot be detected: {why}; "
            "the vlm-operator plugin's engine heartbeat needs no API key"))
        self.remediator.reconcile(vlmd.namespace, vlmd.name)

    def _check_api(self, vlmd: VLMDeployment, pod: dict, needed: int) -> None:
        """/metrics timed out this round on a connection the pod accepted: does /health answer
        within the probe's timeout, and does the kubelet see it too?"""
        uid, name = Pod(pod).uid, Pod(pod).name
        answer = reader.health(Pod(pod).pod_ip, API_HEALTH_TIMEOUT_S)
        judged = self._store(vlmd, uid,
                             lambda p: (verdicts.after_health(p, True, answer), None))
        if judged is None:
            return
        progress = judged[0]
        with self._lock:  # the pod as the latest round saw it
            pod = self._pods.get((vlmd.namespace, vlmd.name), {}).get(uid, pod)
        verdict = verdicts.api_verdict(progress, needed, Pod(pod).not_ready)
        detail = (f"/metrics and /health both timed out in {progress.timeouts} checks in a row "
                  f"(/health waited {API_HEALTH_TIMEOUT_S:g} s, on connections the pod "
                  "accepted)")
        if verdict == verdicts.UNCORROBORATED:
            with self._lock:
                told = self._uncorroborated.setdefault((vlmd.namespace, vlmd.name), set())
                first = uid not in told
                told.add(uid)
            if first:
                log.warning("%s/%s: %s: %s, but the kubelet's readiness probe passes (the pod "
                            "is Ready): not acted on while the kubelet does not agree",
                            vlmd.namespace, vlmd.name, name, detail)
            return
        if verdict != verdicts.UNRESPONSIVE:
            return
        detail += (" and the kubelet's readiness probe fails too (Ready=False): the API "
                   "server's event loop is not answering")
        log.warning("%s/%s: %s unresponsive: %s", vlmd.namespace, vlmd.name, name, detail)
        self._report(vlmd, pod, "api_unresponsive", time.time(), detail)

    def _report(self, vlmd: VLMDeployment, pod: dict, signature: str, t: float,
                detail: str) -> None:
        DETECTIONS.labels(vlmd.namespace, vlmd.name, signature).inc()
        self.remediator.report(vlmd.namespace, vlmd.name, uid=Pod(pod).uid,
                               pod=Pod(pod).name, signature=signature, t=t,
                               count=lambda key, window_s: 1, detail=detail)
