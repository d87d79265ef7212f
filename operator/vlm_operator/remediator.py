"""Acting on incidents: decide with remediation.py, then restart, replace, drain or scale down.

Thin: every decision is a pure function; this reads the cluster, asks, and makes the API calls.
Decisions and actions on one VLMDeployment's pods are serialised by its lock.

Incidents held back by a guard that may clear (minAvailable with no GPU for a replacement, the
restart budget, back-off, /health still 200) stay open and are decided again on pod events,
spec changes and every RECONSIDER_S, until acted on, gone or older than their window.

Actions that take more than one step (Replace: surge a replica, delete the sick pod once the
replacement is ready; ScaleDown: drain, delete, lower replicas) are recorded on the VLMDeployment
(incidents.IN_FLIGHT) before their first step, and each step is chosen afresh from what the
cluster shows. So a fresh operator process (a restart, a standby taking over) finishes or undoes
them from the cluster alone, and never repeats a step that took effect.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from vlm_operator import builders, incidents, remediation, scrape, signatures, status
from vlm_operator.incidents import (
    HISTORY,
    IN_FLIGHT,
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
from vlm_operator.kube import Kube, now_iso
from vlm_operator.logfollow import is_running
from vlm_operator.metrics import REMEDIATIONS, REMEDIATIONS_SKIPPED
from vlm_operator.remediation import Decision, Policy
from vlm_operator.spec import SpecError, VLMDeployment, parse

log = logging.getLogger(__name__)

RECONSIDER_S = 3.0  # held incidents are decided again at least this often
STEP_S = 1.0  # in-flight actions look at the cluster again this often
UNSCHEDULABLE_S = 60.0  # a replacement no node takes for this long: give the surge up
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
        self.extra: tuple[signatures.Signature, ...] = ()
        self.history: list[float] = []
        self.in_flight: dict[str, InFlight] = {}
        self.open: dict[Key, Incident] = {}  # (pod uid, policy key) -> incident
        self.held: dict[Key, Decision] = {}  # why each held incident waits
        self.backoff: dict[str, tuple[int, float]] = {}  # pod uid -> (attempts, until)
        self.told: set[tuple] = set()  # ((uid, key), first, reason) already reported


class Remediator:
    def __init__(self, kube: Kube, reconcile: Callable[[str, str], None], *,
                 may_act: Callable[[str], bool] | None = None,
                 replica_fits: Callable[[VLMDeployment], bool] | None = None,
                 engine_dead: Callable[[str], bool] = lambda uid: False,
                 drain_timeout_s: float = remediation.DRAIN_TIMEOUT_S,
                 replace_timeout_s: float = remediation.REPLACE_TIMEOUT_S) -> None:
        """`reconcile(ns, name)` publishes status (Reconciler.refresh, logs its own errors);
        `may_act(ns)`: whether this replica acts (peering.py; None: it runs alone);
        `replica_fits(vlmd)`: one more replica fits the free GPUs (raises when unknown; None:
        never surge);
        `engine_dead(uid)`: the pod's log showed engine death in its current container."""
        self.kube = kube
        self.reconcile = reconcile
        self.may_act = may_act or (lambda namespace: True)
        self.replica_fits = replica_fits
        self.engine_dead = engine_dead
        self.drain_timeout_s = drain_timeout_s
        self.replace_timeout_s = replace_timeout_s
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
        if owner.policy is None:
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
        """A detection updated an incident: at its threshold it is opened and decided."""
        owner = self.owner(namespace, name)
        with owner.lock:
            if owner.policy is None:
                self.refresh(namespace, name)
            found = owner.policy.rule_for(incident.signature) if owner.policy else None
            if found is None:
                return
            if incident.count < found[1].threshold:  # the window keeps counting meanwhile
                return
            key = (incident.uid, incident.key)
            owner.open = {**owner.open, key: incident}
            self._decide(namespace, name, owner, [key])

    def forget_pod(self, namespace: str, name: str, uid: str) -> None:
        owner = self.known(namespace, name)
        if owner is None:
            return
        with owner.lock:
            for key in [k for k in owner.open if k[0] == uid]:
                self._close(owner, key)
            owner.told = {mark for mark in owner.told if mark[0][0] != uid}
            owner.backoff.pop(uid, None)

    def refresh(self, namespace: str, name: str) -> dict | None:
        """Read the VLMDeployment: policy, signatures, history and actions in flight (resumed
        here: this is how a fresh operator picks up what another left half done)."""
        owner = self.owner(namespace, name)
        body = self.kube.get_vlmd(namespace, name)
        if body is None:
            return None
        try:
            vlmd = parse(body)
        except SpecError:
            return body
        owner.policy = remediation.policy_from_spec(vlmd.spec)
        owner.vlmd = vlmd
        extra = signatures.compile_spec_signatures(vlmd.spec["health"].get("extraSignatures")
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
        pods = self.kube.list_pods(namespace, builders.get_selector(name))
        for key in keys:
            incident = owner.open.get(key)
            if incident is None:
                continue
            if self._decide_one(namespace, name, owner, body, pods, incident):
                body = self.refresh(namespace, name) or body  # an action changed the picture
                pods = self.kube.list_pods(namespace, builders.get_selector(name))

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
            health = scrape.health(scrape.pod_ip(pod))
        spare = None
        if remediation.needs_replacement(views, incident.pod, policy, incident.signature):
            spare = self._spare_gpus(owner)
        decision = remediation.decide(
            incident=incident, rule=rule, now=now, pods=views, history=owner.history,
            policy=policy, acted_until=acted_until(incident.uid, body["metadata"].get(
                "annotations")), backoff_until=until, health=health, spare_gpus=spare)
        if decision.act:
            self._close(owner, key)
            try:
                self._act(namespace, name, owner, body, pod, incident, decision)
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

    def _spare_gpus(self, owner: Owner) -> bool | None:
        if self.replica_fits is None or owner.vlmd is None:
            return False
        try:
            return self.replica_fits(owner.vlmd)
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
        self._post(namespace, name, pod, status.Event("Warning", "RemediationSkipped",
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
        self._post(namespace, name, pod, status.Event("Warning", "RemediationFailed", message),
                   body)

    # -- acting
    def _act(self, namespace, name, owner, body, pod, incident, decision) -> None:
        self._record(owner, namespace, name)  # first: a crash after the action must not
        # leave the budget short (one extra count is the safe side)
        log.info("%s/%s: %s", namespace, name, decision.message)
        if decision.action == remediation.RESTART:
            if not self.kube.delete("v1", "Pod", namespace, incident.pod, uid=incident.uid):
                return  # gone already: nothing was done
            REMEDIATIONS.labels(namespace, name, remediation.RESTART).inc()
            self._post(namespace, name, pod, status.Event("Warning", "PodRestarted",
                                                          decision.message), body)
        else:
            record = InFlight(decision.action, incident.pod, incident.uid, incident.signature,
                              incident.last, stamp(time.time()),
                              int(body["spec"].get("replicas", 1)))
            self._write_in_flight(namespace, name, owner, add=record)
            if decision.action == SCALE_DOWN:  # out of the Service now; the steps drain it
                self.kube.patch_pod(namespace, incident.pod,
                                    labels={builders.IN_SERVICE_LABEL: "false"})
            REMEDIATIONS.labels(namespace, name, decision.action).inc()
            reason, text = (("PodReplacing", "; bringing up a replacement first")
                            if decision.action == REPLACE else ("ScaleDownStarted", "; draining"))
            self._post(namespace, name, pod, status.Event("Warning", reason,
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
        pods = self.kube.list_pods(namespace, builders.get_selector(name))
        pod = next((p for p in pods if p["metadata"]["uid"] == uid), None)
        present = pod is not None and not pod["metadata"].get("deletionTimestamp")
        now = time.time()
        if record.action == SCALE_DOWN:
            return self._scale_down_step(namespace, name, owner, body, record, pod, present, now)
        views = [remediation.pod_view(p, self.engine_dead(p["metadata"]["uid"])) for p in pods]
        serves = present and next(v for v in views if v.name == record.pod).capacity
        others = sum(1 for v in views if v.capacity and v.name != record.pod)
        step = remediation.replace_step(
            present=present, serves=serves, others_ready=others,
            min_available=owner.policy.min_available if owner.policy else 1,
            since=record.since, now=now, timeout_s=self.replace_timeout_s)
        if step == remediation.WAIT and _unschedulable_for(pods, uid, now) > UNSCHEDULABLE_S:
            step = remediation.GIVE_UP
        if step == remediation.DELETE:
            self.kube.delete("v1", "Pod", namespace, record.pod, uid=uid)
            text = (f"deleted {record.pod}: {others} other pods serve" if serves
                    else f"deleted {record.pod}: it no longer serves")
            log.info("%s/%s: %s", namespace, name, text)
            self._post(namespace, name, pod, status.Event("Normal", "PodReplaced", text), body)
            return False
        if step == remediation.WAIT:
            return False
        self._write_in_flight(namespace, name, owner, remove=uid)
        if step == remediation.GIVE_UP:
            attempts = owner.backoff.get(uid, (0, None))[0] + 1
            owner.backoff[uid] = (attempts, now + remediation.backoff_s(attempts))
            text = (f"gave up replacing {record.pod}: no replacement became ready in "
                    f"{now - record.since:.0f} s; it keeps serving")
            log.warning("%s/%s: %s", namespace, name, text)
            self._post(namespace, name, pod, status.Event("Warning", "ReplaceFailed", text),
                       body)
        self.reconcile(namespace, name)  # the Deployment drops its extra replica
        return True

    def _scale_down_step(self, namespace, name, owner, body, record, pod, present, now) -> bool:
        if present and (pod["metadata"].get("labels") or {}).get(
                builders.IN_SERVICE_LABEL) != "false":
            self.kube.patch_pod(namespace, record.pod,
                                labels={builders.IN_SERVICE_LABEL: "false"})
        serving = present and is_running(pod)
        running = None
        if serving and now - record.since >= remediation.DRAIN_MIN_S:
            running = scrape.requests_in_flight(scrape.pod_ip(pod))
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
                self._post(namespace, name, pod, status.Event("Warning", "DrainTimedOut", text),
                           body)
            self.kube.delete("v1", "Pod", namespace, record.pod, uid=record.uid)
            return False
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
        self._post(namespace, name, pod, status.Event("Normal", "ScaledDown", text), body)
        self.reconcile(namespace, name)
        return True

    # -- reporting
    def reports(self, namespace: str, name: str) -> list[status.Report]:
        owner = self.known(namespace, name)
        if owner is None or owner.policy is None:
            return []
        out = [remediation.remediating_report(
            owner.in_flight, [(owner.open[k], d) for k, d in owner.held.items()
                              if k in owner.open])]
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

    def _post(self, namespace: str, name: str, pod: dict | None, event: status.Event,
              body: dict | None = None) -> None:
        """The Event on the pod (when it still exists) and on its VLMDeployment."""
        if pod is not None:
            self.kube.post_event({**pod, "apiVersion": "v1", "kind": "Pod"}, event)
        body = body or self.kube.get_vlmd(namespace, name)
        if body is not None:
            self.kube.post_event(body, event)


def _unschedulable_for(pods: list[dict], sick_uid: str, now: float) -> float:
    """How long the longest-waiting other pod has been refused by the scheduler (0: none)."""
    longest = 0.0
    for pod in pods:
        if pod["metadata"]["uid"] == sick_uid or pod["metadata"].get("deletionTimestamp"):
            continue
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                    and cond.get("reason") == "Unschedulable"):
                since = remediation.parse_time(cond.get("lastTransitionTime"))
                if since is not None:
                    longest = max(longest, now - since)
    return longest
