"""The next step of an action that takes more than one (Replace, ScaleDown), chosen afresh
from what the cluster shows each time, so a fresh operator process finishes or undoes it from
the cluster alone. Pure: no I/O, times passed in."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from vlm_operator.desired import children, stopping
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.remediation.incidents import NODE_DRAIN, InFlight

DRAIN_MIN_S = float(stopping.ENDPOINTS_LAG_S)  # for the endpoints to drop a pod taken out
DRAIN_TIMEOUT_S = 60.0
# A replacement gets as long as the startup probe gives a model load (children.py), plus the
# time to schedule it: after that the surge is given up and the incident held.
REPLACE_TIMEOUT_S = children.STARTUP_PERIOD_SECONDS * children.STARTUP_FAILURE_THRESHOLD + 300


class Step(enum.StrEnum):
    """What an action in flight does next."""

    WAIT = "wait"  # nothing to do yet
    DELETE = "delete"  # delete the pod (drained, or it serves nothing)
    FINISH = "finish"  # the pod is gone: the action ends (a ScaleDown lowers the replicas)
    GIVE_UP = "give_up"  # no replacement came: the surge ends, the pod keeps serving
    SURGE = "surge"  # a node drain's pod: bring up a replacement elsewhere
    TAKE_OUT = "take_out"  # out of the Service to drain: the others keep minAvailable
    LET_GO = "let_go"  # a node drain waited its limit: drain the pod, then delete it
    ABANDON = "abandon"  # spec.replicas was lowered by another writer: the surge ends
    DROP = "drop"  # a node drain's pod needs nothing any more


# A replacement no node takes for this long: the surge is given up.
UNSCHEDULABLE_S = 60.0
# How long a drain of a node (the cluster autoscaler, Karpenter, a drain marker the admin names)
# is held for a pod minAvailable protects while no GPU is free elsewhere for its replacement;
# then the pod is drained and deleted, so no drain waits for ever (`vlm-operator run
# --node-drain-wait-seconds`). A replacement already started is waited for past it, at most
# REPLACE_TIMEOUT_S from its start. A cordon alone never lets the pod go.
NODE_DRAIN_WAIT_S = 600.0


def drain_step(*, serving: bool, running: float | None, since: float, now: float,
               timeout_s: float = DRAIN_TIMEOUT_S, min_drain_s: float = DRAIN_MIN_S) -> Step:
    """A pod out of the Service since `since`: DELETE once its requests finished, or it serves
    nothing, or the drain limit passed; else WAIT. running: requests in flight; None when
    /metrics could not be read, which is waited out like a busy pod (unknown is not zero). The
    first min_drain_s always pass: the endpoints must drop the pod before it counts as idle."""
    if now - since < min_drain_s:
        return Step.WAIT
    if not serving or running == 0 or now - since >= timeout_s:
        return Step.DELETE
    return Step.WAIT


SETTLE_S = 30.0  # past a deleted pod's deadline, it is taken as gone (a node that vanished)


def settled(pod: Mapping | None, now: float, settle_s: float = SETTLE_S) -> bool:
    """Whether a deleted pod has left for good: gone from the cluster, or settle_s past the
    deadline the kubelet had to stop it (deletionTimestamp). An action lowers the replica count
    only then: while the pod is terminating, a ReplicaSet that has not seen its deletion yet
    counts it, and lowering the count then can make it remove a pod that serves (with two Ready
    pods it removes the one Ready the shortest: the replacement)."""
    if pod is None:
        return True
    deadline = Pod(pod).deleted_at
    return deadline is not None and now >= deadline + settle_s


# How long a departed pod may stay counted by the Deployment's controllers before the replicas
# drop anyway: a kube-controller-manager that is down builds its caches from fresh lists when
# it returns, so lowering then cannot remove the wrong pod.
COUNTED_WAIT_S = 120.0


def counted_out(deployment: Mapping | None, active: int) -> bool:
    """Whether the Deployment's controllers have seen the action's pod go, so lowering
    spec.replicas now removes no pod that serves: its status (written by the ReplicaSet and
    Deployment controllers from their caches, for its current spec) counts no more replicas
    than the `active` pods the cluster holds. A ReplicaSet whose pod cache still holds the
    departed pod (its watch resumes late after an apiserver outage, or it is busy) would count
    one pod too many and, with both Ready, remove the one Ready the shortest: the replacement.
    None (no Deployment of ours: no ReplicaSet that could remove a pod) is True; a Deployment
    that could not be read never gets here (the step fails and is taken again)."""
    if deployment is None:
        return True
    status = deployment.get("status") or {}
    generation = Body(deployment).generation or 0
    if status.get("observedGeneration", 0) < generation:
        return False
    return int(status.get("replicas") or 0) <= active


def scale_down_step(*, present: bool, serving: bool, running: float | None, since: float,
                    now: float, timeout_s: float = DRAIN_TIMEOUT_S,
                    min_drain_s: float = DRAIN_MIN_S) -> Step:
    """The next step of a ScaleDown: wait for the drain, or delete the pod; FINISH (lower the
    replicas) once it is gone (the caller waits until it has `settled`)."""
    if not present:
        return Step.FINISH
    return drain_step(serving=serving, running=running, since=since, now=now,
                      timeout_s=timeout_s, min_drain_s=min_drain_s)


def replace_step(*, record: InFlight, present: bool, serves: bool, running: float | None,
                 others_ready: int, min_available: int, replacement_ready: bool,
                 unschedulable_s: float, replicas: int, leaving: bool | None,
                 draining: bool, spare_gpus: bool | None, now: float,
                 timeout_s: float = REPLACE_TIMEOUT_S,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S,
                 node_drain_wait_s: float = NODE_DRAIN_WAIT_S,
                 min_drain_s: float = DRAIN_MIN_S,
                 unschedulable_limit_s: float = UNSCHEDULABLE_S) -> Step:
    """The next step of a Replace, from what the cluster shows now:

    - the pod is gone: FINISH (the caller waits until it has `settled`);
    - it is out of the Service (record.drain_since): drain_step (requests finish first);
    - it serves nothing: DELETE (nothing to wait for);
    - a node drain's node no longer leaving (uncordoned, its marker gone): DROP, with its
      surge if one was started (the ReplicaSet removes the replacement); whether it still is
      cannot be read: WAIT (unknown is not "no longer leaving");
    - a surge started: TAKE_OUT once the others (with the replacement, once ready) keep
      minAvailable (drain first); ABANDON at once when spec.replicas went below the count it
      began with (HPA, KEDA, a user: the ReplicaSet removes the newest, not-ready pod first,
      the replacement); GIVE_UP when the scheduler refuses the replacement for
      unschedulable_limit_s (UNSCHEDULABLE_S; with a node autoscaler, its provisioning
      timeout) or none is ready in timeout_s (the startup probe's budget); else WAIT,
      past the node drain wait too: a replacement on its way is waited for, since letting the
      pod go before it serves would leave nothing ready;
    - no surge (a node drain waiting for capacity): DROP when the others now keep
      minAvailable (the eviction goes through by itself); LET_GO (drain it, then delete) when
      the node shows a drain (`draining`: not a cordon alone) and has since node_since for
      node_drain_wait_s; SURGE when a replica fits the free GPUs; else WAIT.

    running: the pod's requests in flight (None: unknown); replacement_ready: the replacement
    pod serves; unschedulable_s: how long the scheduler has refused the replacement; replicas:
    spec.replicas now; leaving: the pod's node is leaving now (None: unknown); draining: it
    shows a drain (k8s/nodes.py, leaving); spare_gpus: one more replica fits the free GPUs
    (None: unknown), asked only before a surge."""
    if not present:
        return Step.FINISH
    if record.drain_since is not None:
        return drain_step(serving=serves, running=running, since=record.drain_since, now=now,
                          timeout_s=drain_timeout_s, min_drain_s=min_drain_s)
    if not serves:
        return Step.DELETE
    if record.signature == NODE_DRAIN and not leaving:  # unknown is not "no longer leaving"
        return Step.WAIT if leaving is None else Step.DROP
    protected = others_ready < max(1, min_available)
    if record.surge:
        if not protected:
            return Step.TAKE_OUT
        if replicas < record.replicas and not replacement_ready:
            return Step.ABANDON
        if unschedulable_s >= unschedulable_limit_s or now - record.since >= timeout_s:
            return Step.GIVE_UP
        return Step.WAIT
    if not protected:
        return Step.DROP
    if (draining and record.node_since is not None
            and now - record.node_since >= node_drain_wait_s):
        return Step.LET_GO
    return Step.SURGE if spare_gpus and not record.tried else Step.WAIT


def lowered_replicas(current: int, record: InFlight, min_available: int) -> int | None:
    """spec.replicas after a ScaleDown removed its pod; None to leave it (someone changed it
    since the drain began, or it would go below minAvailable)."""
    if current != record.replicas:
        return None
    return scale_down_replicas(current, min_available)


def scale_down_replicas(current: int, min_available: int) -> int | None:
    """The replica count after a ScaleDown, or None when capacity must not be lowered."""
    target = current - 1
    return target if target >= max(min_available, 0) else None
