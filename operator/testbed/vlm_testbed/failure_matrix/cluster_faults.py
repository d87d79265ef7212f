"""Rows where the trouble is around the pod, not in its engine: the operator's traffic dropped or
refused, a hostile tenant's pods, a refused previous log, another app's Service."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

from kubernetes import client

from vlm_operator.api import crd
from vlm_operator.desired import children
from vlm_testbed import vllmsim
from vlm_testbed.firewall import Firewall
from vlm_testbed.operator_process import OperatorProcess

from .bed import KEEP_ALIVE, healthy, instance
from .stalls import metric

if TYPE_CHECKING:
    from .bed import Bed, Observed


UNREACHABLE_WINDOW_S = 30.0  # an api_unresponsive verdict on connect timeouts took about 20 s


def unreachable(mode: str):
    """The operator's traffic to the only replica is dropped (mode "drop": its connects time
    out, as behind a default-deny NetworkPolicy) or rejected ("reject": refused, as some CNIs
    do) while the kubelet's probes still reach it: reported (PodsReachable=False, an Event,
    metrics), nothing done to the pod; reachable again once the firewall lifts."""
    def run(bed: Bed, health: dict | None) -> Observed:
        bed.nodes(gpus_per_node=2)
        bed.create("row", replicas=1, health=health)
        (pod,) = bed.wait_ready("row", 1)
        with Firewall() as firewall:
            getattr(firewall, mode)(pod.status.pod_ip)
            seen = bed.follow("row", 1, set(), time.time(), until=lambda: False,
                              timeout=UNREACHABLE_WINDOW_S, settle=0)
            seen.notes.update(pod=pod.metadata.name,
                              condition=bed.condition("row", "PodsReachable"),
                              **_read_metrics(bed, "row", "unreachable"))
        seen.notes["reachable_again"] = bed.holds(lambda: bed.condition(
            "row", "PodsReachable").get("status") == "True", timeout=30)
        # the Event follows the status write that turned the condition True
        bed.holds(lambda: bed.events("row").get("PodsReachable"), timeout=10)
        seen.notes["events_after"] = dict(bed.events("row"))
        return seen
    return run


# Hostile modes of the stand-in a hostile tenant's pods serve (vllmsim), by VLMDeployment;
# `target`: where redirects point (a recording server: nobody may come).
HOSTILE_MODES = {
    "redirect": lambda target: {"fault": "redirect", "to": target},
    "huge": lambda target: {"fault": "huge_metrics", "bytes": 100_000_000},
    "drip": lambda target: {"fault": "drip_headers", "interval": 0.5, "lines": 8},
}
# Faults every hostile pod gets on top of its HTTP mode, so the row covers what a tenant's pods
# log as well as what they serve: 50,000 lines from as many process tags (a matcher keeping
# state per tag grew by 28.5 MB per 100,000) and 1,000 engine-failure lines with 5,000-digit
# pids (a traceback each in the operator's log before).
HOSTILE_LOG_FAULTS: list[dict] = [{"fault": "proc_flood", "lines": 50_000},
                                  {"fault": "giant_pid", "lines": 1_000, "digits": 5_000}]


def hostile_tenant(bed: Bed, health: dict | None) -> Observed:
    """One tenant's pods (another namespace, 2 replicas per mode) answer the operator as an
    attacker would: redirects to another address, 100 MB /metrics pages, headers drip-fed a
    line every 0.5 s (HOSTILE_MODES), and log floods of distinct process tags and giant pids
    (HOSTILE_LOG_FAULTS). Meanwhile this tenant's only replica has its engine die: acted on as
    usual. Notes: the operator's peak RSS and CPU during the row (from its own process
    metrics), the tracebacks it logged meanwhile, the requests the redirects' target got, and
    what the hostile VLMDeployments' status and metrics say."""
    bed.nodes(gpus_per_node=2 * len(HOSTILE_MODES) + 2)
    hostile = bed.tenant("h")
    target = vllmsim.RecordingServer()
    threading.Thread(target=target.serve_forever, daemon=True).start()
    bed._stack.callback(target.server_close)
    bed._stack.callback(target.shutdown)
    for mode in HOSTILE_MODES:
        hostile.create(mode, replicas=2, health=health)
    bed.create("row", replicas=1, health=health)
    pods = {mode: hostile.wait_ready(mode, 2) for mode in HOSTILE_MODES}
    (victim,) = bed.wait_ready("row", 1)
    usage = Usage(bed.watcher).start()
    log_from = len(bed.watcher.log()) if bed.watcher is not None else 0
    for mode, mode_pods in pods.items():
        for pod in mode_pods:
            hostile.fault(pod, [HOSTILE_MODES[mode](target.url), *HOSTILE_LOG_FAULTS])
    before = {mode: hostile.snapshot(mode) for mode in HOSTILE_MODES}
    hostile.holds(lambda: all(hostile.condition(mode, "PodsReadable").get("status") == "False"
                              for mode in HOSTILE_MODES), timeout=60)  # reported (asserted)
    start = time.time()
    bed.fault(victim, {"fault": "engine_dead", "exit_code": 0, "exit_delay": 5})
    seen = bed.follow("row", 1, {instance(victim)}, start)
    seen.notes.update(usage.stop())
    seen.notes["redirect_target_requests"] = list(target.requests)
    seen.notes["tracebacks"] = (bed.watcher.log()[log_from:].count("Traceback")
                                if bed.watcher is not None else None)
    seen.notes["hostile"] = {mode: {
        "readable": hostile.condition(mode, "PodsReadable"),
        "touched": sorted(uid for uid, inst in before[mode].items()
                          if hostile.snapshot(mode).get(uid) != inst),
        "events": dict(hostile.events(mode)),
        **_read_metrics(hostile, mode, {"redirect": "redirect", "huge": "too_large",
                                        "drip": "timeout"}[mode])} for mode in HOSTILE_MODES}
    return seen


