"""Acting on incidents: gather, decide, execute. For each open incident the inputs are read once
into a decide.PlanRequest, decide.decide() returns a RemediationPlan, and the plan is carried
out (remediation/execute.py: a Restart by remediation/recovery.py, a Replace or ScaleDown
recorded on the VLMDeployment and driven by remediation/in_flight.py), a held plan told once
(events.py).
Decisions and actions on one VLMDeployment's pods are serialised by its lock (intake.Owner).
Held incidents stay open and are decided again on pod events, spec changes and every
RECONSIDER_S, until acted on, gone or older than their window. Every round also makes sure the
recorded actions have their worker and looks for node drains (remediation/drains.py)."""

from __future__ import annotations

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
from vlm_operator.k8s.kube import Kube
from vlm_operator.k8s.nodes import Leaving
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.podreads import reader
from vlm_operator.remediation import (
    actions,
    drains,
    events,
    guards,
    ladder,
    outcomes,
    steps,
    suspect,
)
from vlm_operator.remediation.decide import (
    PlanRequest,
    Reason,
    RemediationPlan,
    decide,
    remediating_report,
)
from vlm_operator.remediation.execute import execute
from vlm_operator.remediation.in_flight import InFlightDriver
from vlm_operator.remediation.incidents import (
    HISTORY,
    Incident,
    InFlight,
    acted_until,
    expired,
    merged_history,
    note,
    parse_history,
    parse_in_flight,
    pending_claims,
    read_in_flight,
)
from vlm_operator.remediation.intake import RECONSIDER_S, Case, Key, Owner, due
from vlm_operator.remediation.policy import health_policy_from_spec
from vlm_operator.remediation.recovery import Recovery

log = logging.getLogger(__name__)


