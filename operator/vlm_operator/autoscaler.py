"""The Builtin autoscaler's acting side: scrape pods, ask autoscaling.py, write the results.

One `tick` per VLMDeployment every second (periodic.py). Replicas are
written through the VLMDeployment's scale subresource, the last decision into
status.autoscaling (only that key), inputs and outputs into the operator's metrics.

Scale-down is graceful: the chosen pod leaves the Service first (label IN_SERVICE_LABEL=false),
is deleted when drained (no running or waiting request) or after DRAIN_TIMEOUT_S, and only then
is spec.replicas lowered. Kubernetes 1.20 has no pod-deletion-cost, so the order matters: the
ReplicaSet answers the deletion with a replacement, which is Pending and unready and so the
first pod it removes when the replica count drops a moment later.

Failure signatures from log watching come in through `failing_pods(namespace, name)`, a set of
pod names to remove first (empty by default; the log watcher sets it).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from vlm_operator import autoscaling as a
from vlm_operator import builders, metrics
from vlm_operator.kube import Kube, now_iso
from vlm_operator.spec import SpecError, VLMDeployment, parse
from vlm_operator.status import Event, Report

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 1.0
CLAIM_FRESH_S = 15.0  # other VLMDeployments' claims older than this are ignored
CLUSTER_CACHE_S = 0.5
Key = tuple[str, str]


@dataclass
class _State:
    history: tuple[a.Point, ...] = ()
    draining: dict[str, float] = field(default_factory=dict)
    counters: dict[str, tuple[tuple[float, float], float]] = field(default_factory=dict)
    last: tuple[int, str] | None = None
    limited: str | None = None  # message while a scale-up is held back by the GPU budget


def is_builtin(spec: dict) -> bool:
    scaling = (spec or {}).get("autoscaling") or {}
    return bool(scaling.get("enabled")) and scaling.get("mode", "Builtin") == "Builtin"


def parse_pod_metrics(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (engines, finished reasons)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def _creation(pod: dict) -> float:
    stamp = pod["metadata"].get("creationTimestamp")
    if not stamp:
        return 0.0
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=dt.UTC).timestamp()


def _pod_state(pod: dict) -> str:
    st = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in st.get("conditions") or [])
    if ready and st.get("podIP"):
        return a.READY
    return a.LOADING if (pod.get("spec") or {}).get("nodeName") else a.PENDING


class Autoscaler:
    def __init__(self, kube: Kube, reconcile: Callable[[str, str], None] = lambda ns, name: None,
                 clock: Callable[[], float] = time.time):
        self.kube = kube
        self.reconcile = reconcile  # publishes status when a condition this reports changes
        # (Reconciler.refresh: logs its own errors)
        self.clock = clock
        self.failing_pods: Callable[[str, str], set[str]] = lambda namespace, name: set()
        self._states: dict[Key, _State] = {}
        self._claims: dict[Key, tuple[a.Claim, float]] = {}
        self._lock = threading.Lock()  # claims and the cluster cache
        self._cluster: tuple[float, int] | None = None
        self._priorities: tuple[float, dict[str, int]] | None = None

    # -- inputs
    def _scrape(self, vlmd: VLMDeployment, pod: dict, state: _State) -> a.PodSample:
        name = pod["metadata"]["name"]
        base = dict(name=name, created=_creation(pod),
                    failing=name in self._failing(vlmd))
        pod_state = _pod_state(pod)
        if pod_state != a.READY:
            return a.PodSample(state=pod_state, **base)
        url = f"http://{pod['status']['podIP']}:{builders.PORT}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as rsp:
                values = parse_pod_metrics(rsp.read().decode())
        except (OSError, ValueError) as exc:
            metrics.AUTOSCALER_SCRAPE_ERRORS.labels(vlmd.namespace, vlmd.name).inc()
            log.debug("scrape of %s failed: %s", url, exc)
            return a.PodSample(state=a.LOADING, **base)  # no numbers: capacity, not load
        counters = (values.get("vllm:request_success_total", 0.0),
                    values.get("vllm:mm_cache_queries_total", 0.0))
        prev, last = state.counters.get(name, (None, 0.0))
        ipr = a.images_per_request(prev, counters, last)
        state.counters[name] = (counters, ipr)
        busy = values.get("vllm:num_requests_running", 0.0) + values.get(
            "vllm:num_requests_waiting", 0.0)
        return a.PodSample(state=a.READY, metric=values.get(vlmd.spec["autoscaling"]["metric"],
                                                             0.0),
                           kv_cache=values.get("vllm:kv_cache_usage_perc", 0.0),
                           images_per_request=ipr, busy=busy, **base)

    def _failing(self, vlmd: VLMDeployment) -> set[str]:
        try:
            return set(self.failing_pods(vlmd.namespace, vlmd.name))
        except Exception:  # another part's hook must never stop scaling
            log.exception("failing_pods hook failed")
            return set()

    def _free_gpus(self) -> int:
        with self._lock:
            now = time.monotonic()
            if self._cluster is None or now - self._cluster[0] > CLUSTER_CACHE_S:
                nodes = self.kube.list_cluster("/api/v1/nodes")
                pods = self.kube.list_cluster("/api/v1/pods")
                self._cluster = (now, a.free_gpus(nodes, pods))
                metrics.AUTOSCALER_FREE_GPUS.set(self._cluster[1])
            return self._cluster[1]

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
                self._priorities = (now, {p["metadata"]["name"]: int(p.get("value", 0))
                                          for p in items})
            return self._priorities[1].get(class_name, 0)

    def _grant(self, vlmd: VLMDeployment, current: int, bound: int, desired: int) -> int:
        key = (vlmd.namespace, vlmd.name)
        claim = a.Claim(key, self._priority(vlmd), vlmd.spec["gpusPerReplica"], current, bound,
                        desired)
        free = self._free_gpus()
        with self._lock:
            now = time.monotonic()
            self._claims[key] = (claim, now)
            fresh = [c for c, t in self._claims.values() if now - t <= CLAIM_FRESH_S]
        return a.share_gpus(free, fresh)[key]

    # -- one round
    def tick(self, body: dict) -> a.Decision | None:
        """One round for one VLMDeployment (body: the plain-dict snapshot periodic.py keeps;
        read, never changed)."""
        started = time.monotonic()
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        try:
            vlmd = parse(body)
        except SpecError:
            return None
        if not is_builtin(vlmd.spec):
            self.forget(*key)
            return None
        state = self._states.setdefault(key, _State())
        pods = [p for p in self.kube.list_pods(vlmd.namespace, builders.get_selector(vlmd.name))
                if not p["metadata"].get("deletionTimestamp")]
        samples = [self._scrape(vlmd, p, state) for p in pods]
        current = int(body["spec"].get("replicas", vlmd.spec["replicas"]))
        now = self.clock()
        decision = a.decide(samples, current, state.history, now,
                            a.policy_from_spec(vlmd.spec["autoscaling"]))
        state.history = decision.history
        desired, reason, message = decision.desired, decision.reason, decision.message
        bound = sum(1 for s in samples if s.state != a.PENDING)
        granted = self._grant(vlmd, current, bound, desired)
        if granted < desired:
            message = (f"{message}; only {granted} of {desired} replicas fit the free GPUs "
                       f"({vlmd.spec['gpusPerReplica']} per replica)")
            reason, desired = "ScalingLimited", granted
            self._set_limited(body, state, message)
        else:
            self._set_limited(body, state, None)
        self._act(vlmd, samples, current, desired, state, now)
        self._record(vlmd, decision, samples, current, desired, reason, message, state)
        metrics.AUTOSCALER_TICK.observe(time.monotonic() - started)
        return a.Decision(desired, reason, message, decision.need, decision.history)

    def _act(self, vlmd: VLMDeployment, samples: list[a.PodSample], current: int, desired: int,
             state: _State, now: float) -> None:
        ns, name = vlmd.namespace, vlmd.name
        if desired > current:
            for pod in list(state.draining):
                self._label(ns, pod, "true")
            state.draining.clear()
            self.kube.scale_vlmd(ns, name, desired)
            metrics.AUTOSCALER_SCALES.labels(ns, name, "up").inc()
            log.info("%s/%s: scaled up %d -> %d", ns, name, current, desired)
            return
        plan = a.plan_scale_down(samples, desired, current, state.draining, now)
        state.draining = {n: t for n, t in state.draining.items()
                          if n in {s.name for s in samples} and n not in plan.put_back}
        for pod in plan.put_back:
            self._label(ns, pod, "true")
        for pod in plan.take_out:
            self._label(ns, pod, "false")
            state.draining[pod] = now
        if not plan.delete:
            return
        for pod in plan.delete:
            self.kube.delete("v1", "Pod", ns, pod)
            state.draining.pop(pod, None)
        target = current - len(plan.delete)
        self.kube.scale_vlmd(ns, name, target)
        metrics.AUTOSCALER_SCALES.labels(ns, name, "down").inc()
        log.info("%s/%s: scaled down %d -> %d, removed drained %s", ns, name, current, target,
                 ", ".join(plan.delete))

    def _label(self, namespace: str, pod: str, value: str) -> None:
        try:
            self.kube.patch_pod_labels(namespace, pod, {builders.IN_SERVICE_LABEL: value})
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _set_limited(self, body: dict, state: _State, message: str | None) -> None:
        if message and state.limited is None:
            self.kube.post_event(body, Event("Warning", "ScalingLimited", message))
        changed = (message is None) != (state.limited is None)
        state.limited = message
        if changed:
            self.reconcile(body["metadata"]["namespace"], body["metadata"]["name"])

    def _record(self, vlmd: VLMDeployment, decision: a.Decision, samples: list[a.PodSample],
                current: int, desired: int, reason: str, message: str, state: _State) -> None:
        ns, name = vlmd.namespace, vlmd.name
        if decision.need is not None:
            metrics.AUTOSCALER_NEED.labels(ns, name).set(decision.need)
        weight = vlmd.spec["autoscaling"]["multimodalWeight"]
        metrics.AUTOSCALER_LOAD.labels(ns, name).set(sum(
            s.metric * (1 + weight * s.images_per_request) for s in samples
            if s.state == a.READY))
        metrics.AUTOSCALER_DESIRED.labels(ns, name).set(desired)
        metrics.AUTOSCALER_CURRENT.labels(ns, name).set(current)
        for pod_state in (a.READY, a.LOADING, a.PENDING):
            metrics.AUTOSCALER_READY.labels(ns, name, pod_state).set(
                sum(1 for s in samples if s.state == pod_state))
        metrics.AUTOSCALER_DECISIONS.labels(ns, name, reason).inc()
        if state.last == (desired, reason):
            return
        state.last = (desired, reason)
        self.kube.patch_vlmd_status(ns, name, {"autoscaling": {
            "desiredReplicas": desired, "currentReplicas": current,
            "reason": f"{reason}: {message}", "time": now_iso()}})

    # -- for the reconciler and the handlers
    def reports(self, namespace: str, name: str) -> list[Report]:
        """Report provider (runner.py registers it): ScalingLimited while Builtin runs here."""
        state = self._states.get((namespace, name))
        if state is None:
            return []
        if state.limited:
            return [Report("ScalingLimited", "True", "InsufficientGPUs", state.limited)]
        return [Report("ScalingLimited", "False", "WithinBudget",
                       "scale-ups fit the free GPUs")]

    def mode_reports(self, namespace: str, name: str) -> list[Report]:
        """Report provider: in KEDA mode, whether the cluster serves ScaledObjects at all."""
        body = self.kube.get_vlmd(namespace, name) or {}
        scaling = (body.get("spec") or {}).get("autoscaling") or {}
        if not scaling.get("enabled") or scaling.get("mode") != "KEDA":
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
