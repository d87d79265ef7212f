"""The Builtin autoscaler's acting side: scrape pods, ask autoscaling/recommend.py, write the
results.

One `tick` per Builtin VLMDeployment every second (runtime/rounds.py, with the round's pods and
their /metrics readings). Replicas are
written through the VLMDeployment's scale subresource, the last decision into
status.autoscaling (only that key), inputs and outputs into the operator's metrics.

Scale-down is graceful: the chosen pod leaves the Service first (label IN_SERVICE_LABEL=false
and the annotation DRAIN_SINCE, in one patch), is deleted when drained (no running or waiting
request) or after DRAIN_TIMEOUT_S, and only then is spec.replicas lowered. Which pods are
draining is read back from those annotations every round, so a restarted or standby operator
finishes the drains another began (the reconciler puts them back if Builtin autoscaling is
turned off). Pods that remediation is removing (out of the Service without DRAIN_SINCE) are
left alone, except fenced ones (remediation/ladder.py: recovering in place, their fence
annotation): those stay in the view as capacity on its way back (LOADING, so `current` and the
pods agree), and are the first to go on a scale-down, deleted at once (they serve nothing).
Kubernetes 1.20 has no pod-deletion-cost, so the order matters: the ReplicaSet answers the
deletion with a replacement, which is Pending and unready and so the first pod it
removes when the replica count drops a moment later.

Failure signatures from log watching come in through `failing_pods(namespace, name)`, a set of
pod names to remove first (empty by default; runner.py passes the log watcher's).

Scale-ups are granted from the GPU budget (budget.py; k8s/gpu_plan.plan_gpus: replicas that fit
on one node their pods may use), read from watch-fed caches of Nodes and GPU-holding pods
(k8s/caches.py), never from a LIST per round. A budget the caches cannot vouch for holds
scale-ups (ScalingLimited, reason GPUBudgetUnknown): unknown is neither free nor full. Where a
node autoscaler adds GPU nodes (the budget's growth), replicas that fit no node are granted
Pending (ScalingLimited=False, reason WaitingForNode, an Event) and given back when no node came
in the provisioning timeout (reason NoNodeAdded).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kubernetes.client.exceptions import ApiException

from vlm_operator import metrics
from vlm_operator.api import crd, scaling_signals
from vlm_operator.api.reports import Event, Report
from vlm_operator.api.validation import SpecError, VLMDeployment, parse
from vlm_operator.autoscaling import recommend as a
from vlm_operator.autoscaling import starts
from vlm_operator.autoscaling.budget import GpuBudget, placement
from vlm_operator.autoscaling.pod_states import fenced, pod_state, removed_elsewhere
from vlm_operator.desired import children, stopping
from vlm_operator.k8s.caches import ClusterCache
from vlm_operator.k8s.gpu_plan import Claim
from vlm_operator.k8s.informer import Stale
from vlm_operator.k8s.kube import Kube, now_iso
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.podreads import reader
from vlm_operator.remediation import incidents

log = logging.getLogger(__name__)
CLAIM_FRESH_S = 15.0  # other VLMDeployments' claims older than this are ignored
# why the budget changed a decision -> the reason status.autoscaling gives (waiting for a node
# keeps the decision's own)
LIMITED_REASONS = {"InsufficientGPUs": a.ScalingReason.SCALING_LIMITED,
                   "NoNodeAdded": a.ScalingReason.SCALING_LIMITED,
                   "GPUBudgetUnknown": a.ScalingReason.GPU_BUDGET_UNKNOWN}
Key = tuple[str, str]


@dataclass
class _State:
    history: tuple[a.Point, ...] = ()
    counters: dict[str, tuple[tuple[float, float], float]] = field(default_factory=dict)
    last: tuple[int, a.ScalingReason, tuple] | None = None  # what status last said
    starts: starts.Starts = field(default_factory=starts.Starts)  # counted, and pods watched
    limited: tuple[str, str] | None = None  # (reason, message) while the budget holds a scale-up
    wrote_over: str | None = None  # resourceVersion of the view the last scale write came from
    no_node_until: float = 0.0  # no wait for a node to come before this (one came too late)


def metric_names(spec: dict) -> set[str]:
    """The /metrics samples `_sample` reads, for the round's scrape (reader.parse_metrics)."""
    return {"vllm:request_success_total", "vllm:mm_cache_queries_total",
            *(signal.metric for signal in scaling_signals.SIGNALS), *reader.IN_FLIGHT_METRICS,
            spec["autoscaling"]["metric"]}



