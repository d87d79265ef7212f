"""Rows where in-place recovery (spec.health.recovery InPlace, remediation/ladder.py) meets the
kubelet and the Builtin autoscaler: a fenced pod under a scale-down, an engine-death line read
after the kubelet already restarted the container, and a pod whose restarts are long past."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

from vlm_operator.api.names import FENCE

from .bed import healthy, instance, merged

if TYPE_CHECKING:
    from .bed import Bed, Observed

IN_PLACE = {"recovery": "InPlace"}
# the kubelet back-off of the old-restarts row's nodes and operator: 1 s doubling to 5 s, so
# forgotten after a 10 s run (the real 10 s / 5 min / 10 min, scaled down to fit a test)
BACKOFF_S, MAX_BACKOFF_S = 1.0, 5.0
LOAD_S = 15.0  # the late-line row's engine start: the restarted container loads this long


def fenced_under_scale_down(bed: Bed, health: dict | None) -> Observed:
    """2 Builtin-autoscaled replicas, InPlace: one's engine dies (vLLM exits 20 s later) and it
    is fenced; then minReplicas drops to 1 with no load. The fenced pod is the one that goes;
    the healthy one keeps serving, never drained."""
    bed.nodes(gpus_per_node=3)
    bed.create("row", replicas=2, health=merged(IN_PLACE, health),
               autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 2,
                            "scaleDownDelaySeconds": 0})
    sick, well = bed.wait_ready("row", 2)
    start = time.time()
    bed.fault(sick, {"fault": "engine_dead", "exit_code": 0, "exit_delay": 20})
    bed.wait("the sick pod fenced", lambda: any(
        p.metadata.uid == sick.metadata.uid and FENCE in (p.metadata.annotations or {})
        for p in bed.pods("row")), timeout=30)
    bed.patch_spec("row", {"autoscaling": {"minReplicas": 1}})

    def scaled() -> bool:
        live = [p for p in bed.pods("row") if p.metadata.deletion_timestamp is None]
        return bed.get("row")["spec"]["replicas"] == 1 and len(live) == 1

    seen = bed.follow("row", 1, {instance(sick)}, start, until=scaled, timeout=60, settle=5)
    seen.notes.update(
        replicas=bed.get("row")["spec"]["replicas"],
        healthy_kept=instance(well) in {instance(p) for p in bed.ready("row")},
        pods_left=sorted(p.metadata.uid for p in bed.pods("row")
                         if p.metadata.deletion_timestamp is None),
        healthy_uid=well.metadata.uid)
    return seen


def late_engine_death_line(bed: Bed, health: dict | None) -> Observed:
    """The only replica's engine dies while the operator is paused (SIGSTOP: a long pause, a
    starved node); vLLM exits and the kubelet restarts the container in place, which loads for
    LOAD_S (/health not 200 yet), before the operator reads the engine-death lines. Read late,
    they belong to the previous container: the loading one is neither fenced nor deleted, and
    no restart is counted."""
    bed.nodes(gpus_per_node=2)
    proc = bed.operator()
    bed.create("row", replicas=1, health=health,
               env=[{"name": "VLM_SIM_STARTUP_SECONDS", "value": f"{LOAD_S:g}"}])
    (pod,) = bed.wait_ready("row", 1)
    bed.wait_heartbeat("row")  # its log is followed
    start = time.time()
    proc.proc.send_signal(signal.SIGSTOP)
    try:
        bed.fault(pod, {"fault": "engine_dead", "exit_code": 0, "exit_delay": 1})
        bed.wait("the container restarted in place, loading", lambda: any(
            instance(p) == (pod.metadata.uid, 1) and not healthy(p.status.pod_ip)
            for p in bed.pods("row")), timeout=60)
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    said = "restarted in place since"
    seen = bed.follow("row", 1, set(), start, until=lambda: said in proc.log() and any(
        healthy(p.status.pod_ip) for p in bed.ready("row")), timeout=60, settle=3)
    seen.notes.update(late_line_read=said in proc.log(),
                      pod_kept=[instance(p) for p in bed.pods("row")] == [
                          (pod.metadata.uid, 1)])
    return seen


def old_restarts(bed: Bed, health: dict | None) -> Observed:
    """A pod that restarted 5 times, long enough ago that the kubelet forgot the back-off (its
    container has run past twice the longest back-off), then its engine dies: it is recovered
    in place (the kubelet restarts it at once), not replaced by a new pod because of its
    lifetime restartCount."""
    sim_options = {"backoff_base": BACKOFF_S, "backoff_cap": MAX_BACKOFF_S}
    bed.nodes(gpus_per_node=2, **sim_options)
    bed.operator("--standalone", "--kubelet-backoff-seconds", f"{BACKOFF_S:g}",
                 "--kubelet-max-backoff-seconds", f"{MAX_BACKOFF_S:g}")
    bed.create("row", replicas=1, health=merged({"engineDead": {"action": "Ignore"}}, health))
    (pod,) = bed.wait_ready("row", 1)
    for restarts in range(1, 6):  # crashes the operator ignores: the pod's old restarts
        # exits 0.5 s after answering (at once, the process could go before its answer)
        bed.fault(pod, {"fault": "engine_dead", "exit_code": 1, "exit_delay": 0.5})
        (pod,) = bed.wait(f"restart {restarts}", lambda n=restarts: [
            p for p in bed.ready("row") if instance(p)[1] == n and healthy(p.status.pod_ip)])
    bed.wait("the container running past the kubelet's back-off reset",
             lambda: running_s(bed, pod) > 2 * MAX_BACKOFF_S + 1, timeout=60)
    bed.patch_spec("row", {"health": merged({"engineDead": {"action": "Restart"}}, IN_PLACE)})
    generation = bed.get("row")["metadata"]["generation"]
    bed.wait("the operator saw the new policy", lambda: (bed.get("row").get("status") or {})
             .get("observedGeneration") == generation, timeout=30)
    faulted = {instance(pod)}
    start = time.time()
    bed.fault(pod, {"fault": "engine_dead", "exit_code": 0, "exit_delay": 1})
    seen = bed.follow("row", 1, faulted, start, until=lambda: bed.events("row")[
        "PodRecoveredInPlace"] + bed.events("row")["PodRestarted"] >= 1, settle=5)
    seen.notes.update(restarts_before=5, pod_kept=any(
        p.metadata.uid == pod.metadata.uid for p in bed.pods("row")
        if p.metadata.deletion_timestamp is None), fenced=[
        e.message for e in bed.core.list_namespaced_event(
            bed.ns, field_selector="involvedObject.name=row").items
        if e.reason == "PodFenced"])
    return seen


def running_s(bed: Bed, pod) -> float:
    """How long the pod's container has run now (0: not running)."""
    status = bed.core.read_namespaced_pod(pod.metadata.name, bed.ns).status
    running = status.container_statuses[0].state.running if status.container_statuses else None
    return time.time() - running.started_at.timestamp() if running and running.started_at \
        else 0.0
