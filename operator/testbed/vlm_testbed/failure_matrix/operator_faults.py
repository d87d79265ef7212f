"""Rows where the operator goes away: operators killed mid-incident or mid-drain, a standby
taking over, two VLMDeployments at once."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

from vlm_operator.desired import children

from .bed import KEEP_ALIVE, instance, merged
from .engine_faults import storm_on_a_full_node
from .stalls import metric

if TYPE_CHECKING:
    from .bed import Bed, Observed


def operator_killed_mid_incident(bed: Bed, health: dict | None) -> Observed:
    """Held (no GPU free), the operator is SIGKILLed; a GPU frees up and a fresh operator
    replays the log: it acts on the held incident once."""
    first = bed.operator()
    pod, start = storm_on_a_full_node(bed, health)
    faulted = {instance(pod)}
    bed.wait("held", lambda: bed.events("row")["RemediationSkipped"], timeout=30)
    bed.kill(first)
    bed.nodes(gpus_per_node=1, tag="extra")
    bed.operator()
    return bed.follow("row", 1, faulted, start)


def operator_killed_stale_incident(bed: Bed, health: dict | None) -> Observed:
    """A short storm is held; the operator is SIGKILLed and a fresh one starts after the
    incident's window: the replayed lines are too old to act on."""
    first = bed.operator()
    bed.nodes(gpus_per_node=1)
    bed.create("row", replicas=1, health=merged(
        {"tokenizerRetry": {"windowSeconds": 10}}, health))
    (pod,) = bed.wait_ready("row", 1)
    bed.fault(pod, {"fault": "tokenizer_retry", "rate": 20, "count": 8})
    bed.wait("held", lambda: bed.events("row")["RemediationSkipped"], timeout=30)
    bed.kill(first)
    time.sleep(11)
    bed.nodes(gpus_per_node=1, tag="extra")
    op = bed.operator()
    bed.wait("the log replayed", lambda: metric(
        op.metrics(), "vlm_operator_detections_total", signature="tokenizer_retry") >= 8,
        timeout=30)
    seen = bed.follow("row", 1, set(), time.time(), until=lambda: False, timeout=8, settle=0)
    seen.notes["remediating"] = bed.condition("row", "Remediating")
    seen.notes["pod_kept"] = pod.metadata.uid in {p.metadata.uid for p in bed.pods("row")}
    return seen


def operator_killed_mid_drain(bed: Bed, health: dict | None) -> Observed:
    """ScaleDown policy: the sick pod is draining a request when the operator is SIGKILLed;
    a fresh operator finishes the drain from the cluster: the pod goes once idle, replicas
    drop by exactly one, no pod is left out of the Service."""
    first = bed.operator()
    bed.nodes(gpus_per_node=3)
    bed.create("row", replicas=2, health=merged(
        {"tokenizerRetry": {"action": "ScaleDown"}}, health))
    pods = bed.wait_ready("row", 2)
    sick = pods[0]
    bed.fault(sick, {"fault": "load", "running": 1})  # a request in flight
    start = time.time()
    bed.fault(sick, {"fault": "tokenizer_retry", "rate": 20})
    bed.wait("draining", lambda: bed.events("row")["ScaleDownStarted"], timeout=30)
    bed.kill(first)
    bed.operator()
    time.sleep(3)
    bed.fault(sick, {"fault": "load", "running": 0})  # the request finished
    seen = bed.follow("row", 1, {instance(sick)}, start, until=lambda: bed.get("row")[
        "spec"]["replicas"] == 1 and not any(p.metadata.uid == sick.metadata.uid
                                             for p in bed.pods("row")), timeout=60)
    seen.notes["replicas"] = bed.get("row")["spec"]["replicas"]
    seen.notes["out_of_service"] = [p.metadata.name for p in bed.pods("row") if (
        p.metadata.labels or {}).get(children.IN_SERVICE_LABEL) == "false"]
    return seen


def standby_takes_over(bed: Bed, health: dict | None) -> Observed:
    """Two replicas on one peering; the active one is replacing the only serving pod (its
    replacement loads for 8 s) when it is stopped; the standby finishes the replacement."""
    peering = ("--peering", "vlm-operator")
    bed.operator(*peering, "--priority", "5")
    active = bed.operator(*peering, "--priority", "10")
    bed.nodes(gpus_per_node=2)
    bed.create("row", replicas=1, health=health,
               env=[{"name": "VLM_SIM_STARTUP_SECONDS", "value": "8"}])
    (pod,) = bed.wait_ready("row", 1)
    faulted = {instance(pod)}
    start = time.time()
    bed.fault(pod, {"fault": "tokenizer_retry", "rate": 20})
    bed.wait("replacing", lambda: bed.events("row")["PodReplacing"], timeout=30)
    bed.kill(active, signal.SIGTERM)
    return bed.follow("row", 1, faulted, start)


def two_at_once(bed: Bed, health: dict | None) -> Observed:
    """Two VLMDeployments fail together (an engine death, a retry storm): each is handled
    on its own, neither's pods or Events touched by the other's."""
    bed.nodes(gpus_per_node=4)
    bed.create("row", replicas=1, health=health, env=KEEP_ALIVE)
    bed.create("other", replicas=1, health=health)
    (a,) = bed.wait_ready("row", 1)
    (b,) = bed.wait_ready("other", 1)
    start = time.time()
    # "other" is followed once "row" is done: its pods as they were at the fault, else a pod
    # its Replace made and dropped meanwhile would count as touched
    before_other = bed.snapshot("other")
    bed.fault(a, {"fault": "engine_dead"})
    bed.fault(b, {"fault": "tokenizer_retry", "rate": 20})
    seen = bed.follow("row", 1, {instance(a)}, start)
    other = bed.follow("other", 1, {instance(b)}, start, before=before_other)
    seen.notes["other"] = other.as_dict()
    seen.recovered_s = max(seen.recovered_s or 1e9, other.recovered_s or 1e9)
    seen.recovered_s = None if seen.recovered_s >= 1e9 else seen.recovered_s
    return seen
