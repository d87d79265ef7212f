"""The threads that drive the actions taking more than one step (Replace: surge a replica, drain
and delete the sick pod once the replacement is ready; ScaleDown: drain, delete, lower
replicas). Each is recorded on the VLMDeployment (incidents.IN_FLIGHT) before its first step,
and each step is chosen afresh (remediation/steps.py) from what the cluster shows. So a fresh
operator process (a restart, a standby taking over) finishes or undoes them from the cluster
alone, and never repeats a step that took effect."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from kubernetes.client.exceptions import ApiException

from vlm_operator.api.reports import Event
from vlm_operator.desired import children
from vlm_operator.engine import reader
from vlm_operator.k8s.pods import is_active, is_running, unschedulable_s
from vlm_operator.remediation import actions, drains, events, guards, steps
from vlm_operator.remediation.incidents import (
    NODE_DRAIN,
    SCALE_DOWN,
    InFlight,
    parse_in_flight,
    pending_claims,
    replacements,
    stamp,
)
from vlm_operator.remediation.intake import Owner
from vlm_operator.remediation.policy import backoff_s, health_policy_from_spec
from vlm_operator.remediation.steps import Step

if TYPE_CHECKING:
    from vlm_operator.remediation.remediator import Remediator

log = logging.getLogger(__name__)

STEP_S = 1.0  # in-flight actions look at the cluster again this often


class InFlightDriver:
    """One thread per in-flight action, taking its steps until it is done."""

    def __init__(self, rem: Remediator) -> None:
        self.rem = rem
        self.kube = rem.kube
        self._lock = threading.Lock()
        self._running: set[str] = set()  # pod uids with a thread driving their action
        # pod uid -> when its pod was first seen gone while its Deployment still counted it
        self._uncounted: dict[str, float] = {}

    def drive(self, namespace: str, name: str, uid: str) -> None:
        with self._lock:
            if uid in self._running or self.rem.stopped.is_set():
                return
            self._running.add(uid)
        threading.Thread(target=self._steps, args=(namespace, name, uid), daemon=True,
                         name=f"in-flight {namespace}/{name}").start()

    def _steps(self, namespace: str, name: str, uid: str) -> None:
        owner = self.rem.owner(namespace, name)
        try:
            while not self.rem.stopped.is_set():
                try:
                    if self.rem.may_act(namespace):
                        with owner.lock:
                            if self.step(namespace, name, owner, uid):
                                return
                except ApiException as exc:
                    log.warning("%s/%s: in-flight action on %s: %s %s", namespace, name, uid,
                                exc.status, exc.reason)
                except Exception:
                    log.exception("%s/%s: in-flight action on %s failed", namespace, name, uid)
                self.rem.stopped.wait(STEP_S)
        finally:
            with self._lock:
                self._running.discard(uid)
                self._uncounted.pop(uid, None)

    def step(self, namespace: str, name: str, owner: Owner, uid: str) -> bool:
        """One step of the action on pod `uid`, chosen from the cluster as it is now; True when
        there is nothing left to do (owner.lock held)."""
        body = self.kube.get_vlmd(namespace, name)
        record = parse_in_flight((body or {}).get("metadata", {}).get("annotations")).get(uid)
        if body is None or record is None:
            return True
        owner.in_flight = parse_in_flight(body["metadata"].get("annotations"))
        pods = self.kube.list_pods(namespace, children.get_selector(name))
        pod = next((p for p in pods if p["metadata"]["uid"] == uid), None)
        present = pod is not None and not pod["metadata"].get("deletionTimestamp")
        now = time.time()
        if not present and not steps.settled(pod, now):
            return False  # terminating: the count drops once the ReplicaSet saw it go
        lowers = record.action == SCALE_DOWN or record.surge  # spec.replicas drops at the end
        if not present and lowers and not self._counted_out(namespace, name, body, record,
                                                            pods, now):
            return False
        at = _At(namespace, name, owner, body, record, pods, pod, present, now)
        if record.action == SCALE_DOWN:
            return self._scale_down_step(at)
        return self._replace_step(at)

    def _counted_out(self, namespace: str, name: str, body: dict, record: InFlight,
                     pods: list[dict], now: float) -> bool:
        """The action's pod has left: whether the replicas may drop now (steps.counted_out),
        or steps.COUNTED_WAIT_S passed since this process first saw it gone and still counted.
        Read afresh at each step, so a fresh operator process waits the same way."""
        deployment = self.kube.get("apps/v1", "Deployment", namespace, name)
        if deployment is not None and not children.is_controlled_by(
                deployment, body["metadata"].get("uid")):
            deployment = None  # another app's: no ReplicaSet of it holds our pods
        active = sum(1 for p in pods if is_active(p))
        if steps.counted_out(deployment, active):
            self._uncounted.pop(record.uid, None)
            return True
        first = self._uncounted.setdefault(record.uid, now)
        status = deployment.get("status") or {}  # counted_out: None is counted out
        seen = (f"Deployment {name} still counts {status.get('replicas', 0)} replicas "
                f"(generation {status.get('observedGeneration', 0)} of "
                f"{deployment['metadata'].get('generation', 0)}) for {active} active pods")
        if first == now:
            log.info("%s/%s: %s has left, but %s: its replicas drop once the ReplicaSet has "
                     "seen it go", namespace, name, record.pod, seen)
        if now - first < steps.COUNTED_WAIT_S:
            return False
        log.warning("%s/%s: %.0f s after %s left, %s (is kube-controller-manager running?): "
                    "lowering its replicas anyway", namespace, name, now - first, record.pod,
                    seen)
        self._uncounted.pop(record.uid, None)
        return True

    def _replace_step(self, at: _At) -> bool:
        rem, owner, record, pods, pod, now = at.rem_args(self)
        namespace, name, body, present = at.namespace, at.name, at.body, at.present
        found = replacements(owner.in_flight, pods).get(record.uid, "")
        if record.surge and found != record.replacement:  # seen (or lost): on the record
            record = dataclasses.replace(record, replacement=found)
            rem.write_in_flight(namespace, name, owner, add=record)
        views = {p["metadata"]["uid"]: guards.pod_view(
            p, rem.engine_dead(p["metadata"]["uid"]), p["metadata"]["uid"] in owner.in_flight)
            for p in pods}
        serves = present and views[record.uid].serves
        others = guards.others_ready(views.values(), record.pod)
        replacement = next((p for p in pods if p["metadata"]["uid"] == found), None)
        running = None
        if record.drain_since is not None and present:
            actions.take_out_of_service(self.kube, namespace, pod)
            if serves and now - record.drain_since >= steps.DRAIN_MIN_S:
                running = reader.requests_in_flight(reader.pod_ip(pod))
        leaving = drains.leaving_nodes(rem)
        node = (pod.get("spec") or {}).get("nodeName") if pod else None
        spare = None
        if not record.surge and record.drain_since is None and serves:
            spare = rem.spare_gpus(owner, pending_claims(owner.in_flight, pods))
        policy = owner.policy or health_policy_from_spec(body.get("spec") or {})
        step = steps.replace_step(
            record=record, present=present, serves=serves, running=running,
            others_ready=others, min_available=policy.min_available,
            replacement_ready=bool(found) and views[found].serves,
            unschedulable_s=unschedulable_s(replacement, now) if replacement else 0.0,
            replicas=int(body["spec"].get("replicas", 1)),
            leaving=leaving is not None and node in leaving, spare_gpus=spare, now=now,
            timeout_s=rem.replace_timeout_s, drain_timeout_s=rem.drain_timeout_s,
            node_drain_wait_s=rem.node_drain_wait_s,
            unschedulable_limit_s=rem.unschedulable_limit_s)
        if step == Step.WAIT:
            return False
        if step in (Step.TAKE_OUT, Step.LET_GO):
            rem.write_in_flight(namespace, name, owner, add=dataclasses.replace(
                record, drain_since=stamp(now)))
            actions.take_out_of_service(self.kube, namespace, pod)
            if step == Step.LET_GO:
                text = (f"{record.pod}: its node {record.node} has been leaving for "
                        f"{now - record.node_since:.0f} s (--node-drain-wait-seconds="
                        f"{rem.node_drain_wait_s:g}) and no replacement serves: draining it, "
                        "then deleting it so the node drain can finish")
                log.warning("%s/%s: %s", namespace, name, text)
                events.post(self.kube, namespace, name, pod,
                            Event("Warning", "NodeDrainWaitExpired", text), body)
            rem.reconcile(namespace, name)  # Remediating: draining
            return False
        if step == Step.DELETE:  # the surge ends once the pod has left (settled)
            self._delete_drained(at, record, serves, running)
            return False
        if step == Step.SURGE:
            rem.write_in_flight(namespace, name, owner, add=dataclasses.replace(
                record, surge=True, since=stamp(now), before=actions.pod_uids(pods),
                replicas=int(body["spec"].get("replicas", 1))))
            text = (f"{record.pod}: its node {record.node} is being drained and minAvailable="
                    f"{policy.min_available} protects it: bringing up a replacement elsewhere "
                    "first")
            log.info("%s/%s: %s", namespace, name, text)
            events.post(self.kube, namespace, name, pod, Event("Normal", "PodReplacing", text),
                        body)
            rem.reconcile(namespace, name)  # the Deployment surges
            return False
        done = not (record.signature == NODE_DRAIN and step in (Step.GIVE_UP, Step.ABANDON))
        if done:
            rem.write_in_flight(namespace, name, owner, remove=record.uid)
        else:  # no surge again: the pod waits for its node drain's limit
            rem.write_in_flight(namespace, name, owner, add=dataclasses.replace(
                record, surge=False, before=(), replacement="", tried=True))
        self._tell_step_end(at, record, step)
        rem.reconcile(namespace, name)  # the Deployment drops its extra replica
        return done

    def _tell_step_end(self, at: _At, record: InFlight, step: Step) -> None:
        """Events for a Replace that ended without replacing its pod."""
        event = events.replace_ended(record, step, replicas=int(at.body["spec"].get("replicas",
                                                                                     1)),
                                     now=at.now, node_drain_wait_s=self.rem.node_drain_wait_s)
        if event is None:
            return
        if step == Step.GIVE_UP:
            attempts = at.owner.backoff.get(record.uid, (0, None))[0] + 1
            at.owner.backoff[record.uid] = (attempts, at.now + backoff_s(attempts))
        (log.warning if event.type == "Warning" else log.info)("%s/%s: %s", at.namespace,
                                                               at.name, event.message)
        events.post(self.kube, at.namespace, at.name, at.pod, event, at.body)

    def _delete_drained(self, at: _At, record: InFlight, serves: bool,
                        running: float | None) -> None:
        """Delete a Replace's pod: it serves nothing, or its drain is over."""
        namespace, name, now = at.namespace, at.name, at.now
        if serves and running != 0:
            text = events.drain_timed_out(record.pod, now - record.drain_since, running)
            log.warning("%s/%s: %s", namespace, name, text)
            events.post(self.kube, namespace, name, at.pod,
                        Event("Warning", "DrainTimedOut", text), at.body)
        actions.delete_quickly(self.kube, namespace, pod=record.pod, uid=record.uid)
        text = (f"deleted {record.pod}: drained, its replacement serves"
                if record.drain_since is not None and record.signature != NODE_DRAIN
                else f"deleted {record.pod}: drained" if record.drain_since is not None
                else f"deleted {record.pod}: it no longer serves")
        log.info("%s/%s: %s", namespace, name, text)
        events.post(self.kube, namespace, name, at.pod, Event("Normal", "PodReplaced", text),
                    at.body)

    def _scale_down_step(self, at: _At) -> bool:
        rem, owner, record, _, pod, now = at.rem_args(self)
        namespace, name, body, present = at.namespace, at.name, at.body, at.present
        if present:
            actions.take_out_of_service(self.kube, namespace, pod)
        serving = present and is_running(pod)
        running = None
        if serving and now - record.since >= steps.DRAIN_MIN_S:
            running = reader.requests_in_flight(reader.pod_ip(pod))
        step = steps.scale_down_step(present=present, serving=serving, running=running,
                                     since=record.since, now=now,
                                     timeout_s=rem.drain_timeout_s)
        if step == Step.WAIT:
            return False
        if step == Step.DELETE:
            if serving and running != 0:
                text = events.drain_timed_out(record.pod, now - record.since, running)
                log.warning("%s/%s: %s", namespace, name, text)
                events.post(self.kube, namespace, name, pod,
                            Event("Warning", "DrainTimedOut", text), body)
            actions.delete_quickly(self.kube, namespace, pod=record.pod, uid=record.uid)
            return False  # lowered once the pod has left (settled)
        current = int(body["spec"].get("replicas", 1))
        min_available = owner.policy.min_available if owner.policy else 1
        target = steps.lowered_replicas(current, record, min_available)
        if target is not None:
            self.kube.scale_vlmd(namespace, name, target)
            text = f"drained and deleted {record.pod}, replicas {current} -> {target}"
        else:
            text = (f"drained and deleted {record.pod}; replicas kept at {current} "
                    f"(spec.health.minAvailable={min_available}"
                    + (")" if current == record.replicas else
                       f"; spec.replicas changed from {record.replicas} meanwhile)"))
        rem.write_in_flight(namespace, name, owner, remove=record.uid)
        log.info("%s/%s: %s", namespace, name, text)
        events.post(self.kube, namespace, name, pod, Event("Normal", "ScaledDown", text), body)
        rem.reconcile(namespace, name)
        return True


@dataclasses.dataclass(frozen=True, slots=True)
class _At:
    """What one step reads from the cluster, read once."""

    namespace: str
    name: str
    owner: Owner
    body: dict
    record: InFlight
    pods: list[dict]
    pod: dict | None
    present: bool
    now: float

    def rem_args(self, driver: InFlightDriver) -> tuple:
        return driver.rem, self.owner, self.record, self.pods, self.pod, self.now
