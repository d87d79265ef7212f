"""The test bed a failure-matrix row runs on (Bed): its namespace, nodes, operator and load, the
fault injected through the stand-in, and what it observed (Observed)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from vlm_operator.api import crd
from vlm_operator.desired import children
from vlm_operator.remediation import incidents
from vlm_testbed.controlplane import kubectl_path, ready_namespace
from vlm_testbed.firewall import OPERATOR_GID
from vlm_testbed.load import LoadClient
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess
from vlm_testbed.realnode.imagebuild import vllm_image
from vlm_testbed.realnode.pods import is_ready

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
              env: list | None = None, image: str = IMAGE, **spec) -> dict:
    body_spec = {"model": "Qwen/Qwen2-VL-2B-Instruct", "image": image, "replicas": replicas,
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
    req = urllib.request.Request(f"http://{ip}:{children.PORT}{path}",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as rsp:
        return json.loads(rsp.read())


def healthy(ip: str | None) -> bool:
    if not ip:
        return False
    try:
        with urllib.request.urlopen(f"http://{ip}:{children.PORT}/health", timeout=1) as rsp:
            return rsp.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def instance(pod: Any) -> Instance:
    statuses = pod.status.container_statuses or []
    return pod.metadata.uid, (statuses[0].restart_count if statuses else 0)


class RealNodeFactory(Protocol):
    def __call__(self, gpus_per_node: int, nodes: int,
                 ) -> contextlib.AbstractContextManager[Any]: ...


class Bed:
    """One namespace, its simulated GPU node(s) and, where a scenario asks, operator
    processes of its own (else the operator watching the namespace is someone else's)."""

    def __init__(self, api: Any, kubeconfig: Any, namespace: str, *,
                 node_options: Mapping[str, Any] | None = None,
                 ready_timeout_s: float = READY_TIMEOUT_S,
                 real_nodes: RealNodeFactory | None = None) -> None:
        """node_options: more NodeSimulator arguments for the bed's nodes (real-cost starts:
        vllm_time_scale, image_pull_seconds, downward_api_lag); ready_timeout_s: how long a
        row waits for pods to be ready before its fault; real_nodes: where given, the bed's
        nodes are real kubelets made by it (`real_nodes(gpus_per_node, nodes)`, a context
        manager of an object with node_names), not simulated ones, and its VLMDeployments run
        the project's image of the same vLLM release (the simulator plays the plugin in any
        image; a real image has it only where images/vllm/Dockerfile installed it)."""
        self.api, self.kubeconfig, self.ns = api, kubeconfig, namespace
        self.node_options = dict(node_options or {})
        self.real_nodes = real_nodes
        self.image = IMAGE if real_nodes is None else vllm_image(IMAGE.rsplit(":", 1)[1])
        self.ready_timeout_s = ready_timeout_s
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
            **options: Any) -> Iterator[Bed]:
        if create_namespace:
            ready_namespace(api, namespace)
        bed = cls(api, kubeconfig, namespace, **options)
        try:
            with bed._stack:
                yield bed
        finally:
            if create_namespace:
                bed._delete_namespace(namespace)

    def tenant(self, suffix: str) -> Bed:
        """A bed on another namespace (`<ns>-<suffix>`, watched like this one), for rows with
        two tenants; deleted with this bed, served by this bed's nodes."""
        other = Bed(self.api, self.kubeconfig, f"{self.ns}-{suffix}",
                    node_options=self.node_options, ready_timeout_s=self.ready_timeout_s,
                    real_nodes=self.real_nodes)
        ready_namespace(self.api, other.ns)
        other.watcher = self.watcher
        self._stack.callback(self._delete_namespace, other.ns)
        return other

    def _delete_namespace(self, namespace: str) -> None:
        with contextlib.suppress(ApiException):
            self.core.delete_namespace(namespace)

    # -- the node and operator side
    def nodes(self, gpus_per_node: int, nodes: int = 1, tag: str = "n",
              **options: Any) -> Any:
        """GPU nodes (simulated, or real where the bed has real_nodes); `options`: more
        NodeSimulator arguments for these nodes only (a row's own kubelet back-off), which a
        real kubelet does not take: such a row runs on simulated nodes only."""
        if self.real_nodes is not None:
            if options or self.node_options:
                raise ValueError(f"real nodes take no simulator options "
                                 f"({sorted({**self.node_options, **options})})")
            return self._stack.enter_context(self.real_nodes(gpus_per_node, nodes))
        sim = NodeSimulator(self.kubeconfig, nodes=nodes, gpus_per_node=gpus_per_node,
                            **{"backoff_base": 1.0, **self.node_options, **options},
                            name_prefix=f"sim-{self.ns}-{tag}")
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

    def run(self, row: Any) -> Observed:
        """A failure-matrix row (rows.Row) on this bed, the default spec unless the row says
        otherwise; what it observed, printed. On failure, the bed's own operators' log tails
        are printed before the error goes on."""
        try:
            seen = row.run(self, None)
        except BaseException:
            for proc in self.operators:
                print(f"operator {proc.log_path}:", proc.log()[-4000:], sep="\n")
            raise
        print(row.id, seen.as_dict())
        return seen

    # -- VLMDeployments
    def create(self, name: str, **kw) -> None:
        if self.real_nodes is not None:  # starts at once, as the simulator's nodes make it
            kw["env"] = [{"name": "VLM_SIM_TIME_SCALE", "value": "0"}, *(kw.get("env") or [])]
        body = vlmd_body(name, image=self.image, **kw)
        self.custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, self.ns,
                                                    crd.PLURAL, body)

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
            self.ns, label_selector=children.get_selector(name)).items

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
        """n ready pods that answer /health, none of them about to go; on time out, what the
        VLMDeployment, its pods and the namespace's Events showed."""
        try:
            return self.wait(f"{n} ready pods of {name}", lambda: len(
                r := [p for p in self.ready(name) if healthy(p.status.pod_ip)]) >= n and r,
                timeout=self.ready_timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe(name)}") from None

    def describe(self, name: str) -> str:
        """The VLMDeployment's conditions, each pod's state and log tail, the namespace's last
        Events and what the operators said about it: what a failed wait leaves to read."""
        lines: list[str] = []
        with contextlib.suppress(ApiException):
            lines += [f"condition {c['type']}={c['status']} {c.get('reason')}: "
                      f"{c.get('message')}"
                      for c in (self.get(name).get("status") or {}).get("conditions") or []]
        with contextlib.suppress(ApiException):
            for pod in self.pods(name):
                st = pod.status
                lines.append(f"pod {pod.metadata.name} {st.phase} node={pod.spec.node_name} "
                             f"ip={st.pod_ip} ready={is_ready(pod)} "
                             f"healthy={bool(st.pod_ip) and healthy(st.pod_ip)} "
                             f"deleting={pod.metadata.deletion_timestamp is not None}")
                lines += [f"  container {c.name} ready={c.ready} restarts={c.restart_count} "
                          f"state={c.state.to_dict()}" for c in st.container_statuses or []]
                with contextlib.suppress(ApiException):
                    tail = self.core.read_namespaced_pod_log(pod.metadata.name, self.ns,
                                                             tail_lines=15)
                    lines += [f"  | {line}" for line in (tail or "").splitlines()]
        with contextlib.suppress(ApiException):
            events = sorted(self.core.list_namespaced_event(self.ns).items,
                            key=lambda e: str(e.last_timestamp or e.event_time))
            lines += [f"event {e.involved_object.kind}/{e.involved_object.name} {e.reason}: "
                      f"{(e.message or '')[:300]}" for e in events[-25:]]
        for proc in [p for p in (self.watcher, *self.operators) if p is not None]:
            with contextlib.suppress(OSError):
                said = [line for line in proc.log().splitlines()
                        if self.ns in line or " WARNING " in line or " ERROR " in line]
                lines += [f"operator {proc.log_path.name} | {line[:400]}" for line in said[-40:]]
        return "\n".join(lines)

    def _events(self, name: str) -> list[Any]:
        return [e for e in self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name}").items
            if e.involved_object.kind == crd.KIND]

    def events(self, name: str) -> Counter:
        return Counter(e.reason for e in self._events(name))

    def messages(self, name: str, *reasons: str) -> list[str]:
        """The messages of the VLMDeployment's Events of these reasons."""
        return [e.message for e in self._events(name) if e.reason in reasons]

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
