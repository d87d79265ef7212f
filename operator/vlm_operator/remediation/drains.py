"""Node drains: a round also looks for the VLMDeployment's pods on nodes that are leaving
(k8s/nodes.py, leaving: cordoned, or showing a drain: tainted by the cluster autoscaler or
Karpenter, or carrying a drain marker the admin names). A pod whose eviction minAvailable
refuses gets a Replace of its own (guards.node_drain_action): a replacement elsewhere first when
a GPU is free, else it waits for capacity. On a node that shows a drain it waits at most
node_drain_wait_s from when the drain was first seen (past it only for a replacement already
on its way); then it is drained and deleted, so a drain never waits for ever. A cordon alone
stops new pods, not old ones: the pod moves when a replacement serves elsewhere, and is never
let go without one. The pod is drained and deleted by the operator itself once its replacement
is ready (the budget would let the eviction through then too; the pod's preStop drains it
either way): one path, the same as for a sick pod (remediation/in_flight.py), with Events and a
condition on the way."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from vlm_operator.api.actions import Action
from vlm_operator.api.reports import Event
from vlm_operator.desired import children
from vlm_operator.k8s.informer import Stale
from vlm_operator.k8s.nodes import Leaving
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.remediation import actions, events, guards
from vlm_operator.remediation.context import ActionContext
from vlm_operator.remediation.incidents import (
    NODE_DRAIN,
    InFlight,
    parse_in_flight,
    pending_claims,
    stamp,
)
from vlm_operator.remediation.intake import Owner
from vlm_operator.remediation.policy import HealthPolicy
from vlm_operator.remediation.steps import Step

log = logging.getLogger(__name__)


def leaving_nodes(rem: ActionContext) -> Mapping[str, Leaving] | None:
    """Nodes that are leaving (None: not known, or not looked for)."""
    if rem.leaving_nodes is None:
        return None
    try:
        return rem.leaving_nodes()
    except Stale as exc:
        log.debug("leaving nodes unknown: %s", exc)
        return None


def unnoted(record: InFlight, node: Leaving) -> bool:
    """Whether a Replace's record has yet to note that its pod's node is leaving, or that the
    node now shows a drain (its drain wait starts then)."""
    return record.action == Action.REPLACE and (
        not record.node or (node.drain and record.node_since is None))


def drain_work(pods: list[dict], records: Mapping[str, InFlight], *,
               leaving: Mapping[str, Leaving], policy: HealthPolicy,
               engine_dead: Callable[[str], bool], always_allow: bool) -> bool:
    """Whether a pod on a leaving node needs something this round: an action of its own, or
    its Replace record has yet to note the node (from the round's pods: the check is redone on
    a fresh read before acting)."""
    standings = [guards.standing(p, engine_dead(Pod(p).uid),
                             Pod(p).uid in records) for p in pods]
    for pod, standing in zip(pods, standings, strict=True):
        node = leaving.get(Pod(pod).node_name)
        if node is None:
            continue
        record = records.get(Pod(pod).uid)
        if record is not None:
            if unnoted(record, node):
                return True
        elif _action(standing, standings, policy, always_allow, node) is not None:
            return True
    return False


def _action(standing: guards.Standing, standings: list[guards.Standing], policy: HealthPolicy,
            always_allow: bool, node: Leaving) -> str | None:
    """guards.node_drain_action, but a pod that serves nothing is deleted only on a drain: a
    cordon alone evicts nothing, and the pod may be loading (deleting it loses the load)."""
    action = guards.node_drain_action(standing, standings, policy, always_allow)
    return None if action == Step.DELETE and not node.drain else action


def on_round(rem: ActionContext, body: dict, pods: list[dict]) -> None:
    """The round's look for the VLMDeployment's pods on leaving nodes (body, pods: the
    round's snapshot, from the watch-fed cache); acted on after a fresh read."""
    meta = Body(body)
    namespace, name = meta.namespace, meta.name
    records = parse_in_flight(meta.annotations)
    leaving = leaving_nodes(rem)
    if not leaving or not any(Pod(p).node_name in leaving
                              for p in pods):
        return
    owner = rem.owner(namespace, name)
    if owner.policy is None:
        rem.refresh(namespace, name)
    if owner.policy is not None and drain_work(
            pods, records, leaving=leaving, policy=owner.policy, engine_dead=rem.engine_dead,
            always_allow=rem.kube.pdb_unhealthy_pod_eviction):
        with owner.lock:  # decided again on what the cluster shows now
            node_drains(rem, owner, leaving=leaving)


def node_drains(rem: ActionContext, owner: Owner, *, leaving: Mapping[str, Leaving]) -> None:
    """The VLMDeployment's pods on leaving nodes, read afresh (owner.lock held)."""
    namespace, name = owner.namespace, owner.name
    body = rem.refresh(namespace, name)
    if body is None or owner.policy is None:
        return
    pods = rem.kube.list_pods(namespace, children.get_selector(name))
    records = parse_in_flight(Body(body).annotations)
    standings = [guards.standing(p, rem.engine_dead(Pod(p).uid),
                             Pod(p).uid in records) for p in pods]
    now = stamp(time.time())
    for pod, standing in zip(pods, standings, strict=True):
        uid, node = Pod(pod).uid, Pod(pod).node_name
        if node not in leaving:
            continue
        record = records.get(uid)
        if record is not None:
            if unnoted(record, leaving[node]):  # its drain limit starts with a drain seen
                rem.write_in_flight(namespace, name, owner, add=dataclasses.replace(
                    record, node=node, node_since=now if leaving[node].drain else None))
            continue
        action = _action(standing, standings, owner.policy, rem.kube.pdb_unhealthy_pod_eviction,
                         leaving[node])
        if action == Step.DELETE:
            _release(rem, pod, owner=owner, body=body, node=node, why=leaving[node].why)
        elif action == Action.REPLACE:
            _protect(rem, pod, owner=owner, body=body, pods=pods, node=node,
                     leaving=leaving[node], now=now)


def _release(rem: ActionContext, pod: dict, *, owner: Owner, body: dict, node: str,
             why: str) -> None:
    """A pod that serves nothing whose eviction the budget refuses: delete it."""
    namespace, name = owner.namespace, owner.name
    meta = Body(pod)
    if not actions.delete_quickly(rem.kube, namespace, pod=meta.name, uid=meta.uid):
        return
    text = (f"deleted {meta.name}: its node {node} is leaving ({why}) and it serves "
            "nothing, while the PodDisruptionBudget would refuse its eviction")
    log.info("%s/%s: %s", namespace, name, text)
    events.post(rem.kube, namespace, name, pod, Event("Normal", "NodeDrainReleased", text), body)


def _protect(rem: ActionContext, pod: dict, *, owner: Owner, body: dict, pods: list[dict],
             node: str, leaving: Leaving, now: float) -> None:
    """A serving pod minAvailable protects on a leaving node: a Replace of its own, with a
    surge when a replica fits elsewhere, else waiting for capacity (let go after the drain
    wait only on a node that shows a drain)."""
    namespace, name = owner.namespace, owner.name
    meta = Body(pod)
    records = parse_in_flight(Body(body).annotations)
    spare = rem.spare_gpus(owner, pending_claims(records, pods))
    record = InFlight(Action.REPLACE, meta.name, meta.uid, NODE_DRAIN, now, now,
                      int(body["spec"].get("replicas", 1)), surge=bool(spare),
                      before=actions.pod_uids(pods) if spare else (), node=node,
                      node_since=now if leaving.drain else None)
    rem.write_in_flight(namespace, name, owner, add=record)
    policy = owner.policy
    why = leaving.why
    if spare:
        kind, reason, text = "Normal", "PodReplacing", (
            f"{meta.name}: its node {node} is leaving ({why}) and minAvailable="
            f"{policy.min_available} protects it: bringing up a replacement elsewhere "
            "first; the eviction goes through once it serves")
    else:
        kind, reason, text = "Warning", "NodeDrainHeld", (
            f"{meta.name}: its node {node} is leaving ({why}) and minAvailable="
            f"{policy.min_available} protects it, but "
            + ("no GPU is free elsewhere" if spare is False else
               "the free GPUs cannot be read")
            + " for a replacement: " + (
                f"it keeps serving for up to {rem.node_drain_wait_s:g} s "
                "(--node-drain-wait-seconds) while capacity may come, then it is drained and "
                "deleted so the drain can finish" if leaving.drain else
                "it keeps serving; a cordon alone never removes it (a drain marker, "
                "--node-drain-markers, lets it go after --node-drain-wait-seconds)"))
    (log.warning if kind == "Warning" else log.info)("%s/%s: %s", namespace, name, text)
    events.post(rem.kube, namespace, name, pod, Event(kind, reason, text), body)
    rem.in_flight.drive(namespace, name)
    rem.reconcile(namespace, name)
