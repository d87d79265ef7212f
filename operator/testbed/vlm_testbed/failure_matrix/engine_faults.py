"""Rows where the engine fails: engine deaths, tokenizer retry storms (with and without a free
GPU, under load), saturation and crash loops."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import TYPE_CHECKING, Any

from vlm_operator.desired import children
from vlm_operator.podreads import reader
from vlm_operator.remediation import incidents

from .bed import KEEP_ALIVE, instance, merged, post

if TYPE_CHECKING:
    from .bed import Bed, Observed

# a round that scraped a pod before its fault ends within the scrape deadline; rounds are 1 s
SCRAPE_SETTLE_S = 2 * reader.METRICS_TIMEOUT_S + 1.0


def engine_death(replicas: int, exit_code: int | None, hit_all: bool = False,
                 env: list | None = None):
    """exit_code None: the engine dies and the process stays alive (keep-alive); `env`: more
    of spec.vllm.env (vLLM's logging settings)."""
    def run(bed: Bed, health: dict | None) -> Observed:
        bed.nodes(gpus_per_node=replicas + 1)
        bed.create("row", replicas=replicas, health=health,
                   env=(KEEP_ALIVE if exit_code is None else []) + (env or []))
        pods = bed.wait_ready("row", replicas)
        hit = pods if hit_all else pods[:1]
        faulted = {instance(p) for p in hit}
        start = time.time()
        for p in hit:
            bed.fault(p, {"fault": "engine_dead", "exit_code": exit_code or 0,
                          "exit_delay": 5})
        return bed.follow("row", replicas, faulted, start)
    return run


def storm(replicas: int, gpus_per_node: int, count: int | None = None):
    """A tokenizer retry storm on one pod: 20 warnings/s (count None: until it is restarted)."""
    def run(bed: Bed, health: dict | None) -> Observed:
        bed.nodes(gpus_per_node=gpus_per_node)
        bed.create("row", replicas=replicas, health=health)
        pods = bed.wait_ready("row", replicas)
        faulted = {instance(pods[0])}
        start = time.time()
        spec = {"fault": "tokenizer_retry", "rate": 20}
        if count is not None:
            spec["count"] = count
        bed.fault(pods[0], spec)
        if count is not None:  # below the threshold: nothing may happen; watch a while
            return bed.follow("row", replicas, faulted, start, until=lambda: False,
                              timeout=10, settle=0)
        return bed.follow("row", replicas, faulted, start)
    return run


def storm_on_a_full_node(bed: Bed, health: dict | None) -> tuple[Any, float]:
    """One replica on a node with one GPU (none free), then an endless retry storm on it;
    returns the pod and when the storm began."""
    bed.nodes(gpus_per_node=1)
    bed.create("row", replicas=1, health=health)
    (pod,) = bed.wait_ready("row", 1)
    start = time.time()
    bed.fault(pod, {"fault": "tokenizer_retry", "rate": 20})
    return pod, start


def storm_without_free_gpu(bed: Bed, health: dict | None) -> Observed:
    """The only replica storms and no GPU is free: held with a condition; a node with a free
    GPU joins, and the held incident is acted on (a replacement) without a new trigger."""
    pod, start = storm_on_a_full_node(bed, health)
    faulted = {instance(pod)}
    held = bed.follow("row", 1, faulted, start, until=lambda: bed.condition(
        "row", "Remediating").get("reason") == "WaitingForCapacity", timeout=20, settle=5)
    notes = {"held_condition": bed.condition("row", "Remediating"),
             "held_events": dict(bed.events("row"))}
    bed.nodes(gpus_per_node=1, tag="extra")
    seen = bed.follow("row", 1, faulted, start)
    seen.notes.update(notes, held_recovered=held.recovered_s,
                      touched_while_held=held.touched)
    return seen


def saturation(bed: Bed, health: dict | None) -> Observed:
    """Busy, not broken: a full queue, slow service and a /metrics that answers after the
    autoscaler's scrape timeout, on one of two autoscaled replicas. Nothing may be restarted
    or drained for the 30 s it is followed.

    minReplicas is 2 until the load is in place and 1 after, with no scale-down delay: from
    then on only the unknown load holds the second replica (an idle pair at minReplicas 1
    would rightly be scaled down at the autoscaler's next round, before the fault)."""
    bed.nodes(gpus_per_node=3)
    bed.create("row", replicas=2, health=health,
               autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 2,
                            "scaleDownDelaySeconds": 0})
    pods = bed.wait_ready("row", 2)
    busy = pods[0]
    start = time.time()
    bed.fault(busy, [{"fault": "load", "max_running": 2, "service_seconds": 5},
                     {"fault": "slow_metrics", "seconds": 3}])
    requests = [threading.Thread(target=complete, args=(busy.status.pod_ip,), daemon=True)
                for _ in range(8)]  # 2 running, 6 queued, 5 s each
    for thread in requests:
        thread.start()
    time.sleep(SCRAPE_SETTLE_S)  # every round from here on sees the busy pod's /metrics time out
    bed.patch_spec("row", {"autoscaling": {"minReplicas": 1}})
    seen = bed.follow("row", 2, set(), start, until=lambda: False, timeout=30, settle=0)
    body = bed.get("row")
    seen.notes.update(
        out_of_service=[p.metadata.name for p in bed.pods("row") if (
            p.metadata.labels or {}).get(children.IN_SERVICE_LABEL) == "false"],
        replicas=body["spec"]["replicas"],
        autoscaling=(body.get("status") or {}).get("autoscaling"))
    return seen


