"""The workers that drive the actions taking more than one step (Replace: surge a replica, drain
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

from kubernetes.client.exceptions import ApiException

from vlm_operator.api.actions import Action, UnknownAction
from vlm_operator.api.reports import Event
from vlm_operator.desired import children
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.podreads import reader
from vlm_operator.remediation import actions, drains, events, guards, steps
from vlm_operator.remediation.context import ActionContext
from vlm_operator.remediation.incidents import (
    NODE_DRAIN,
    InFlight,
    InFlightRead,
    parse_in_flight,
    pending_claims,
    read_in_flight,
    replacements,
    stamp,
)
from vlm_operator.remediation.intake import Owner
from vlm_operator.remediation.policy import backoff_s, health_policy_from_spec
from vlm_operator.remediation.steps import Step

log = logging.getLogger(__name__)
Key = tuple[str, str]

STEP_S = 1.0  # in-flight actions look at the cluster again this often
# Records whose pod is not (or no longer) one of the VLMDeployment's, stepped in one pass: an
# action's last steps after its pod left, or a forged record, which finishes without a call
# on any pod; the rest wait for the next pass
GONE_PER_PASS = 4


class InFlightDriver:
    """One worker per VLMDeployment with actions in flight, taking one step of each of its
    records every STEP_S until none is left. The records are the tenant's to edit: at most
    MAX_IN_FLIGHT are read, and a step acts only on pods whose owner chain leads to the
    VLMDeployment (Kube.list_pods); a record naming any other uid finds no pod and is
    finished without touching one, GONE_PER_PASS of them a pass."""

    def __init__(self, rem: ActionContext) -> None:
        self.rem = rem
        self.kube = rem.kube
        self._lock = threading.Lock()
        self._running: set[Key] = set()  # VLMDeployments with a worker driving their actions
        self._again: set[Key] = set()  # asked to drive while their worker was finishing
        self._told: dict[Key, tuple[bool, int]] = {}  # what was said about dropped records
        # pod uid -> when its pod was first seen gone while its Deployment still counted it
        self._uncounted: dict[str, float] = {}

    def drive(self, namespace: str, name: str) -> None:
        """Make sure a worker drives the actions recorded on the VLMDeployment."""
        key = (namespace, name)
        with self._lock:
            if self.rem.stopped.is_set():
                return
            if key in self._running:
                self._again.add(key)
                return
            self._running.add(key)
        threading.Thread(target=self._work, args=key, daemon=True,
                         name=f"in-flight {namespace}/{name}").start()

    def _work(self, namespace: str, name: str) -> None:
        key, owner = (namespace, name), self.rem.owner(namespace, name)
        try:
            while not self.rem.stopped.is_set():
                left = True
                try:
                    if self.rem.may_act(namespace):
                        with owner.lock:
                            left = self.steps(namespace, name, owner)
                except ApiException as exc:
                    log.warning("%s/%s: in-flight actions: %s %s", namespace, name,
                                exc.status, exc.reason)
                except Exception:
                    log.exception("%s/%s: in-flight actions failed", namespace, name)
                if not left:
                    with self._lock:
                        if key not in self._again:
                            self._running.discard(key)
                            return
                        self._again.discard(key)
                    continue
                self.rem.stopped.wait(STEP_S)
        finally:
            with self._lock:
                self._running.discard(key)
                self._again.discard(key)

    def steps(self, namespace: str, name: str, owner: Owner) -> bool:
        """One step of each action recorded on the VLMDeployment, each isolated from the
        others (owner.lock held); True while any is left."""
        body = self.kube.get_vlmd(namespace, name)
        if body is None:
            return False
        read = read_in_flight(Body(body).annotations)
        self.tell_dropped(namespace, name, read, body)
        if not read.records:
            return False
        owned = {Pod(p).uid for p in self.kube.list_pods(
            namespace, children.get_selector(name))}
        gone = [uid for uid in read.records if uid not in owned]
        left = len(gone) > GONE_PER_PASS
        for uid in [*(uid for uid in read.records if uid in owned), *gone[:GONE_PER_PASS]]:
            try:
                if self.step(namespace, name, owner, uid):
                    self._uncounted.pop(uid, None)
                    continue
            except ApiException as exc:
                log.warning("%s/%s: in-flight action on %s: %s %s", namespace, name, uid,
                            exc.status, exc.reason)
            except Exception:
                log.exception("%s/%s: in-flight action on %s failed", namespace, name, uid)
            left = True
        return left

    def tell_dropped(self, namespace: str, name: str, read: InFlightRead,
                     body: dict) -> None:
        """A warning and an Event, once for each new finding, when records were dropped or name
        an action this operator does not know."""
        unknown = tuple(sorted({str(e.get("action"))[:64] for e in read.unknown.values()}))
        key, seen = (namespace, name), (read.unreadable, read.dropped, unknown)
        with self._lock:
            if seen == (False, 0, ()):
                self._told.pop(key, None)
                return
            if self._told.get(key) == seen:
                return
            self._told[key] = seen
        for event in events.in_flight_read(read, unknown):
            log.warning("%s/%s: %s", namespace, name, event.message)
            events.post(self.kube, namespace, name, None, event, body)

    def step(self, namespace: str, name: str, owner: Owner, uid: str) -> bool:
        """One step of the action on pod `uid`, chosen from the cluster as it is now; True when
        there is nothing left to do (owner.lock held)."""
        body = self.kube.get_vlmd(namespace, name)
        record = parse_in_flight((body or {}).get("metadata", {}).get("annotations")).get(uid)
        if body is None or record is None:
            return True
        owner.in_flight = parse_in_flight(Body(body).annotations)
        pods = self.kube.list_pods(namespace, children.get_selector(name))
        pod = next((p for p in pods if Pod(p).uid == uid), None)
        present = pod is not None and not Pod(pod).deleting
        now = time.time()
        if not present and not steps.settled(pod, now):
            return False  # terminating: the count drops once the ReplicaSet saw it go
        # spec.replicas drops at the end
        lowers = record.action == Action.SCALE_DOWN or record.surge
        if not present and lowers and not self._counted_out(namespace, name, body, record,
                                                            pods, now):
            return False
        at = _At(namespace, name, owner, body, record, pods, pod, present, now)
        match record.action:
            case Action.SCALE_DOWN:
                return self._scale_down_step(at)
            case Action.REPLACE:
                return self._replace_step(at)
        raise UnknownAction(record.action, f"the in-flight record of {record.pod}")

    def _counted_out(self, namespace: str, name: str, body: dict, record: InFlight,
                     pods: list[dict], now: float) -> bool:
        """The action's pod has left: whether the replicas may drop now (steps.counted_out),
        or steps.COUNTED_WAIT_S passed since this process first saw it gone and still counted.
        Read afresh at each step, so a fresh operator process waits the same way."""
        deployment = self.kube.get("apps/v1", "Deployment", namespace, name)
        if deployment is not None and not children.is_controlled_by(
                deployment, Body(body).uid):
            deployment = None  # another app's: no ReplicaSet of it holds our pods
        active = sum(1 for p in pods if Pod(p).active)
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
        standings = {Pod(p).uid: guards.standing(
            p, rem.engine_dead(Pod(p).uid), Pod(p).uid in owner.in_flight)
            for p in pods}
        serves = present and standings[record.uid].serves
        others = guards.others_ready(standings.values(), record.pod)
        replacement = next((p for p in pods if Pod(p).uid == found), None)
        running = None
        if record.drain_since is not None and present:
            actions.take_out_of_service(self.kube, namespace, pod)
            if serves and now - record.drain_since >= steps.DRAIN_MIN_S:
                running = reader.requests_in_flight(Pod(pod).pod_ip)
        leaving = drains.leaving_nodes(rem)
        node = Pod(pod).node_name if pod else None
        spare = None
        if not record.surge and record.drain_since is None and serves:
            spare = rem.spare_gpus(owner, pending_claims(owner.in_flight, pods))
        policy = owner.policy or health_policy_from_spec(body.get("spec") or {})
        step = steps.replace_step(
            record=record, present=present, serves=serves, running=running,
            others_ready=others, min_available=policy.min_available,
            replacement_ready=bool(found) and standings[found].serves,
            unschedulable_s=Pod(replacement).unschedulable_s(now) if replacement else 0.0,
            replicas=int(body["spec"].get("replicas", 1)),
            leaving=None if leaving is None else node in leaving,
            draining=leaving is not None and node in leaving and leaving[node].drain,
            spare_gpus=spare, now=now,
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
                text = (f"{record.pod}: its node {record.node} has shown a drain for "
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
        self._tell_step_end(at, record, step, bool(found) and standings[found].serves)
        rem.reconcile(namespace, name)  # the Deployment drops its extra replica
        return done

    def _tell_step_end(self, at: _At, record: InFlight, step: Step,
                       replacement_serves: bool) -> None:
        """Events for a Replace that ended without the operator deleting its pod."""
        event = events.replace_ended(record, step, replicas=int(at.body["spec"].get("replicas",
                                                                                     1)),
                                     now=at.now, node_drain_wait_s=self.rem.node_drain_wait_s,
                                     replacement_serves=replacement_serves)
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
        told = record.deleted  # a fresh operator deleting again says it once
        self.rem.write_in_flight(namespace, name, at.owner,
                                 add=dataclasses.replace(record, deleted=True))
        actions.delete_quickly(self.kube, namespace, pod=record.pod, uid=record.uid)
        if told:
            return
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
        serving = present and Pod(pod).running
        running = None
        if serving and now - record.since >= steps.DRAIN_MIN_S:
            running = reader.requests_in_flight(Pod(pod).pod_ip)
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
