"""Rows about a node's cordon or drain under the only serving replica: `kubectl drain` with a
GPU free elsewhere or none, a cordon without a drain (never removes it), and a drain whose
replacement starts slower than the operator's drain wait (waited for: no serving gap)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vlm_testbed.realnode.imagebuild import PAUSE_IMAGE

from .bed import DRAIN_WAIT_S, instance

if TYPE_CHECKING:
    from .bed import Bed, Observed

# The drain marker the rows' operators are told of (--node-drain-markers), as maintenance
# tooling would label a node it is about to drain.
MARKER, MARKED = "e2e.vlm-operator.dev/maintenance", "drain"
SLOW_PULL_S = 3 * DRAIN_WAIT_S  # the image pull on a fresh node: outlasts the drain wait


def mark(bed: Bed, node: str) -> None:
    """Label `node` with the drain marker."""
    bed.core.patch_node(node, {"metadata": {"labels": {MARKER: MARKED}}})


def cordon(bed: Bed, node: str, on: bool) -> None:
    """What `kubectl cordon` (on) and `kubectl uncordon` do: spec.unschedulable."""
    bed.core.patch_node(node, {"spec": {"unschedulable": on}})


def place_blocker(bed: Bed, node: str) -> None:
    """A pod of another app holding the one GPU of `node` (the pause image: it sleeps, on a
    simulated node and on a real one)."""
    bed.core.create_namespaced_pod(bed.ns, {"metadata": {"name": "other-app"}, "spec": {
        "nodeName": node, "containers": [{
            "name": "app", "image": PAUSE_IMAGE,
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
    bed.wait("the other app running", lambda: bed.core.read_namespaced_pod(
        "other-app", bed.ns).status.phase == "Running")


def node_drain(gpu_free: bool):
    """`kubectl drain` of the node of the only replica (default spec: 1 replica, minAvailable
    1), two nodes of one GPU each, steady load on the Service. With the other GPU free the
    drain finishes with no serving gap (a replacement first), for a plain `kubectl drain`
    (a cordon: no marker needed to move to a free GPU); with it taken (another app) the node
    is labelled with the drain marker its operator is told of, and the drain is held
    DRAIN_WAIT_S (the operator's --node-drain-wait-seconds here), then goes through."""
    def run(bed: Bed, health: dict | None) -> Observed:
        if not gpu_free:
            bed.operator("--standalone", "--node-drain-wait-seconds", str(DRAIN_WAIT_S),
                         "--node-drain-markers", f"{MARKER}={MARKED}")
        sim = bed.nodes(gpus_per_node=1, nodes=2)
        bed.create("row", replicas=1, health=health)
        (pod,) = bed.wait_ready("row", 1)
        node = pod.spec.node_name
        if not gpu_free:
            place_blocker(bed, next(n for n in sim.node_names if n != node))
        load = bed.load("row")
        bed.wait("load on the pod", lambda: load.result()["answered"] >= 5)
        start = time.time()
        if not gpu_free:
            mark(bed, node)
        drain = bed.drain(node)
        held, finished = [], []

        def drained() -> bool:
            remediating = bed.condition("row", "Remediating")
            if remediating.get("reason") == "WaitingForCapacity" and not held:
                held.append(remediating)
            if drain.poll() is not None and not finished:
                finished.append(time.time())
            return bool(finished)

        seen = bed.follow("row", 1, {instance(pod)}, start, until=drained, timeout=150,
                          settle=2)
        load.stop()
        output = drain.communicate()[0] if finished else ""
        seen.notes.update(load=load.result(), drain_rc=drain.poll(),
                          drain_s=round(finished[0] - start, 1) if finished else None,
                          drain_output=output[-600:], held_condition=held[0] if held else None,
                          in_flight_left=len(bed.in_flight("row")))
        return seen
    return run


def cordon_without_drain(bed: Bed, health: dict | None) -> Observed:
    """A plain cordon (a GPU health tool or an admin stopping new work) of the node of the
    only replica (default spec: 1 replica, minAvailable 1), whose GPU it fills, the other
    node's GPU taken by another app, steady load; the operator's drain wait is DRAIN_WAIT_S.
    Watched for three drain waits, then uncordoned."""
    bed.operator("--standalone", "--node-drain-wait-seconds", str(DRAIN_WAIT_S))
    sim = bed.nodes(gpus_per_node=1, nodes=2)
    bed.create("row", replicas=1, health=health)
    (pod,) = bed.wait_ready("row", 1)
    node = pod.spec.node_name
    place_blocker(bed, next(n for n in sim.node_names if n != node))
    load = bed.load("row")
    bed.wait("load on the pod", lambda: load.result()["answered"] >= 5)
    start = time.time()
    cordon(bed, node, True)
    held = []

    def watched() -> bool:
        remediating = bed.condition("row", "Remediating")
        if remediating.get("reason") == "WaitingForCapacity" and not held:
            held.append(remediating)
        return time.time() - start >= 3 * DRAIN_WAIT_S

    seen = bed.follow("row", 1, set(), start, until=watched, timeout=120, settle=0)
    seen.notes.update(held_condition=held[0] if held else None,
                      events_cordoned=dict(seen.events),
                      in_flight_cordoned=len(bed.in_flight("row")))
    cordon(bed, node, False)
    cancelled = bed.holds(lambda: not bed.in_flight("row"), timeout=30)
    load.stop()
    seen.events = bed.events("row")
    seen.notes.update(load=load.result(), cancelled=cancelled,
                      serving=[p.metadata.uid for p in bed.ready("row")] == [pod.metadata.uid])
    return seen


def replacement_slower_than_the_drain_wait(bed: Bed, health: dict | None) -> Observed:
    """`kubectl drain` of the only replica's node, labelled with the drain marker first (the
    operator is told of it, its drain wait DRAIN_WAIT_S), a GPU free on a fresh node whose
    image pull (SLOW_PULL_S) makes the replacement start well after the drain wait ends,
    steady load."""
    bed.operator("--standalone", "--node-drain-wait-seconds", str(DRAIN_WAIT_S),
                 "--node-drain-markers", f"{MARKER}={MARKED}")
    bed.nodes(gpus_per_node=1, tag="a")
    bed.create("row", replicas=1, health=health)
    (pod,) = bed.wait_ready("row", 1)
    node = pod.spec.node_name
    bed.nodes(gpus_per_node=1, tag="fresh", image_pull_seconds=SLOW_PULL_S)
    load = bed.load("row")
    bed.wait("load on the pod", lambda: load.result()["answered"] >= 5)
    start = time.time()
    mark(bed, node)
    drain = bed.drain(node)
    finished, replacement = [], []

    def drained() -> bool:
        if not replacement and any(p.metadata.uid != pod.metadata.uid for p in bed.ready("row")):
            replacement.append(time.time())
        if drain.poll() is not None and not finished:
            finished.append(time.time())
        return bool(finished)

    seen = bed.follow("row", 1, {instance(pod)}, start, until=drained, timeout=150, settle=2)
    load.stop()
    output = drain.communicate()[0] if finished else ""
    seen.notes.update(load=load.result(), drain_rc=drain.poll(),
                      drain_s=round(finished[0] - start, 1) if finished else None,
                      replacement_ready_s=round(replacement[0] - start, 1) if replacement
                      else None, drain_output=output[-600:],
                      in_flight_left=len(bed.in_flight("row")))
    return seen