class Remediator:
    def __init__(self, kube: Kube, reconcile: Callable[[str, str], None], *,
                 may_act: Callable[[str], bool] | None = None,
                 replica_fits: Callable[[VLMDeployment, int], bool] | None = None,
                 engine_dead: Callable[[str], bool] = lambda uid: False,
                 plugin_loaded: Callable[[str], bool] = lambda uid: False,
                 gpu_error: Callable[[str], suspect.GpuFault | None] = lambda uid: None,
                 leaving_nodes: Callable[[], Mapping[str, Leaving]] | None = None,
                 drain_timeout_s: float = steps.DRAIN_TIMEOUT_S,
                 replace_timeout_s: float = steps.REPLACE_TIMEOUT_S,
                 node_drain_wait_s: float = steps.NODE_DRAIN_WAIT_S,
                 kubelet_backoff: ladder.KubeletBackoff = ladder.KUBELET_BACKOFF,
                 unschedulable_limit_s: float = steps.UNSCHEDULABLE_S) -> None:
        """`reconcile(ns, name)` publishes status (Reconciler.refresh, logs its own errors);
        `may_act(ns)`: whether this replica acts (k8s/peering.py; None: it runs alone);
        `replica_fits(vlmd, pending)`: one more replica fits the free GPUs after `pending`
        replicas of it not yet on a node took theirs (raises when unknown; None: never surge);
        `engine_dead(uid)`: the pod's log showed engine death in its current container;
        `plugin_loaded(uid)`: the engine plugin's startup line is in its current container's log
        (it can act on an in-place restart request); `gpu_error(uid)`: its last GPU fault;
        `leaving_nodes()`: node name -> why it leaves, and whether a drain (raises Stale when
        unknown; None: not looked for); `kubelet_backoff`: the nodes' crash-loop back-off;
        `unschedulable_limit_s`: a surge's wait for a node."""
        self.kube = kube
        self.reconcile = reconcile
        self.may_act = may_act or (lambda namespace: True)
        self.replica_fits = replica_fits
        self.engine_dead = engine_dead
        self.leaving_nodes = leaving_nodes
        self.drain_timeout_s = drain_timeout_s
        self.replace_timeout_s = replace_timeout_s
        self.node_drain_wait_s = node_drain_wait_s
        self.unschedulable_limit_s = unschedulable_limit_s
        self._owners: dict[Key, Owner] = {}
        self._lock = threading.Lock()
        self.stopped = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="reconsider")
        self.in_flight = InFlightDriver(self)
        self.recovery = Recovery(kube, reconcile, engine_dead=engine_dead, gpu_error=gpu_error,
                                 plugin_loaded=plugin_loaded, kubelet=kubelet_backoff)

    def start(self) -> Remediator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
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

    # -- intake
    def report(self, namespace: str, name: str, *, uid: str, pod: str, signature: str,
               t: float, count: Callable[[str, float], int], detail: str = "") -> None:
        """A detection on pod `uid` at t: `count(key, window_s)` says how many fall in the
        rule's window (log watching keeps the windows). It joins the pod's open incident."""
        owner = self.owner(namespace, name)
        if owner.policy is None and due(owner.refreshed_at):
            self.refresh(namespace, name)
        found = owner.policy.rule_for(signature) if owner.policy else None
        if found is None:
            return
        key, rule = found
        current = owner.open.get((uid, key))  # replaced whole, never mutated
        self.incident(namespace, name, note(
            current, uid=uid, pod=pod, key=key, signature=signature, t=t,
            count=count(key, rule.window_s), detail=detail))

    def incident(self, namespace: str, name: str, incident: Incident) -> None:
        """A detection updated an incident: at its threshold it is opened and decided, at once
        unless a detection of it was decided less than RECONSIDER_S ago (then the reconsider
        loop takes it up): a flood of a tenant's log lines is no flood of API requests."""
        owner = self.owner(namespace, name)
        with owner.lock:
            if owner.policy is None and due(owner.refreshed_at):
                self.refresh(namespace, name)
            found = owner.policy.rule_for(incident.signature) if owner.policy else None
            if found is None:
                return
            if incident.count < found[1].threshold:  # the window keeps counting meanwhile
                return
            key = (incident.uid, incident.key)
            owner.open = {**owner.open, key: incident}
            if not due(owner.decided.get(key, -math.inf)):
                return
            owner.decided = {**owner.decided, key: time.monotonic()}
            self._decide(namespace, name, owner, [key])

    def forget_pod(self, namespace: str, name: str, uid: str) -> None:
        owner = self.known(namespace, name)
        if owner is None:
            return
        with owner.lock:
            owner.forget(uid)

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
        owner.policy = health_policy_from_spec(vlmd.spec)
        owner.vlmd = vlmd
        extra = log_signatures.compile_spec_signatures(vlmd.spec["health"].get("extraSignatures")
                                                   or [])
        if extra != owner.extra:  # a new tuple makes followers rebuild their scanners
            owner.extra = extra
        annotations = Body(body).annotations
        owner.history = merged_history(parse_history(annotations.get(HISTORY)), owner.history,
                                       now=time.time())
        owner.in_flight = parse_in_flight(annotations)
        if owner.in_flight:
            self.in_flight.drive(namespace, name)
        return body

    # -- deciding
    def _loop(self) -> None:
        while not self.stopped.is_set():
            self._wake.wait(RECONSIDER_S)
            self._wake.clear()
            if self.stopped.is_set():
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
        owner.drop_expired()
        keys = [k for k in keys if k in owner.open]
        if not keys:
            return
        if not self.may_act(namespace):
            if [key for key in keys if owner.skip_once(key, Reason.PEER_ACTIVE)]:
                log.info("%s/%s: incidents left to the active operator replica", namespace, name)
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
        """Gather, decide and execute for one incident; True when it acted."""
        key = (incident.uid, incident.key)
        found = owner.policy.rule_for(incident.signature)
        pod = next((p for p in pods if Pod(p).uid == incident.uid), None)
        if found is None or pod is None:
            owner.close(key)
            return False
        case = Case(namespace, name, owner, body, pods, pod, incident)
        plan = decide(self._gather(case))
        if plan.act:
            attempts = owner.backoff.get(incident.uid, (0, None))[0]
            owner.close(key)
            try:
                self._act(case, plan)
            except ApiException as exc:
                outcomes.failed(self.kube, case, exc, attempts)
                return False
            owner.backoff.pop(incident.uid, None)
            return True
        outcomes.hold(self.kube, self.reconcile, case, plan)
        return False

    def _gather(self, case: Case) -> PlanRequest:
        """The plan's inputs, read once (/health, free GPUs: only where they matter)."""
        owner, body, pods, pod, incident = (case.owner, case.body, case.pods, case.pod,
                                            case.incident)
        _, rule = owner.policy.rule_for(incident.signature)
        policy = owner.policy
        standings = tuple(guards.standing(p, self.engine_dead(Pod(p).uid),
                                      Pod(p).uid in owner.in_flight) for p in pods)
        now = time.time()
        health = None
        if incident.signature == "engine_dead" and not expired(incident, now, rule.window_s):
            health = reader.health(Pod(pod).pod_ip)
        spare = None
        if guards.needs_replacement(standings, incident.pod, policy, incident.signature):
            spare = self.spare_gpus(owner, pending_claims(
                parse_in_flight(Body(body).annotations), pods))
        return PlanRequest(
            incident=incident, rule=rule, now=now, pods=standings, history=tuple(owner.history),
            policy=policy, acted_until=max(
                (t for t in (acted_until(incident.uid, Body(body).annotations),
                             ladder.recovered_until(pod)) if t is not None), default=None),
            container_since=ladder.container_since(pod),
            backoff_until=owner.backoff.get(incident.uid, (0, None))[1],
            health=health, spare_gpus=spare)

    def spare_gpus(self, owner: Owner, pending: int) -> bool | None:
        """Whether one more replica fits the free GPUs once the `pending` claims of this
        VLMDeployment (pods not yet on a node, surges not yet made) took theirs."""
        if self.replica_fits is None or owner.vlmd is None:
            return False
        try:
            return self.replica_fits(owner.vlmd, pending)
        except Exception as exc:  # unknown is not zero, and not plenty either
            log.info("free GPUs unknown: %s", exc)
            return None

    # -- executing
    def _act(self, case: Case, plan: RemediationPlan) -> None:
        self._record(case.owner, case.namespace, case.name)  # first: a crash after the
        # action must not leave the budget short (one extra count is the safe side)
        log.info("%s/%s: %s", case.namespace, case.name, plan.message)
        execute(self, self.recovery.restart, case, plan)

    def _record(self, owner: Owner, namespace: str, name: str) -> None:
        """One more remediation in the last hour, kept on the VLMDeployment for the budget."""
        owner.history = actions.record_remediation(self.kube, namespace, name, owner.history,
                                                   now=time.time())

    def write_in_flight(self, namespace: str, name: str, owner: Owner, *,
                        add: InFlight | None = None, remove: str | None = None) -> None:
        """Add or drop one record on the VLMDeployment, and keep what was written."""
        records = actions.write_in_flight(self.kube, namespace, name, add=add, remove=remove)
        if records is not None:
            owner.in_flight = records

    # -- every round (runtime/periodic.py, on the active replica only)
    def round(self, body: dict, pods: list[dict]) -> None:
        """Make sure the actions recorded on the VLMDeployment have a worker driving them (a
        standby that became active, a fresh process: nothing else may wake them), take each
        fenced pod's next step, and look for its pods on nodes that are leaving. body: the
        round's snapshot; pods: its pods (from the watch-fed cache)."""
        meta = Body(body)
        read = read_in_flight(meta.annotations)
        self.in_flight.tell_dropped(meta.namespace, meta.name, read, body)
        if read.records:
            self.in_flight.drive(meta.namespace, meta.name)
        fenced = [(p, f) for p in pods if (f := ladder.parse_fence(
            Pod(p).annotations)) is not None]
        if fenced:
            with self.owner(meta.namespace, meta.name).lock:
                self.recovery.round(meta.namespace, meta.name, fenced)
        drains.on_round(self, body, pods)

    # -- reporting
    def reports(self, namespace: str, name: str) -> list[Report]:
        owner = self.known(namespace, name)
        if owner is None or owner.policy is None:
            return []
        out = [remediating_report(
            owner.in_flight, [(owner.open[k], d) for k, d in owner.held.items()
                              if k in owner.open], time.time(), self.node_drain_wait_s,
            self.unschedulable_limit_s)]
        budget = guards.budget_report(owner.history, time.time(), owner.policy)
        return [*out, budget] if budget else out

    def post_event(self, namespace: str, name: str, pod: dict | None, event: Event,
                   body: dict | None = None) -> None:
        """An Event on the pod and its VLMDeployment (log watching and stall detection tell
        what they find through here)."""
        events.post(self.kube, namespace, name, pod, event, body)