def complete(ip: str, max_tokens: int = 1) -> None:
    """One completion, answered or not (the caller only needs the pod busy)."""
    with contextlib.suppress(OSError):
        post(ip, "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": max_tokens})


def restarts(bed: Bed, name: str) -> int:
    """The Restarts the operator decided: each is counted once in the VLMDeployment's
    remediation history, whatever rungs its recovery took (a fence, then the kubelet's
    in-place restart, or a new pod once that failed)."""
    annotations = bed.get(name)["metadata"].get("annotations") or {}
    return len(incidents.parse_history(annotations.get(incidents.HISTORY)))


def crash_loop(bed: Bed, health: dict | None) -> Observed:
    """Every container's engine dies at start: restarted until the budget (2) is spent, then
    Degraded and left to the kubelet; a raised budget lets the operator act again."""
    bed.nodes(gpus_per_node=2)
    die = {"fault": "engine_dead", "after": 2, "exit_code": 1, "exit_delay": 1}
    bed.create("row", replicas=1, health=merged({"maxRestartsPerHour": 2}, health),
               env=[{"name": "VLM_SIM_FAULT", "value": json.dumps(die)}])
    start = time.time()
    seen = bed.follow("row", 1, set(), start, until=lambda: restarts(bed, "row") >= 2
                      and bed.condition("row", "Degraded").get("status") == "True",
                      timeout=max(90.0, bed.limit_s), settle=15)  # minutes at real start costs
    seen.notes["restarts_at_budget"] = restarts(bed, "row")
    seen.notes["degraded"] = bed.condition("row", "Degraded")
    bed.patch_spec("row", {"health": {"maxRestartsPerHour": 4}})
    bed.follow("row", 1, set(), time.time(), until=lambda: restarts(bed, "row")
               > seen.notes["restarts_at_budget"], timeout=max(60.0, bed.limit_s), settle=0)
    seen.notes["restarts_after_raise"] = restarts(bed, "row")
    seen.recovered_s = None  # a pod that crashes at every start never serves
    return seen


def storm_under_load(replicas: int, health: dict | None = None):
    """A retry storm on one pod while steady load goes through the Service: a Replace (the
    only replica, a GPU free) or a ScaleDown (1 of 2) must fail no request."""
    def run(bed: Bed, row_health: dict | None) -> Observed:
        bed.nodes(gpus_per_node=replicas + 1)
        bed.create("row", replicas=replicas, health=merged(health, row_health))
        pods = bed.wait_ready("row", replicas)
        load = bed.load("row")
        bed.wait("load on every pod", lambda: load.result()["endpoints_used"] >= replicas)
        faulted = {instance(pods[0])}
        start = time.time()
        bed.fault(pods[0], {"fault": "tokenizer_retry", "rate": 20})
        target = 1 if health else replicas  # a ScaleDown lowers the replicas
        seen = bed.follow("row", target, faulted, start, until=lambda: not any(
            p.metadata.uid == pods[0].metadata.uid for p in bed.pods("row")) and len(
            bed.ready("row")) >= target, settle=3)
        load.stop()
        seen.notes["load"] = load.result()
        seen.notes["replicas"] = bed.get("row")["spec"]["replicas"]
        return seen
    return run


def storms_on_two_pods_one_gpu(bed: Bed, health: dict | None) -> Observed:
    """2 replicas, minAvailable 2, one GPU free: retry storms on both pods at once. One surge
    at a time: the second waits for capacity (held, the condition says so) and goes on once
    the first replacement is done and its sick pod freed its GPU; each incident counted once
    in the restart budget."""
    bed.nodes(gpus_per_node=3)
    bed.create("row", replicas=2, health=merged({"minAvailable": 2}, health))
    pods = bed.wait_ready("row", 2)
    faulted = {instance(p) for p in pods}
    start = time.time()
    for pod in pods:
        bed.fault(pod, {"fault": "tokenizer_retry", "rate": 20})
    surging, held = [0], []

    def done() -> bool:
        records = bed.in_flight("row")
        surging[0] = max(surging[0], sum(1 for r in records.values() if r.surge))
        remediating = bed.condition("row", "Remediating")
        if "held back" in remediating.get("message", "") and not held:
            held.append(remediating)
        uids = {p.metadata.uid for p in bed.pods("row")}
        return not any(p.metadata.uid in uids for p in pods)

    seen = bed.follow("row", 2, faulted, start, until=done, timeout=max(150.0, bed.limit_s),
                      settle=3)  # two replacements, one after the other
    body = bed.get("row")
    seen.notes.update(most_surges_at_once=surging[0], held_condition=held[0] if held else None,
                      budget_entries=len(incidents.parse_history(
                          body["metadata"].get("annotations", {}).get(incidents.HISTORY))),
                      in_flight_left=len(bed.in_flight("row")))
    return seen