def _read_metrics(bed: Bed, name: str, kind: str) -> dict:
    """The operator's read-error count of `kind` and unreachable-pod gauge for a VLMDeployment
    (None without a known operator)."""
    if bed.watcher is None:
        return {"read_errors": None, "pods_unreachable": None}
    text = bed.watcher.metrics()
    labels = {"vlmdeployment_namespace": bed.ns, "vlmdeployment": name}
    return {"read_errors": metric(text, "vlm_operator_pod_read_errors_total", kind=kind,
                                  **labels),
            "pods_unreachable": metric(text, "vlm_operator_pods_unreachable", **labels)}


class Usage:
    """The operator's RSS and CPU while a row runs, from its own process metrics
    (process_resident_memory_bytes, process_cpu_seconds_total), sampled every SAMPLE_S."""

    SAMPLE_S = 0.5

    def __init__(self, proc: OperatorProcess | None) -> None:
        self.proc = proc
        self.samples: list[tuple[float, float, float]] = []  # (time, RSS MiB, CPU seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="usage")

    def start(self) -> Usage:
        if self.proc is not None:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            with contextlib.suppress(OSError):
                text = self.proc.metrics()
                self.samples.append((time.monotonic(),
                                     metric(text, "process_resident_memory_bytes") / 2**20,
                                     metric(text, "process_cpu_seconds_total")))

    def stop(self) -> dict:
        """peak_rss_mib, cpu_percent (mean over the row), cpu_percent_peak (over any 2 s)."""
        self._stop.set()
        if self.proc is not None:
            self._thread.join(5)
        if len(self.samples) < 2:
            return {"peak_rss_mib": None, "cpu_percent": None, "cpu_percent_peak": None}
        (t0, _, c0), (t1, _, c1) = self.samples[0], self.samples[-1]
        window = max(1, round(2.0 / self.SAMPLE_S))
        peaks = [(b[2] - a[2]) / (b[0] - a[0]) for a, b in zip(
            self.samples, self.samples[window:], strict=False) if b[0] > a[0]]
        return {"peak_rss_mib": round(max(s[1] for s in self.samples), 1),
                "cpu_percent": round(100 * (c1 - c0) / (t1 - t0), 1),
                "cpu_percent_peak": round(100 * max(peaks, default=0.0), 1)}


def previous_log_refused(bed: Bed, health: dict | None) -> Observed:
    """A node restart lost the runtime's record of the only replica's container: the kubelet
    reports it ContainerStatusUnknown and answers 400 for its log. The new container's engine
    then dies (the process stays alive: only its log tells): the follower must have moved on
    to the new container."""
    sim = bed.nodes(gpus_per_node=2)
    bed.create("row", replicas=1, health=health, env=KEEP_ALIVE)
    (pod,) = bed.wait_ready("row", 1)
    sim.lose_container(bed.ns, pod.metadata.name, children.CONTAINER)
    (pod,) = bed.wait("the container started again", lambda: [
        p for p in bed.ready("row") if instance(p)[1] == 1 and healthy(p.status.pod_ip)])
    bed.wait("the unreadable log reported", lambda: bed.events("row")["PreviousLogUnavailable"],
             timeout=30)
    faulted = {instance(pod)}
    start = time.time()
    bed.fault(pod, {"fault": "engine_dead"})
    return bed.follow("row", 1, faulted, start)


def existing_service(bed: Bed, health: dict | None) -> Observed:
    """Another app's Service already has the VLMDeployment's name: it is never changed (no
    selector rewritten, no owner added) nor deleted with the VLMDeployment; the VLMDeployment
    still serves through its Deployment and says why it has no Service of its own."""
    bed.nodes(gpus_per_node=1)
    theirs = bed.core.create_namespaced_service(bed.ns, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "row"},
        "spec": {"selector": {"app": "their-app"},
                 "ports": [{"name": "http", "port": children.PORT, "targetPort": children.PORT}]}})
    start = time.time()
    bed.create("row", replicas=1, health=health)
    seen = bed.follow("row", 1, set(), start)
    degraded = bed.wait("Degraded", lambda: (c := bed.condition("row", "Degraded"))
                        and c.get("status") == "True" and c)
    seen.notes["degraded"] = {k: degraded.get(k) for k in ("reason", "message")}
    bed.custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, bed.ns, crd.PLURAL, "row")
    apps = client.AppsV1Api(bed.api)
    bed.wait("the Deployment collected", lambda: not apps.list_namespaced_deployment(
        bed.ns).items)
    after = bed.core.read_namespaced_service("row", bed.ns)
    seen.notes["service_kept"] = (after.metadata.uid == theirs.metadata.uid
                                  and after.metadata.resource_version
                                  == theirs.metadata.resource_version)
    seen.notes["service_owners"] = [r.kind for r in after.metadata.owner_references or []]
    seen.notes["service_selector"] = after.spec.selector
    return seen
