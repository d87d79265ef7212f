"""Acting on incidents: decide with remediation/decide.py, then restart, replace, drain or scale
down.

Thin: every decision is a pure function; this reads the cluster, asks, and makes the API calls.
Decisions and actions on one VLMDeployment's pods are serialised by its lock.

Incidents held back by a guard that may clear (minAvailable with no GPU for a replacement, the
restart budget, back-off, /health still 200) stay open and are decided again on pod events,
spec changes and every RECONSIDER_S, until acted on, gone or older than their window.

Actions that take more than one step (Replace: surge a replica, drain and delete the sick pod
once the replacement is ready; ScaleDown: drain, delete, lower replicas) are recorded on the
VLMDeployment (incidents.IN_FLIGHT) before their first step, and each step is chosen afresh from
what the cluster shows. So a fresh operator process (a restart, a standby taking over) finishes
or undoes them from the cluster alone, and never repeats a step that took effect: every round
(`round`, once a second on the active replica) makes sure each recorded action has a thread
driving it.

Node drains: a round also looks for the VLMDeployment's pods on nodes that are leaving
(cordoned, or tainted by the cluster autoscaler or Karpenter). A pod whose eviction
minAvailable refuses gets a Replace of its own (remediation.node_drain_action): a replacement
elsewhere first when a GPU is free, else it waits for capacity, at most node_drain_wait_s from
when the node was first seen leaving; then it is drained and deleted, so a drain never waits
for ever. The pod is drained and deleted by the operator itself once its replacement is ready
(the budget would let the eviction through then too; the pod's preStop drains it either way):
one path, the same as for a sick pod, with Events and a condition on the way.

Deletions: a pod that serves nothing, or that the operator drained itself, is deleted with a
short grace period (children.QUICK_GRACE_S); a pod that still serves (a Restart) with its own,
during which its preStop hook lets its requests finish.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping

from kubernetes.client.exceptions import ApiException

from vlm_operator.api import log_signatures
from vlm_operator.api.reports import Event, Report
from vlm_operator.api.validation import SpecError, VLMDeployment, parse
from vlm_operator.desired import children
from vlm_operator.engine import reader
from vlm_operator.k8s.caches import Stale
from vlm_operator.k8s.kube import Kube, now_iso
from vlm_operator.k8s.pods import is_running, parse_time
from vlm_operator.metrics import REMEDIATIONS, REMEDIATIONS_SKIPPED
from vlm_operator.remediation import decide as remediation
from vlm_operator.remediation import incidents
from vlm_operator.remediation.decide import Decision, Policy
from vlm_operator.remediation.incidents import (
    HISTORY,
    IN_FLIGHT,
    NODE_DRAIN,
    REPLACE,
    SCALE_DOWN,
    Incident,
    InFlight,
    acted_until,
    expired,
    history_value,
    in_flight_value,
    merged_history,
    parse_history,
    parse_in_flight,
    stamp,
)

log = logging.getLogger(__name__)

RECONSIDER_S = 3.0  # held incidents are decided again at least this often
STEP_S = 1.0  # in-flight actions look at the cluster again this often
CONFLICT_RETRIES = 5
Key = tuple[str, str]


class Owner:
    """Per-VLMDeployment state. `lock` serialises decisions and actions (held across API
    calls); what other threads read is replaced whole, never mutated in place."""

    def __init__(self, namespace: str, name: str) -> None:
        self.namespace, self.name = namespace, name
        self.lock = threading.Lock()
        self.policy: Policy | None = None
        self.vlmd: VLMDeployment | None = None
        self.extra: tuple[log_signatures.Signature, ...] = ()
        self.history: list[float] = []
        self.in_flight: dict[str, InFlight] = {}
        self.open: dict[Key, Incident] = {}  # (pod uid, policy key) -> incident
        self.held: dict[Key, Decision] = {}  # why each held incident waits
        self.backoff: dict[str, tuple[int, float]] = {}  # pod uid -> (attempts, until)
        self.told: set[tuple] = set()  # ((uid, key), first, reason) already reported
        # when a detection last had an incident decided (monotonic), and the VLMDeployment
        # last read: a flood of log lines costs no API call each
        self.decided: dict[Key, float] = {}
        self.refreshed_at = -math.inf


class Remediator:
    def __init__(self, kube: Kube, reconcile: Callable[[str, str], None], *,
                 may_act: Callable[[str], bool] | None = None,
                 replica_fits: Callable[[VLMDeployment, int], bool] | None = None,
                 engine_dead: Callable[[str], bool] = lambda uid: False,
                 leaving_nodes: Callable[[], Mapping[str, str]] | None = None,
                 drain_timeout_s: float = remediation.DRAIN_TIMEOUT_S,
                 replace_timeout_s: float = remediation.REPLACE_TIMEOUT_S,
                 node_drain_wait_s: float = remediation.NODE_DRAIN_WAIT_S) -> None:
        """`reconcile(ns, name)` publishes status (Reconciler.refresh, logs its own errors);
        `may_act(ns)`: whether this replica acts (k8s/peering.py; None: it runs alone);
        `replica_fits(vlmd, pending)`: one more replica fits the free GPUs after `pending`
        replicas of it not yet on a node took theirs (raises when unknown; None: never surge);
        `engine_dead(uid)`: the pod's log showed engine death in its current container;
        `leaving_nodes()`: node name -> why it is leaving (raises Stale when unknown; None:
        node drains are not looked for)."""
        self.kube = kube
        self.reconcile = reconcile
        self.may_act = may_act or (lambda namespace: True)
        self.replica_fits = replica_fits
        self.engine_dead = engine_dead
        self.leaving_nodes = leaving_nodes
        self.drain_timeout_s = drain_timeout_s
        self.replace_timeout_s = replace_timeout_s
        self.node_drain_wait_s = node_drain_wait_s
        self._owners: dict[Key, Owner] = {}
        self._lock = threading.Lock()
        self._running: set[str] = set()  # pod uids with a thread driving their action
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="reconsider")

    def start(self) -> Remediator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def owner(self, namespace: str, name: str) -> Owner:
        with self._lock:
            owner = self._owners.get((namespace, name))
            if owner is None:
                owner = self._owners[(namespace, name)] = Owner(namespace, name)
            return owner

    def known(self, namespace: str, name: str) -> Owner | None:
        with self._lock:
            return self._owners.get((namespace, name))

    def wake(self) -> None:
        """Something changed (a pod event, a spec change): decide held incidents again now."""
        self._wake.set()

    # -- inputs
    def report(self, namespace: str, name: str, *, uid: str, pod: str, signature: str,
               t: float, count: Callable[[str, float], int], detail: str = "") -> None:
        """A detection on pod `uid` at t: `count(key, window_s)` says how many fall in the
        rule's window (log watching keeps the windows). It joins the pod's open incident."""
        owner = self.owner(namespace, name)
        if owner.policy is None and _due(owner.refreshed_at):
            self.refresh(namespace, name)
        found = owner.policy.rule_for(signature) if owner.policy else None
        if found is None:
            return
        key, rule = found
        current = owner.open.get((uid, key))  # replaced whole, never mutated
        self.incident(namespace, name, incidents.note(
            current, uid=uid, pod=pod, key=key, signature=signature, t=t,
            count=count(key, rule.window_s), detail=detail))

    def incident(self, namespace: str, name: str, incident: Incident) -> None:
        """A detection updated an incident: at its threshold it is opened and decided, at once
        unless a detection of it was decided less than RECONSIDER_S ago: then the reconsider
        loop takes it up within RECONSIDER_S. A pod's log is its tenant's to write, and each
        decision reads the cluster: a flood of matching lines must not become a flood of API
        requests."""
        owner = self.owner(namespace, name)
        with owner.lock:
            if owner.policy is None and _due(owner.refreshed_at):
                self.refresh(namespace, name)
            found = owner.policy.rule_for(incident.signature) if owner.policy else None
            if found is None:
                return
            if incident.count < found[1].threshold:  # the window keeps counting meanwhile
                return
            key = (incident.uid, incident.key)
            owner.open = {**owner.open, key: incident}
            if not _due(owner.decided.get(key, -math.inf)):
                return
            owner.decided = {**owner.decided, key: time.monotonic()}
            self._decide(namespace, name, owner, [key])

    def forget_pod(self, namespace: str, name: str, uid: str) -> None:
        owner = self.known(namespace, name)
        if owner is None:
            return
        with owner.lock:
            for key in [k for k in owner.open if k[0] == uid]:
                self._close(owner, key)
            owner.told = {mark for mark in owner.told if mark[0][0] != uid}
            owner.decided = {k: t for k, t in owner.decided.items() if k[0] != uid}
            owner.backoff.pop(uid, None)

    def refresh(self, namespace: str, name: str) -> dict | None:
        """Read the VLMDeployment: policy, signatures, history and actions in flight (resumed
        here: this is how a fresh operator picks up what another left half done)."""
        owner = self.owner(namespace, name)
        owner.refreshed_at = time.monotonic()
        body = self.kube.get_vlmd(namespace, name)
        if body is None:
            return None
        try:
            vlmd = parse(body)
        except SpecError:
            return body
        owner.policy = remediation.policy_from_spec(vlmd.spec)
        owner.vlmd = vlmd
        extra = log_signatures.compile_spec_signatures(vlmd.spec["health"].get("extraSignatures")
                                                   or [])
        if extra != owner.extra:  # a new tuple makes followers rebuild their scanners
            owner.extra = extra
        annotations = body["metadata"].get("annotations") or {}
        owner.history = merged_history(parse_history(annotations.get(HISTORY)), owner.history,
                                       now=time.time())
        owner.in_flight = parse_in_flight(annotations)
        for uid in owner.in_flight:
            self._drive(namespace, name, uid)
        return body

    # -- deciding
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(RECONSIDER_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                owners = [(k, o) for k, o in self._owners.items() if o.open]
            for (namespace, name), owner in owners:
                try:
                    with owner.lock:
                        self._decide(namespace, name, owner, list(owner.open))
                except Exception:  # one VLMDeployment's trouble must not stop the others
                    log.exception("deciding held incidents of %s/%s failed", namespace, name)

    def _decide(self, namespace: str, name: str, owner: Owner, keys: list[Key]) -> None:
        """Decide the open incidents `keys` (owner.lock held)."""
        self._drop_expired(owner)
        keys = [k for k in keys if k in owner.open]
        if not keys:
            return
        if not self.may_act(namespace):
            if [key for key in keys if self._skip_once(owner, key, "peer_active")]:
                log.info("%s/%s: incidents left to the active operator replica", namespace,
                         name)
            return
        body = self.refresh(namespace, name)
        if body is None or owner.policy is None:
            owner.open, owner.held = {}, {}
            return
        pods = self.kube.list_pods(namespace, children.get_selector(name))
        for key in keys:
            incident = owner.open.get(key)
            if incident is None:
                continue
            if self._decide_one(namespace, name, owner, body, pods, incident):
                body = self.refresh(namespace, name) or body  # an action changed the picture
                pods = self.kube.list_pods(namespace, children.get_selector(name))

    def _decide_one(self, namespace: str, name: str, owner: Owner, body: dict,
                    pods: list[dict], incident: Incident) -> bool:
        """Decide one incident and carry the decision out; True when it acted."""
        key = (incident.uid, incident.key)
        found = owner.policy.rule_for(incident.signature)
        pod = next((p for p in pods if p["metadata"]["uid"] == incident.uid), None)
        if found is None or pod is None:
            self._close(owner, key)
            return False
        _, rule = found
        policy = owner.policy
        views = [remediation.pod_view(p, self.engine_dead(p["metadata"]["uid"]),
                                      p["metadata"]["uid"] in owner.in_flight) for p in pods]
        now = time.time()
        attempts, until = owner.backoff.get(incident.uid, (0, None))
        health = None
        if incident.signature == "engine_dead" and not expired(incident, now, rule.window_s):
            health = reader.health(reader.pod_ip(pod))
        spare = None
        if remediation.needs_replacement(views, incident.pod, policy, incident.signature):
            spare = self._spare_gpus(owner, incidents.pending_claims(
                parse_in_flight(body["metadata"].get("annotations")), pods))
        decision = remediation.decide(
            incident=incident, rule=rule, now=now, pods=views, history=owner.history,
            policy=policy, acted_until=acted_until(incident.uid, body["metadata"].get(
                "annotations")), backoff_until=until, health=health, spare_gpus=spare)
        if decision.act:
            self._close(owner, key)
            try:
                self._act(namespace, name, owner, body, pods, pod, incident, decision)
            except ApiException as exc:
                self._failed(namespace, name, owner, body, pod, incident, exc, attempts)
                return False
            owner.backoff.pop(incident.uid, None)
            return True
        was_held = key in owner.held
        if decision.holds:
            owner.held = {**owner.held, key: decision}
            self._tell_held(namespace, name, owner, body, pod, incident, decision)
            return False
        if decision.reason in remediation.GUARDS:
            self._skip_once(owner, key, decision.reason, incident)
        if decision.reason == "in_progress":  # kept open: decided again if the action ends
            owner.held = {k: v for k, v in owner.held.items() if k != key}
        else:
            log.info("%s/%s: %s", namespace, name, decision.message)
            self._close(owner, key)
        if was_held:
            self.reconcile(namespace, name)  # Remediating no longer says it waits
        return False

    def _spare_gpus(self, owner: Owner, pending: int) -> bool | None:
        """Whether one more replica fits the free GPUs once the `pending` claims of this
        VLMDeployment (pods not yet on a node, surges not yet made) took theirs."""
        if self.replica_fits is None or owner.vlmd is None:
            return False
        try:
            return self.replica_fits(owner.vlmd, pending)
        except Exception as exc:  # unknown is not zero, and not plenty either
            log.info("free GPUs unknown: %s", exc)
            return None

    def _close(self, owner: Owner, key: Key) -> None:
        owner.open = {k: v for k, v in owner.open.items() if k != key}
        owner.held = {k: v for k, v in owner.held.items() if k != key}
        owner.told = {mark for mark in owner.told if mark[0] != key}

    def _drop_expired(self, owner: Owner) -> None:
        """Incidents past their window close even where this replica may not act (a paused
        standby would otherwise hold them for ever)."""
        now = time.time()
        for key, incident in list(owner.open.items()):
            found = owner.policy.rule_for(incident.signature) if owner.policy else None
            if found is not None and expired(incident, now, found[1].window_s):
                self._close(owner, key)

    def _skip_once(self, owner: Owner, key: Key, reason: str,
                   incident: Incident | None = None) -> bool:
        """Count a guard once per incident and reason; True the first time."""
        incident = incident or owner.open.get(key)
        mark = (key, incident.first if incident else None, reason)
        if mark in owner.told:
            return False
        owner.told.add(mark)
        REMEDIATIONS_SKIPPED.labels(owner.namespace, owner.name, reason).inc()
        return True

    def _tell_held(self, namespace, name, owner, body, pod, incident, decision) -> None:
        """A held incident: the metric, an Event and lastRemediation once per reason; the
        Remediating condition says it for as long as it holds."""
        key = (incident.uid, incident.key)
        mark = (key, incident.first, decision.reason)
        if mark in owner.told:
            return
        self._skip_once(owner, key, decision.reason, incident)
        log.info("%s/%s: holding back: %s", namespace, name, decision.message)
        self._post(namespace, name, pod, Event("Warning", "RemediationSkipped",
                                                      decision.message), body)
        self._last(namespace, name, incident, "Skipped", decision.message)
        self.reconcile(namespace, name)

    def _failed(self, namespace, name, owner, body, pod, incident, exc, attempts) -> None:
        """An action's API call failed: back off, keep the incident open, say so."""
        until = time.time() + remediation.backoff_s(attempts + 1)
        owner.backoff[incident.uid] = (attempts + 1, until)
        owner.open = {**owner.open, (incident.uid, incident.key): incident}
        message = (f"acting on {incident.signature} on {incident.pod} failed: {exc.status} "
                   f"{exc.reason}; retrying in {until - time.time():.0f} s")
        log.warning("%s/%s: %s", namespace, name, message)
        self._post(namespace, name, pod, Event("Warning", "RemediationFailed", message),
                   body)

    # -- acting
    def _act(self, namespace, name, owner, body, pods, pod, incident, decision) -> None:
        self._record(owner, namespace, name)  # first: a crash after the action must not
        # leave the budget short (one extra count is the safe side)
        log.info("%s/%s: %s", namespace, name, decision.message)
        if decision.action == remediation.RESTART:
            view = remediation.pod_view(pod, self.engine_dead(incident.uid))
            serves = view.serves and incident.signature not in remediation.NOT_SERVING
            # one that still serves keeps its grace period: its preStop drains it
            if not self.kube.delete("v1", "Pod", namespace, incident.pod, uid=incident.uid,
                                    grace_s=None if serves else children.QUICK_GRACE_S):
                return  # gone already: nothing was done
            REMEDIATIONS.labels(namespace, name, remediation.RESTART).inc()
            self._post(namespace, name, pod, Event("Warning", "PodRestarted",
                                                          decision.message), body)
        else:
            record = InFlight(decision.action, incident.pod, incident.uid, incident.signature,
                              incident.last, stamp(time.time()),
                              int(body["spec"].get("replicas", 1)),
                              before=_uids(pods) if decision.action == REPLACE else ())
            self._write_in_flight(namespace, name, owner, add=record)
            if decision.action == SCALE_DOWN:  # out of the Service now; the steps drain it
                self.kube.patch_pod(namespace, incident.pod,
                                    labels={children.IN_SERVICE_LABEL: "false"})
            REMEDIATIONS.labels(namespace, name, decision.action).inc()
            reason, text = (("PodReplacing", "; bringing up a replacement first")
                            if decision.action == REPLACE else ("ScaleDownStarted", "; draining"))
            self._post(namespace, name, pod, Event("Warning", reason,
                                                          decision.message + text), body)
            self._drive(namespace, name, incident.uid)
        self._last(namespace, name, incident, decision.action, decision.message)
        self.reconcile(namespace, name)

    def _record(self, owner: Owner, namespace: str, name: str) -> None:
        """One more remediation in the last hour, kept on the VLMDeployment for the budget."""
        now = time.time()
        owner.history = merged_history(owner.history, [now], now=now)
        self.kube.patch_vlmd_annotations(namespace, name, {HISTORY: history_value(owner.history)})

    def _write_in_flight(self, namespace: str, name: str, owner: Owner,
                         add: InFlight | None = None, remove: str | None = None) -> None:
        """Add or drop one record, read-modify-write on the current object (409: read again)."""
        for attempt in range(CONFLICT_RETRIES):
            body = self.kube.get_vlmd(namespace, name)
            if body is None:
                return
            records = parse_in_flight(body["metadata"].get("annotations"))
            if add is not None:
                records[add.uid] = add
            if remove is not None:
                records.pop(remove, None)
            try:
                self.kube.patch_vlmd_annotations(
                    namespace, name, {IN_FLIGHT: in_flight_value(records)},
                    resource_version=body["metadata"].get("resourceVersion"))
            except ApiException as exc:
                if exc.status == 409 and attempt < CONFLICT_RETRIES - 1:
                    continue
                raise
            owner.in_flight = records
            return

    # -- actions in flight
    def _drive(self, namespace: str, name: str, uid: str) -> None:
        """One thread per in-flight action, taking its steps until it is done."""
        with self._lock:
            if uid in self._running or self._stop.is_set():
                return
            self._running.add(uid)
        threading.Thread(target=self._steps, args=(namespace, name, uid), daemon=True,
                         name=f"in-flight {namespace}/{name}").start()

    def _steps(self, namespace: str, name: str, uid: str) -> None:
        owner = self.owner(namespace, name)
        try:
            while not self._stop.is_set():
                try:
                    if self.may_act(namespace):
                        with owner.lock:
                            if self._step(namespace, name, owner, uid):
                                return
                except ApiException as exc:
                    log.warning("%s/%s: in-flight action on %s: %s %s", namespace, name, uid,
                                exc.status, exc.reason)
                except Exception:
                    log.exception("%s/%s: in-flight action on %s failed", namespace, name, uid)
                self._stop.wait(STEP_S)
        finally:
            with self._lock:
                self._running.discard(uid)

    def _step(self, namespace: str, name: str, owner: Owner, uid: str) -> bool:
        """One step of the action on pod `uid`, chosen from the cluster as it is now; True when
        there is nothing left to do."""
        body = self.kube.get_vlmd(namespace, name)
        record = parse_in_flight((body or {}).get("metadata", {}).get("annotations")).get(uid)
        if body is None or record is None:
            return True
        owner.in_flight = parse_in_flight(body["metadata"].get("annotations"))
        pods = self.kube.list_pods(namespace, children.get_selector(name))
        pod = next((p for p in pods if p["metadata"]["uid"] == uid), None)
        present = pod is not None and not pod["metadata"].get("deletionTimestamp")
        now = time.time()
        if not present and not remediation.settled(pod, now):
            return False  # terminating: the count drops once the ReplicaSet saw it go
        if record.action == SCALE_DOWN:
            return self._scale_down_step(namespace, name, owner, body, record, pod, present, now)
        return self._replace_step(namespace, name, owner, body, record, pods, pod, present, now)

    def _replace_step(self, namespace, name, owner, body, record, pods, pod, present,
                      now) -> bool:
        found = incidents.replacements(owner.in_flight, pods).get(record.uid, "")
        if record.surge and found != record.replacement:  # seen (or lost): on the record
            record = dataclasses.replace(record, replacement=found)
            self._write_in_flight(namespace, name, owner, add=record)
        views = {p["metadata"]["uid"]: remediation.pod_view(
            p, self.engine_dead(p["metadata"]["uid"]), p["metadata"]["uid"] in owner.in_flight)
            for p in pods}
        serves = present and views[record.uid].serves
        others = remediation.others_ready(views.values(), record.pod)
        replacement = next((p for p in pods if p["metadata"]["uid"] == found), None)
        running = None
        if record.drain_since is not None and present:
            self._out_of_service(namespace, pod)
            if serves and now - record.drain_since >= remediation.DRAIN_MIN_S:
                running = reader.requests_in_flight(reader.pod_ip(pod))
        leaving = self._leaving()
        node = (pod.get("spec") or {}).get("nodeName") if pod else None
        spare = None
        if not record.surge and record.drain_since is None and serves:
            spare = self._spare_gpus(owner, incidents.pending_claims(owner.in_flight, pods))
        policy = owner.policy or remediation.policy_from_spec(body.get("spec") or {})
        step = remediation.replace_step(
            record=record, present=present, serves=serves, running=running,
            others_ready=others, min_available=policy.min_available,
            replacement_ready=bool(found) and views[found].serves,
            unschedulable_s=_unschedulable_s(replacement, now) if replacement else 0.0,
            replicas=int(body["spec"].get("replicas", 1)),
            leaving=leaving is not None and node in leaving, spare_gpus=spare, now=now,
            timeout_s=self.replace_timeout_s, drain_timeout_s=self.drain_timeout_s,
            node_drain_wait_s=self.node_drain_wait_s)
        if step == remediation.WAIT:
            return False
        if step in (remediation.TAKE_OUT, remediation.LET_GO):
            self._write_in_flight(namespace, name, owner, add=dataclasses.replace(
                record, drain_since=stamp(now)))
            self._out_of_service(namespace, pod)
            if step == remediation.LET_GO:
                text = (f"{record.pod}: its node {record.node} has been leaving for "
                        f"{now - record.node_since:.0f} s (--node-drain-wait-seconds="
                        f"{self.node_drain_wait_s:g}) and no replacement serves: draining it, "
                        "then deleting it so the node drain can finish")
                log.warning("%s/%s: %s", namespace, name, text)
                self._post(namespace, name, pod, Event("Warning", "NodeDrainWaitExpired",
                                                              text), body)
            self.reconcile(namespace, name)  # Remediating: draining
            return False
        if step == remediation.DELETE:  # the surge ends once the pod has left (settled)
            self._delete_drained(namespace, name, body, record, pod, serves, running, now)
            return False
        if step == remediation.SURGE:
            self._write_in_flight(namespace, name, owner, add=dataclasses.replace(
                record, surge=True, since=stamp(now), before=_uids(pods),
                replicas=int(body["spec"].get("replicas", 1))))
            text = (f"{record.pod}: its node {record.node} is being drained and minAvailable="
                    f"{policy.min_available} protects it: bringing up a replacement elsewhere "
                    "first")
            log.info("%s/%s: %s", namespace, name, text)
            self._post(namespace, name, pod, Event("Normal", "PodReplacing", text), body)
            self.reconcile(namespace, name)  # the Deployment surges
            return False
        done = not (record.signature == NODE_DRAIN and step in (remediation.GIVE_UP,
                                                                remediation.ABANDON))
        if done:
            self._write_in_flight(namespace, name, owner, remove=record.uid)
        else:  # no surge again: the pod waits for its node drain's limit
            self._write_in_flight(namespace, name, owner, add=dataclasses.replace(
                record, surge=False, before=(), replacement="", tried=True))
        self._tell_step_end(namespace, name, owner, body, record, pod, step, now)
        self.reconcile(namespace, name)  # the Deployment drops its extra replica
        return done

    def _tell_step_end(self, namespace, name, owner, body, record, pod, step, now) -> None:
        """Events for a Replace that ended without replacing its pod."""
        replicas = int(body["spec"].get("replicas", 1))
        texts = {
            remediation.GIVE_UP: ("Warning", "ReplaceFailed", (
                f"gave up replacing {record.pod}: no replacement became ready in "
                f"{now - record.since:.0f} s or the scheduler refused it for "
                f"{remediation.UNSCHEDULABLE_S:g} s; it keeps serving")),
            remediation.ABANDON: ("Warning", "ReplaceAbandoned", (
                f"gave up replacing {record.pod}: spec.replicas went from {record.replicas} to "
                f"{replicas} meanwhile (another writer owns it: an HPA, KEDA, the Builtin "
                "autoscaler or a user), so the ReplicaSet removes the replacement that was "
                "still coming up; it keeps serving")),
            remediation.DROP: ("Normal", "NodeDrainCancelled", (
                f"{record.pod}: its node {record.node} is no longer leaving, or enough other "
                "pods serve for its eviction to go through; nothing left to do for it")),
        }
        if step not in texts:
            return
        kind, reason, text = texts[step]
        if step == remediation.GIVE_UP:
            attempts = owner.backoff.get(record.uid, (0, None))[0] + 1
            owner.backoff[record.uid] = (attempts, now + remediation.backoff_s(attempts))
        if record.signature == NODE_DRAIN and step != remediation.DROP:
            text += ("; it waits for the node drain's limit (--node-drain-wait-seconds="
                     f"{self.node_drain_wait_s:g})")
        (log.warning if kind == "Warning" else log.info)("%s/%s: %s", namespace, name, text)
        self._post(namespace, name, pod, Event(kind, reason, text), body)

    def _delete_drained(self, namespace, name, body, record, pod, serves, running, now) -> None:
        """Delete a Replace's pod: it serves nothing, or its drain is over."""
        if serves and running != 0:
            text = (f"drain of {record.pod} timed out after {now - record.drain_since:.0f} s "
                    "with " + (f"{running:g} requests in flight" if running is not None
                               else "its load unknown (/metrics unreadable)"))
            log.warning("%s/%s: %s", namespace, name, text)
            self._post(namespace, name, pod, Event("Warning", "DrainTimedOut", text),
                       body)
        self.kube.delete("v1", "Pod", namespace, record.pod, uid=record.uid,
                         grace_s=children.QUICK_GRACE_S)
        text = (f"deleted {record.pod}: drained, its replacement serves"
                if record.drain_since is not None and record.signature != NODE_DRAIN
                else f"deleted {record.pod}: drained" if record.drain_since is not None
                else f"deleted {record.pod}: it no longer serves")
        log.info("%s/%s: %s", namespace, name, text)
        self._post(namespace, name, pod, Event("Normal", "PodReplaced", text), body)

    def _out_of_service(self, namespace: str, pod: dict | None) -> None:
        """Out of the Service (again: an autoscaler that took it out may have put it back)."""
        if pod is not None and (pod["metadata"].get("labels") or {}).get(
                children.IN_SERVICE_LABEL) != "false":
            self.kube.patch_pod(namespace, pod["metadata"]["name"],
                                labels={children.IN_SERVICE_LABEL: "false"})

    def _scale_down_step(self, namespace, name, owner, body, record, pod, present, now) -> bool:
        if present:
            self._out_of_service(namespace, pod)
        serving = present and is_running(pod)
        running = None
        if serving and now - record.since >= remediation.DRAIN_MIN_S:
            running = reader.requests_in_flight(reader.pod_ip(pod))
        step = remediation.scale_down_step(present=present, serving=serving, running=running,
                                           since=record.since, now=now,
                                           timeout_s=self.drain_timeout_s)
        if step == remediation.WAIT:
            return False
        if step == remediation.DELETE:
            if serving and running != 0:
                text = (f"drain of {record.pod} timed out after {now - record.since:.0f} s with "
                        + (f"{running:g} requests in flight" if running is not None
                           else "its load unknown (/metrics unreadable)"))
                log.warning("%s/%s: %s", namespace, name, text)
                self._post(namespace, name, pod, Event("Warning", "DrainTimedOut", text),
                           body)
            self.kube.delete("v1", "Pod", namespace, record.pod, uid=record.uid,
                             grace_s=children.QUICK_GRACE_S)
            return False  # lowered once the pod has left (settled)
        current = int(body["spec"].get("replicas", 1))
        min_available = owner.policy.min_available if owner.policy else 1
        target = remediation.lowered_replicas(current, record, min_available)
        if target is not None:
            self.kube.scale_vlmd(namespace, name, target)
            text = f"drained and deleted {record.pod}, replicas {current} -> {target}"
        else:
            text = (f"drained and deleted {record.pod}; replicas kept at {current} "
                    f"(spec.health.minAvailable={min_available}"
                    + (")" if current == record.replicas else
                       f"; spec.replicas changed from {record.replicas} meanwhile)"))
        self._write_in_flight(namespace, name, owner, remove=record.uid)
        log.info("%s/%s: %s", namespace, name, text)
        self._post(namespace, name, pod, Event("Normal", "ScaledDown", text), body)
        self.reconcile(namespace, name)
        return True

    # -- every round (runtime/periodic.py, on the active replica only)
    def round(self, body: dict, pods: list[dict]) -> None:
        """Make sure every action recorded on the VLMDeployment has a thread driving it (a
        standby that became active, a fresh process: nothing else may wake them), and look
        for its pods on nodes that are leaving. body: the round's snapshot; pods: its pods
        (from the watch-fed cache)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        records = parse_in_flight(meta.get("annotations"))
        for uid in records:
            self._drive(namespace, name, uid)
        leaving = self._leaving()
        if not leaving or not any((p.get("spec") or {}).get("nodeName") in leaving
                                  for p in pods):
            return
        owner = self.owner(namespace, name)
        if owner.policy is None:
            self.refresh(namespace, name)
        if owner.policy is not None and _drain_work(pods, records, leaving, owner.policy,
                                                    self.engine_dead,
                                                    self.kube.pdb_unhealthy_pod_eviction):
            with owner.lock:  # decided again on what the cluster shows now
                self._node_drains(namespace, name, owner, leaving)

    def _leaving(self) -> Mapping[str, str] | None:
        """Nodes that are leaving (None: not known, or not looked for)."""
        if self.leaving_nodes is None:
            return None
        try:
            return self.leaving_nodes()
        except Stale as exc:
            log.debug("leaving nodes unknown: %s", exc)
            return None

    def _node_drains(self, namespace: str, name: str, owner: Owner,
                     leaving: Mapping[str, str]) -> None:
        """The VLMDeployment's pods on leaving nodes, read afresh (owner.lock held)."""
        body = self.refresh(namespace, name)
        if body is None or owner.policy is None:
            return
        pods = self.kube.list_pods(namespace, children.get_selector(name))
        records = parse_in_flight(body["metadata"].get("annotations"))
        views = [remediation.pod_view(p, self.engine_dead(p["metadata"]["uid"]),
                                      p["metadata"]["uid"] in records) for p in pods]
        now = stamp(time.time())
        for pod, view in zip(pods, views, strict=True):
            uid, node = pod["metadata"]["uid"], (pod.get("spec") or {}).get("nodeName")
            if node not in leaving:
                continue
            record = records.get(uid)
            if record is not None:
                if not record.node and record.action == REPLACE:  # its drain limit starts now
                    self._write_in_flight(namespace, name, owner, add=dataclasses.replace(
                        record, node=node, node_since=now))
                continue
            action = remediation.node_drain_action(view, views, owner.policy,
                                                   self.kube.pdb_unhealthy_pod_eviction)
            if action == remediation.DELETE:
                self._release(namespace, name, body, pod, node, leaving[node])
            elif action == REPLACE:
                self._protect(namespace, name, owner, body, pods, pod, node, leaving[node],
                              now)

    def _release(self, namespace, name, body, pod, node, why) -> None:
        """A pod that serves nothing whose eviction the budget refuses: delete it."""
        meta = pod["metadata"]
        if not self.kube.delete("v1", "Pod", namespace, meta["name"], uid=meta["uid"],
                                grace_s=children.QUICK_GRACE_S):
            return
        text = (f"deleted {meta['name']}: its node {node} is leaving ({why}) and it serves "
                "nothing, while the PodDisruptionBudget would refuse its eviction")
        log.info("%s/%s: %s", namespace, name, text)
        self._post(namespace, name, pod, Event("Normal", "NodeDrainReleased", text),
                   body)

    def _protect(self, namespace, name, owner, body, pods, pod, node, why, now) -> None:
        """A serving pod minAvailable protects on a leaving node: a Replace of its own, with a
        surge when a replica fits elsewhere, else waiting for capacity."""
        meta = pod["metadata"]
        records = parse_in_flight(body["metadata"].get("annotations"))
        spare = self._spare_gpus(owner, incidents.pending_claims(records, pods))
        record = InFlight(REPLACE, meta["name"], meta["uid"], NODE_DRAIN, now, now,
                          int(body["spec"].get("replicas", 1)), surge=bool(spare),
                          before=_uids(pods) if spare else (), node=node, node_since=now)
        self._write_in_flight(namespace, name, owner, add=record)
        policy = owner.policy
        if spare:
            kind, reason, text = "Normal", "PodReplacing", (
                f"{meta['name']}: its node {node} is leaving ({why}) and minAvailable="
                f"{policy.min_available} protects it: bringing up a replacement elsewhere "
                "first; the eviction goes through once it serves")
        else:
            kind, reason, text = "Warning", "NodeDrainHeld", (
                f"{meta['name']}: its node {node} is leaving ({why}) and minAvailable="
                f"{policy.min_available} protects it, but "
                + ("no GPU is free elsewhere" if spare is False else
                   "the free GPUs cannot be read")
                + " for a replacement: it keeps serving for up to "
                f"{self.node_drain_wait_s:g} s (--node-drain-wait-seconds) while capacity may "
                "come, then it is drained and deleted so the drain can finish")
        (log.warning if kind == "Warning" else log.info)("%s/%s: %s", namespace, name, text)
        self._post(namespace, name, pod, Event(kind, reason, text), body)
        self._drive(namespace, name, meta["uid"])
        self.reconcile(namespace, name)

    # -- reporting
    def reports(self, namespace: str, name: str) -> list[Report]:
        owner = self.known(namespace, name)
        if owner is None or owner.policy is None:
            return []
        out = [remediation.remediating_report(
            owner.in_flight, [(owner.open[k], d) for k, d in owner.held.items()
                              if k in owner.open], time.time(), self.node_drain_wait_s)]
        budget = remediation.budget_report(owner.history, time.time(), owner.policy)
        return [*out, budget] if budget else out

    def _last(self, namespace: str, name: str, incident: Incident, action: str,
              reason: str) -> None:
        try:
            self.kube.patch_vlmd_status(namespace, name, {"lastRemediation": {
                "time": now_iso(), "pod": incident.pod, "signature": incident.signature,
                "action": action, "reason": reason[:1024]}})
        except ApiException as exc:
            log.warning("lastRemediation of %s/%s: %s", namespace, name, exc.reason)

    def _post(self, namespace: str, name: str, pod: dict | None, event: Event,
              body: dict | None = None) -> None:
        """The Event on the pod (when it still exists) and on its VLMDeployment."""
        if pod is not None:
            self.kube.post_event({**pod, "apiVersion": "v1", "kind": "Pod"}, event)
        body = body or self.kube.get_vlmd(namespace, name)
        if body is not None:
            self.kube.post_event(body, event)