def _none_failing(namespace: str, name: str) -> set[str]:
    return set()


class Autoscaler:
    def __init__(self, kube: Kube, reconcile: Callable[[str, str], None] = lambda ns, name: None,
                 clock: Callable[[], float] = time.time, *, budget: GpuBudget | None = None,
                 failing_pods: Callable[[str, str], set[str]] = _none_failing):
        """`reconcile(namespace, name)` publishes status when a condition this reports changes
        (Reconciler.refresh: logs its own errors); `budget`: the GPU budget scale-ups are
        granted from (budget.py; by default one over caches of its own); `failing_pods(namespace,
        name)`: the pods log watching finds failing, removed first on a scale-down (none by
        default)."""
        self.kube = kube
        self.budget = budget or GpuBudget(ClusterCache(kube))
        self.reconcile = reconcile
        self.clock = clock
        self.failing_pods = failing_pods
        self._states: dict[Key, _State] = {}
        self._claims: dict[Key, tuple[Claim, float]] = {}
        self._lock = threading.Lock()  # claims and priorities
        self._priorities: tuple[float, dict[str, int]] | None = None

    # -- inputs
    def _sample(self, vlmd: VLMDeployment, pod: dict, reading: reader.Scrape | None,
                state: _State, failing: set[str]) -> a.PodSample:
        name = Pod(pod).name
        created = Pod(pod).created_at or 0.0
        base = dict(name=name, created=created, failing=name in failing)
        if fenced(pod):  # recovering in place: no load to read, back once it is Ready
            return a.PodSample(state=a.LOADING, fenced=True, **base)
        seen = pod_state(pod)
        if seen != a.READY:
            return a.PodSample(state=seen, **base)
        if reading is None or reading.values is None:
            metrics.AUTOSCALER_SCRAPE_ERRORS.labels(vlmd.namespace, vlmd.name).inc()
            return a.PodSample(state=a.UNKNOWN, **base)  # capacity, load unknown (not zero)
        values = reading.values
        counters = (values.get("vllm:request_success_total", 0.0),
                    values.get("vllm:mm_cache_queries_total", 0.0))
        prev, last = state.counters.get(name, (None, 0.0))
        ipr = a.images_per_request(prev, counters, last)
        state.counters[name] = (counters, ipr)
        busy = sum(values.get(metric, 0.0) for metric in reader.IN_FLIGHT_METRICS)
        return a.PodSample(state=a.READY, metric=values.get(vlmd.spec["autoscaling"]["metric"],
                                                             0.0),
                           usage=tuple(values.get(signal.metric, 0.0)
                                       for signal in scaling_signals.SIGNALS),
                           images_per_request=ipr, busy=busy, **base)

    def _failing(self, vlmd: VLMDeployment) -> set[str]:
        try:
            return set(self.failing_pods(vlmd.namespace, vlmd.name))
        except Exception:  # another part's hook must never stop scaling
            log.exception("failing_pods hook failed")
            return set()

    def _priority(self, vlmd: VLMDeployment) -> int:
        explicit = vlmd.spec["autoscaling"].get("priority")
        if explicit is not None:
            return int(explicit)
        class_name = (vlmd.spec.get("scheduling") or {}).get("priorityClassName")
        if not class_name:
            return 0
        with self._lock:
            now = time.monotonic()
            if self._priorities is None or now - self._priorities[0] > 60:
                items = self.kube.list_cluster("/apis/scheduling.k8s.io/v1/priorityclasses")
                self._priorities = (now, {Pod(p).name: int(p.get("value", 0))
                                          for p in items})
            return self._priorities[1].get(class_name, 0)

    def _grant(self, vlmd: VLMDeployment, current: int, bound: int, desired: int,
               stuck: int, state: _State, now: float) -> tuple[int, tuple[str, str] | None]:
        """Replicas granted, and (reason, text) when the budget held some back, or some wait
        for a node a node autoscaler adds. `stuck`: its Pending pods the scheduler has refused
        for the budget's provisioning timeout: given back (the replicas drop by as many) and
        no new wait for a node for one more timeout."""
        key, priority = (vlmd.namespace, vlmd.name), self._priority(vlmd)
        growth = self.budget.growth
        try:
            claim = self.budget.claim(vlmd, priority, current, bound, desired)
        except Stale as exc:
            claim, stale = Claim(key, priority, vlmd.spec["gpusPerReplica"], current, bound,
                                 desired, vlmd.spec["gpuResourceName"], placement(vlmd)), exc
        else:
            stale = None
        with self._lock:
            self._claims[key] = (claim, time.monotonic())
            fresh = [c for c, t in self._claims.values()
                     if time.monotonic() - t <= CLAIM_FRESH_S]
        if growth is not None and stuck:
            state.no_node_until = now + growth.timeout_s
            target = min(desired, current - stuck)
            if target < current:
                return target, ("NoNodeAdded", (
                    f"no node came for {stuck} Pending replicas in the {growth.timeout_s:g} s "
                    f"provisioning timeout (--node-autoscaler-timeout-seconds): back to "
                    f"{target} replicas; no new wait for a node for {growth.timeout_s:g} s"))
        if desired <= current:  # scale-downs and holds need no budget
            return desired, None
        try:
            if stale is not None:
                raise stale
            grant = self.budget.grant(fresh, key, now >= state.no_node_until)
        except Stale as exc:
            return current, ("GPUBudgetUnknown", f"the free GPUs are unknown ({exc}); holding "
                                                 f"{current} replicas until they are known")
        if grant.to_come:
            return grant.granted, ("WaitingForNode", (
                f"{grant.to_come} of {grant.granted} replicas fit no node now and wait for a "
                f"node the node autoscaler adds (Pending, at most {growth.timeout_s:g} s)"))
        if grant.granted >= desired:
            return grant.granted, None
        return grant.granted, ("InsufficientGPUs", (
            f"only {grant.granted} of {desired} replicas fit the free GPUs ("
            f"{claim.gpus_per_replica} {claim.resource} per replica on one node its pods may "
            f"use; the most free on one such node: {grant.most})"))

    # -- one round
    def tick(self, body: dict, pods: list[dict],
             scrapes: dict[str, reader.Scrape]) -> a.ScalingRecommendation | None:
        """One round for one VLMDeployment (body: the plain-dict snapshot runtime/periodic.py keeps;
        pods and their readings: this round's, runtime/rounds.py)."""
        started = time.monotonic()
        meta = Body(body)
        key = (meta.namespace, meta.name)
        state = self._states.setdefault(key, _State())
        if state.wrote_over is not None and meta.resource_version == state.wrote_over:
            # this view predates our own last write (kopf's watch lags, or is down): deciding
            # on it again would repeat that write's drains and deletions; read it afresh
            body = self.kube.get_vlmd(*key)
            if body is None:
                return None
            meta = Body(body)
        try:
            vlmd = parse(body)
        except SpecError:
            return None
        self.budget.start()  # current by the time a scale-up needs it
        pods = [p for p in pods if not Pod(p).deleting
                and not removed_elsewhere(p)]
        failing = self._failing(vlmd)  # once a round, not once a pod
        samples = [self._sample(vlmd, p, scrapes.get(Pod(p).name), state, failing)
                   for p in pods]
        current = int(body["spec"].get("replicas", vlmd.spec["replicas"]))
        now = self.clock()
        decision = a.decide(a.ScalingRequest(
            samples, current, state.history, now,
            a.scaling_policy_from_spec(vlmd.spec["autoscaling"])))
        state.history = decision.history
        desired, reason, message = decision.desired, decision.reason, decision.message
        # a surge replacement's GPU stands in for its sick pod's: not one of the replicas
        surging = set(incidents.replacements(incidents.parse_in_flight(meta.annotations),
                                             pods).values())
        bound = sum(1 for s, p in zip(samples, pods, strict=True)
                    if s.state != a.PENDING and Pod(p).uid not in surging)
        growth = self.budget.growth
        stuck = sum(1 for s, p in zip(samples, pods, strict=True)
                    if growth is not None and s.state == a.PENDING
                    and Pod(p).uid not in surging
                    and Pod(p).unschedulable_s(now) >= growth.timeout_s)
        granted, limited = self._grant(vlmd, current, bound, desired, stuck, state, now)
        if limited is not None:
            message = f"{message}; {limited[1]}"
            reason = LIMITED_REASONS.get(limited[0], reason)
            desired = granted
            limited = (limited[0], message)
        # replicas first: the condition and Event then describe a scale already written
        self._act(vlmd, samples, current, desired, pods, now, state,
                  meta.resource_version)
        self._set_limited(body, state, limited)
        starting = [p for p in pods if not fenced(p)]  # a fence is no start of a new replica
        state.starts = starts.seen_starts(state.starts, starting)
        pending = starts.pending_replicas(starting, state.starts.seen)
        self._record(vlmd, decision, samples, current, desired, reason, message, state, pending)
        metrics.AUTOSCALER_TICK.observe(time.monotonic() - started)
        return replace(decision, desired=desired, reason=reason, message=message)

    def _act(self, vlmd: VLMDeployment, samples: list[a.PodSample], current: int, desired: int,
             pods: list[dict], now: float, state: _State, seen: str | None) -> None:
        """Drain, delete and write replicas, decided on the view of resourceVersion `seen`
        (recorded before the first write: later rounds on that view read afresh)."""
        ns, name = vlmd.namespace, vlmd.name
        draining = {Pod(p).name: since for p in pods
                    if (since := a.draining_since(p)) is not None}
        if desired > current:
            for pod in draining:
                self._mark(ns, pod, None)
            state.wrote_over = seen
            self.kube.scale_vlmd(ns, name, desired)
            metrics.AUTOSCALER_SCALES.labels(ns, name, "up").inc()
            log.info("%s/%s: scaled up %d -> %d", ns, name, current, desired)
            return
        plan = a.plan_scale_down(samples, desired, current, draining, now)
        for pod in plan.put_back:
            self._mark(ns, pod, None)
        for pod in plan.take_out:
            self._mark(ns, pod, now)
        if not plan.delete:
            return
        uids = {Pod(p).name: Pod(p).uid for p in pods}
        state.wrote_over = seen
        for pod in plan.delete:  # drained (or the drain limit passed): nothing to wait for
            self.kube.delete("v1", "Pod", ns, pod, uid=uids.get(pod),
                             grace_s=stopping.QUICK_GRACE_S)
        target = current - len(plan.delete)
        self.kube.scale_vlmd(ns, name, target)
        metrics.AUTOSCALER_SCALES.labels(ns, name, "down").inc()
        log.info("%s/%s: scaled down %d -> %d, removed drained %s", ns, name, current, target,
                 ", ".join(plan.delete))

    def _mark(self, namespace: str, pod: str, since: float | None) -> None:
        """Take a pod out of the Service (draining since `since`) or put it back (None)."""
        try:
            put_out_of_service(self.kube, namespace, pod, since)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _set_limited(self, body: dict, state: _State, limited: tuple[str, str] | None) -> None:
        if limited and (state.limited is None or state.limited[0] != limited[0]):
            self.kube.post_event(body, Event("Normal", "WaitingForNode", limited[1])
                                 if limited[0] == "WaitingForNode"
                                 else Event("Warning", "ScalingLimited", limited[1]))
        changed = (limited and limited[0]) != (state.limited and state.limited[0])
        state.limited = limited
        if changed:
            self.reconcile(*Body(body).key)

    def _record(self, vlmd: VLMDeployment, decision: a.ScalingRecommendation,
                samples: list[a.PodSample], current: int, desired: int,
                reason: a.ScalingReason, message: str, state: _State,
                pending: list[dict]) -> None:
        ns, name = vlmd.namespace, vlmd.name
        if decision.need is not None:
            metrics.AUTOSCALER_NEED.labels(ns, name).set(decision.need)
        weight = vlmd.spec["autoscaling"]["multimodalWeight"]
        metrics.AUTOSCALER_LOAD.labels(ns, name).set(sum(
            s.metric * (1 + weight * s.images_per_request) for s in samples
            if s.state == a.READY))
        metrics.AUTOSCALER_DESIRED.labels(ns, name).set(desired)
        metrics.AUTOSCALER_CURRENT.labels(ns, name).set(current)
        for kind in (a.READY, a.UNKNOWN, a.LOADING, a.PENDING):
            metrics.AUTOSCALER_READY.labels(ns, name, kind).set(
                sum(1 for s in samples if s.state == kind))
        metrics.AUTOSCALER_DECISIONS.labels(ns, name, reason).inc()
        said = (desired, reason, tuple(tuple(sorted(p.items())) for p in pending))
        if state.last == said:
            return
        state.last = said
        self.kube.patch_vlmd_status(ns, name, {"autoscaling": {
            "desiredReplicas": desired, "currentReplicas": current,
            "reason": f"{reason}: {message}", "time": now_iso(),
            "pendingReplicas": pending}})

    # -- for the reconciler and the handlers
    def reports(self, namespace: str, name: str) -> list[Report]:
        """Report provider (runner.py registers it): ScalingLimited while Builtin runs here."""
        state = self._states.get((namespace, name))
        if state is None:
            return []
        if state.limited:  # waiting for a node to come is no limit
            return [Report("ScalingLimited", "False" if state.limited[0] == "WaitingForNode"
                           else "True", *state.limited)]
        return [Report("ScalingLimited", "False", "WithinBudget",
                       "scale-ups fit the free GPUs")]

    def mode_reports(self, namespace: str, name: str) -> list[Report]:
        """Report provider: in KEDA mode, whether the cluster serves ScaledObjects at all."""
        body = self.kube.get_vlmd(namespace, name) or {}
        if crd.autoscaling_mode(body.get("spec")) != "KEDA":
            return []
        if self.kube.keda_served():
            return [Report("AutoscalerReady", "True", "ScaledObjectApplied",
                           "KEDA scales this VLMDeployment through a ScaledObject")]
        return [Report("AutoscalerReady", "False", "KEDANotInstalled",
                       "mode KEDA, but the cluster does not serve keda.sh/v1alpha1 "
                       "ScaledObjects: install KEDA (the ScaledObject is created once it is)")]

    def forget(self, namespace: str, name: str) -> None:
        """Autoscaling turned off, switched mode or the object is gone: drop its state."""
        self._states.pop((namespace, name), None)
        with self._lock:
            self._claims.pop((namespace, name), None)


def put_out_of_service(kube: Kube, namespace: str, pod: str, since: float | None) -> None:
    """One patch for the label the Service selects and the annotation that says since when, so
    a drain is never half recorded; since=None puts the pod back."""
    kube.patch_pod(namespace, pod,
                   labels={children.IN_SERVICE_LABEL: "false" if since is not None else "true"},
                   annotations={a.DRAIN_SINCE: f"{since:.3f}" if since is not None else None})