def _drain_work(pods: list[dict], records: Mapping[str, InFlight], leaving: Mapping[str, str],
                policy: remediation.Policy, engine_dead: Callable[[str], bool],
                always_allow: bool) -> bool:
    """Whether a pod on a leaving node needs something this round: an action of its own, or
    its Replace record has yet to note the node (from the round's pods: the check is redone on
    a fresh read before acting)."""
    views = [remediation.pod_view(p, engine_dead(p["metadata"]["uid"]),
                                  p["metadata"]["uid"] in records) for p in pods]
    for pod, view in zip(pods, views, strict=True):
        if (pod.get("spec") or {}).get("nodeName") not in leaving:
            continue
        record = records.get(pod["metadata"]["uid"])
        if record is not None:
            if record.action == REPLACE and not record.node:
                return True
        elif remediation.node_drain_action(view, views, policy, always_allow):
            return True
    return False


def _uids(pods: list[dict]) -> tuple[str, ...]:
    return tuple(sorted(p["metadata"]["uid"] for p in pods))


def _unschedulable_s(pod: dict, now: float) -> float:
    """How long the scheduler has refused this pod (0: it has not)."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"):
            since = parse_time(cond.get("lastTransitionTime"))
            if since is not None:
                return max(0.0, now - since)
    return 0.0


def _due(last: float) -> bool:
    """Whether RECONSIDER_S passed since `last` (monotonic)."""
    return time.monotonic() - last >= RECONSIDER_S
