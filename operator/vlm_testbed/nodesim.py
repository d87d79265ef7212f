"""Simulated node side of the local test bed: kubelet + container runtime, nothing else.

The apiserver, scheduler and controllers are real (controlplane.py); only the node is
simulated, because there is no kubelet or container runtime on these machines. A
NodeSimulator registers Nodes, keeps them Ready (Lease heartbeat + status conditions), and for
every pod bound to them runs one local process per container in place of the container:
probes, restarts with back-off, termination (the preStop hook within the grace period, then
SIGTERM, then SIGKILL) and pods/status are done here as the kubelet would.
Container logs are kept per container instance with RFC3339Nano timestamps and served on the
kubelet's HTTPS /containerLogs endpoint, so `kubectl logs [-f] [--previous]` works through the
real apiserver.

Images containing `vllm` run `python -m vlm_testbed.vllmsim` with the container's args after
`serve` (pass `command_for=` to run something else, e.g. a real `vllm serve`); other images run
their command if it exists on this machine, else an idle process.

Pods that need no process (annotation vlm-testbed/process=none, or all pods the `light`
predicate picks): Running and Ready at once, status written once, vLLM's HTTP surface answered
from one event loop (LightPod): for clusters of thousands of pods, where a process per pod would
not fit (bench/scale.py).

Pods get loopback IPs (127.x.y.z, one per pod): EndpointSlices accept them, but core/v1
Endpoints validation rejects loopback addresses, so Services' Endpoints stay empty.

Usage: python -m vlm_testbed.nodesim --kubeconfig K --nodes N --gpus-per-node G
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import http.server
import itertools
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("vlm_testbed.nodesim")

SIM_LABEL = "vlm-testbed/simulated"
NO_PROCESS = "vlm-testbed/process"  # pod annotation: "none" = a LightPod
STATUS_EVERY = 3  # heartbeats per Node status write (the Lease is renewed every heartbeat)
GPU = "nvidia.com/gpu"
NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
SMP = "application/strategic-merge-patch+json"  # the client would default to json-patch
MIN_GRACE_S = 2  # the kubelet always leaves a container this long between SIGTERM and SIGKILL
CommandFor = Callable[[dict, str], list[str]]


# ----------------------------------------------------------------- pure helpers

def rfc3339nano(ns: int) -> str:
    """Go's time.RFC3339Nano in UTC (trailing zeros of the fraction trimmed), as the kubelet
    stamps container log lines."""
    secs, frac = divmod(ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
    digits = f"{frac:09d}".rstrip("0")
    return f"{base}.{digits}Z" if digits else f"{base}Z"


def rfc3339(ns: int | None = None) -> str:
    secs = (time.time_ns() if ns is None else ns) // 1_000_000_000
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(secs))


def parse_rfc3339_ns(text: str) -> int:
    """RFC3339 / RFC3339Nano -> nanoseconds since the epoch (fractions up to ns kept)."""
    text = text.strip().replace("z", "Z")
    main, frac, tz = text, "", "+00:00"
    if text.endswith("Z"):
        main = text[:-1]
    elif len(text) > 6 and text[-6] in "+-" and text[-3] == ":":
        main, tz = text[:-6], text[-6:]
    if "." in main:
        main, frac = main.split(".", 1)
    when = dt.datetime.fromisoformat(main + tz)
    return int(when.timestamp()) * 1_000_000_000 + int((frac + "000000000")[:9])


def backoff_delay(crashes: int, base: float, cap: float) -> float:
    """The kubelet's restart back-off: the first restart is immediate, then base, 2*base, ...
    capped. `crashes` counts exits since the last reset (1 for the first exit)."""
    if crashes <= 1:
        return 0.0
    return min(cap, base * 2 ** (crashes - 2))


def should_restart(policy: str, exit_code: int, init: bool = False) -> bool:
    if init:
        return exit_code != 0 and policy != "Never"
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def exit_code_of(returncode: int) -> int:
    """A process killed by signal N reports 128+N, like a container's exit code."""
    return 128 - returncode if returncode < 0 else returncode


def default_command(container: dict, pod_ip: str) -> list[str]:
    """image -> local argv. vllm images run the vLLM simulator bound to the pod's IP."""
    image = container.get("image", "")
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    if "vllm" in image:
        tokens = command + args
        rest = tokens[tokens.index("serve") + 1:] if "serve" in tokens else args
        return [sys.executable, "-m", "vlm_testbed.vllmsim", *rest, "--host", pod_ip]
    if command and shutil.which(command[0]):
        return command + args
    return [sys.executable, "-c", "import signal; signal.pause()"]


def field_value(pod: dict, path: str, pod_ip: str) -> str | None:
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName"),
              "status.podIP": pod_ip, "status.hostIP": "127.0.0.1", "status.podIPs": pod_ip}
    if path in simple:
        return simple[path]
    for prefix, key in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        if path.startswith(prefix + "['") and path.endswith("']"):
            return (meta.get(key) or {}).get(path[len(prefix) + 2:-2])
    return None


def resolve_env(pod: dict, container: dict, pod_ip: str,
                lookup: Callable[[str, str, str], str | None]) -> dict[str, str]:
    """The container's environment; lookup(kind, name, key) reads Secrets/ConfigMaps
    (kind is "secret" or "configmap"; key None means the whole object as a dict)."""
    env: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind, ref_key in (("configmap", "configMapRef"), ("secret", "secretRef")):
            ref = src.get(ref_key)
            if ref:
                for k, v in (lookup(kind, ref["name"], None) or {}).items():
                    env[prefix + k] = v
    for item in container.get("env") or []:
        name, value = item["name"], item.get("value")
        source = item.get("valueFrom") or {}
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = lookup("secret", ref["name"], ref["key"])
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = lookup("configmap", ref["name"], ref["key"])
        elif "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"], pod_ip)
        elif "resourceFieldRef" in source:
            res = source["resourceFieldRef"]["resource"]
            kind, _, rname = res.partition(".")
            value = str(((container.get("resources") or {}).get(kind) or {}).get(rname, "0"))
        if value is not None:
            env[name] = _expand(str(value), env)
    return env


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion against variables defined earlier."""
    for k, v in env.items():
        value = value.replace(f"$({k})", v)
    return value


def format_log_line(ns: int, stream: str, text: str) -> str:
    """The CRI log file format the kubelet reads: `<RFC3339Nano> <stream> F <text>`."""
    return f"{rfc3339nano(ns)} {stream} F {text}\n"


def parse_log_line(line: str) -> tuple[int, str, str] | None:
    parts = line.rstrip("\n").split(" ", 3)
    if len(parts) < 4:
        return None
    return parse_rfc3339_ns(parts[0]), parts[0], parts[3]


def render_log_lines(lines: list[str], since_ns: int | None, tail: int | None,
                     timestamps: bool) -> list[str]:
    """Filter stored lines as the kubelet does for sinceTime/sinceSeconds, tailLines and
    timestamps=true."""
    parsed = [p for p in (parse_log_line(x) for x in lines) if p]
    if since_ns is not None:
        parsed = [p for p in parsed if p[0] >= since_ns]
    if tail is not None and tail >= 0:
        parsed = parsed[len(parsed) - tail:] if tail else []
    return [f"{stamp} {text}\n" if timestamps else f"{text}\n" for _, stamp, text in parsed]


def probe_port(container: dict, port: Any) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


def overwritten(pod: dict, sent: dict | None) -> bool:
    """Whether someone else changed the pod's conditions since the kubelet wrote them (the
    node controller marks an unreachable node's pods NotReady; the kubelet writes them back)."""
    if sent is None:
        return False
    def view(conditions):
        return {c.get("type"): c.get("status") for c in conditions or []}
    return view((pod.get("status") or {}).get("conditions")) != view(sent.get("conditions"))


def terminated_state(t: Terminated) -> dict:
    """A terminated state as the kubelet writes it; one the runtime lost (ContainerStatusUnknown)
    has no times and no containerID."""
    if not t.container_id:
        return {"terminated": {"exitCode": t.exit_code, "reason": t.reason,
                               "message": t.message}}
    return {"terminated": {"exitCode": t.exit_code, "reason": t.reason,
                           "startedAt": rfc3339(t.started_ns), "finishedAt": rfc3339(t.finished_ns),
                           "containerID": t.container_id}}


def pod_phase(restart_policy: str, init_done: bool, statuses: list[ContainerView]) -> str:
    """The kubelet's pod phase from its containers' states."""
    if not init_done or any(not s.ever_started for s in statuses):
        return "Failed" if any(s.failed_for_good for s in statuses) else "Pending"
    if any(s.running or s.will_restart for s in statuses):
        return "Running"
    if all(s.last_exit == 0 for s in statuses):
        return "Succeeded"
    return "Failed" if restart_policy != "Always" else "Running"


def run_pre_stop(hook: dict, timeout: float, *, cwd: str | os.PathLike, env: dict[str, str],
                 host: str, container: dict) -> str | None:
    """Run a preStop hook (exec or httpGet) for at most `timeout` seconds, as the kubelet runs
    it in the container; returns why it failed, or None. An exec hook runs as a local process
    with the container's environment; one that outlasts the timeout is killed."""
    if "exec" in hook:
        proc = subprocess.Popen(hook["exec"].get("command") or [], cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"exec did not finish within {timeout:g} s"
        if proc.returncode:
            return f"exec exited with {proc.returncode}: {out.decode(errors='replace')[-300:]}"
        return None
    if "httpGet" in hook:
        h = hook["httpGet"]
        url = (f"{h.get('scheme', 'HTTP').lower()}://{h.get('host') or host}:"
               f"{probe_port(container, h['port'])}{h.get('path', '/')}")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as rsp:
                rsp.read()
        except (OSError, ValueError) as exc:
            return f"httpGet {url}: {exc}"
        return None
    return "no handler the simulator runs (exec, httpGet)"


def stop_process_group(pid: int, done: threading.Event, grace: float,
                       pre_stop: Callable[[float], object] | None = None) -> None:
    """The kubelet's container stop: the preStop hook gets up to `grace` seconds, SIGTERM then
    gets what is left (whole seconds, at least MIN_GRACE_S), then SIGKILL."""
    started = time.monotonic()
    if pre_stop is not None and grace > 0:
        hook = threading.Thread(target=pre_stop, args=(grace,), daemon=True)
        hook.start()
        hook.join(grace)
    left = max(MIN_GRACE_S, grace - int(time.monotonic() - started))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    if not done.wait(left):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        done.wait(10)


# ----------------------------------------------------------------- container runtime

@dataclass
class Terminated:
    exit_code: int
    reason: str
    started_ns: int
    finished_ns: int
    container_id: str  # "": the runtime has no record of it (LOST)
    message: str = ""


# What the kubelet reports for a container that was running when the runtime lost its record
# of it (kubelet_pods.go, convertToAPIContainerStatuses: a node restart that wiped the
# runtime's state): no containerID, so `kubectl logs --previous` has nothing to read.
LOST = Terminated(137, "ContainerStatusUnknown", 0, 0, "",
                  "The container could not be located when the pod was deleted.  The container "
                  "used to be Running")


@dataclass
class ContainerView:
    """What pod_phase needs to know about one container."""

    ever_started: bool
    running: bool
    will_restart: bool
    last_exit: int | None
    failed_for_good: bool


@dataclass
class Instance:
    """One run of a container (the kubelet's 'container' as opposed to the spec)."""

    index: int
    log_path: Path
    container_id: str
    started_ns: int = 0
    proc: subprocess.Popen | None = None
    done: threading.Event = field(default_factory=threading.Event)
    appended: threading.Condition | None = None  # notified per write (LightContainer)
    lines: int = 0  # lines written, where `appended` is set
    lost: bool = False  # the runtime lost its record (lose_container): its log cannot be read


_prctl = getattr(ctypes.CDLL(None), "prctl", None)  # looked up before any fork


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the simulator dies without cleaning up."""
    if _prctl is not None:
        _prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class Container:
    """Runs one container of a pod as a local process: restarts, probes, logs."""

    def __init__(self, pod: PodRunner, spec: dict, init: bool = False) -> None:
        self.pod = pod
        self.spec = spec
        self.name = spec["name"]
        self.init = init
        self.dir = pod.dir / (("init-" if init else "") + self.name)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.instances: list[Instance] = []
        self.restart_count = 0
        self.ready = False
        self.started = False
        self.waiting: tuple[str, str] | None = ("ContainerCreating", "")
        self.last: Terminated | None = None
        self.current_terminated: Terminated | None = None
        self.crashes = 0
        self.finished = threading.Event()  # no more restarts
        self.kill_reason: str | None = None
        self.stop = threading.Event()
        self.env: dict[str, str] = {}  # the environment of the last start (hooks run in it)
        self.losing = False  # lose() was called: the running instance goes as LOST

    # -- the kubelet's view for pods/status
    def status(self) -> dict:
        inst = self.instances[-1] if self.instances else None
        if self.waiting:
            state = {"waiting": {"reason": self.waiting[0], **(
                {"message": self.waiting[1]} if self.waiting[1] else {})}}
        elif self.current_terminated:
            state = terminated_state(self.current_terminated)
        else:
            state = {"running": {"startedAt": rfc3339(inst.started_ns if inst else None)}}
        out = {"name": self.name, "image": self.spec.get("image", ""),
               "imageID": f"sim://{self.spec.get('image', '')}", "ready": self.ready,
               "restartCount": self.restart_count, "state": state,
               "lastState": terminated_state(self.last) if self.last else {}}
        if inst:
            out["containerID"] = inst.container_id
        if not self.init:
            out["started"] = self.started
        return out

    def view(self) -> ContainerView:
        running = bool(self.instances) and not self.instances[-1].done.is_set()
        last = self.current_terminated or self.last
        return ContainerView(ever_started=bool(self.instances), running=running,
                             will_restart=not self.finished.is_set(),
                             last_exit=last.exit_code if last else None,
                             failed_for_good=self.finished.is_set() and bool(last)
                             and last.exit_code != 0)

    # -- lifecycle
    def run(self) -> None:
        """Start, wait, restart per policy with back-off, until stopped or done."""
        policy = self.pod.spec.get("restartPolicy", "Always")
        lost = False
        while not self.stop.is_set():
            if self.crashes:
                delay = 0 if lost else backoff_delay(self.crashes, self.pod.sim.backoff_base,
                                                     self.pod.sim.backoff_cap)
                if delay:
                    meta = self.pod.meta
                    self.waiting = ("CrashLoopBackOff",
                                    f"back-off {delay:g}s restarting failed container="
                                    f"{self.name} pod={meta['name']}_{meta['namespace']}"
                                    f"({meta['uid']})")
                    self.pod.changed()
                    if self.stop.wait(delay):
                        break
                self.restart_count += 1
            started = time.monotonic()
            term = self._run_once()
            if term is None:  # could not start
                break
            lost, self.losing = self.losing, False
            if lost:  # the restarted node's kubelet starts it again at once
                self.instances[-1].lost = True
                term = self.current_terminated = LOST
            if time.monotonic() - started > 2 * self.pod.sim.backoff_cap:
                self.crashes = 0
            self.crashes += 1
            if self.stop.is_set() or not should_restart(policy, term.exit_code, self.init):
                break
            self.last, self.current_terminated = term, None
            self.pod.changed()
        self.ready = False
        self.finished.set()
        self.pod.changed()

    def _run_once(self) -> Terminated | None:
        index = len(self.instances)
        inst = Instance(index, self.dir / f"{index}.log", f"sim://{uuid.uuid4().hex}")
        try:
            argv = self.pod.sim.command_for(self.spec, self.pod.ip)
            env = self.env = self.pod.container_env(self.spec)
            inst.proc = subprocess.Popen(
                argv, env=env, cwd=self.dir, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=_die_with_parent)
        except Exception as exc:  # any start failure is the container's error
            log.warning("cannot start %s/%s: %s", self.pod.key, self.name, exc)
            inst.started_ns = time.time_ns()
            inst.log_path.write_text(format_log_line(time.time_ns(), "stderr", str(exc)))
            inst.done.set()
            self.instances.append(inst)
            now = time.time_ns()
            self.waiting, self.current_terminated = None, Terminated(
                128, "StartError", now, now, inst.container_id)
            return self.current_terminated
        inst.started_ns = time.time_ns()
        self.instances.append(inst)
        self.waiting, self.current_terminated, self.ready = None, None, False
        self.started = not self.spec.get("startupProbe")
        self.kill_reason = None
        self.pod.changed()
        lock = threading.Lock()
        with open(inst.log_path, "a", encoding="utf-8") as sink:
            readers = [threading.Thread(target=self._pump, args=(s, name, sink, lock),
                                        daemon=True)
                       for s, name in ((inst.proc.stdout, "stdout"), (inst.proc.stderr, "stderr"))]
            for r in readers:
                r.start()
            if not self.init:
                threading.Thread(target=self._probe_loop, args=(inst,), daemon=True).start()
            returncode = inst.proc.wait()
            for r in readers:
                r.join(5)
        code = exit_code_of(returncode)
        term = Terminated(code, "Completed" if code == 0 else "Error", inst.started_ns,
                          time.time_ns(), inst.container_id)
        self.ready = False
        self.current_terminated = term
        inst.done.set()
        self.pod.changed()
        return term

    @staticmethod
    def _pump(stream, name: str, sink, lock: threading.Lock) -> None:
        for raw in iter(stream.readline, b""):
            text = raw.decode("utf-8", "replace").rstrip("\n")
            with lock:
                if sink.closed:  # a child kept the pipe open after the container's process
                    break        # exited (vLLM's engine processes): its lines are past the end
                sink.write(format_log_line(time.time_ns(), name, text))
                sink.flush()
        stream.close()

    def lose(self) -> None:
        """What a node restart that wipes the container runtime's state does to this container:
        its process is gone at once, the kubelet reports it as ContainerStatusUnknown with no
        containerID (LOST), its log can no longer be read (previous=true: 400) and it starts
        again."""
        inst = self.instances[-1] if self.instances else None
        if not inst or not inst.proc or inst.done.is_set():
            return
        self.losing = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(inst.proc.pid, signal.SIGKILL)

    def terminate(self, grace: float) -> None:
        """Stop the running instance as the kubelet does (stop_process_group): its preStop
        hook first, within the grace period, then SIGTERM, then SIGKILL."""
        inst = self.instances[-1] if self.instances else None
        if not inst or not inst.proc or inst.done.is_set():
            return
        hook = (self.spec.get("lifecycle") or {}).get("preStop")
        stop_process_group(inst.proc.pid, inst.done, grace,
                           (lambda timeout: self._pre_stop(hook, timeout)) if hook else None)

    def _pre_stop(self, hook: dict, timeout: float) -> None:
        failed = run_pre_stop(hook, timeout, cwd=self.dir, env=self.env, host=self.pod.ip,
                              container=self.spec)
        if failed:
            log.info("%s/%s: preStop hook: %s", self.pod.key, self.name, failed)

    # -- probes
    def _probe_loop(self, inst: Instance) -> None:
        startup = self.spec.get("startupProbe")
        readiness = self.spec.get("readinessProbe")
        liveness = self.spec.get("livenessProbe")
        t0 = time.monotonic()
        state = {k: {"next": t0 + (p.get("initialDelaySeconds", 0)), "fail": 0, "ok": 0}
                 for k, p in (("startup", startup), ("readiness", readiness),
                              ("liveness", liveness)) if p}
        if not readiness and self.started:
            self.ready = True
            self.pod.changed()
        while not inst.done.is_set() and not self.stop.is_set():
            now = time.monotonic()
            for kind, probe in (("startup", startup), ("readiness", readiness),
                                ("liveness", liveness)):
                if not probe or now < state[kind]["next"] or (kind != "startup"
                                                               and not self.started):
                    continue
                if kind == "startup" and self.started:
                    continue
                st = state[kind]
                st["next"] = now + probe.get("periodSeconds", 10)
                ok = self._probe(probe)
                st["ok"], st["fail"] = (st["ok"] + 1, 0) if ok else (0, st["fail"] + 1)
                if kind == "startup" and ok:
                    self.started = True
                    if not readiness:
                        self.ready = True
                    self.pod.changed()
                elif kind == "readiness":
                    if ok and st["ok"] >= probe.get("successThreshold", 1) and not self.ready:
                        self.ready = True
                        self.pod.changed()
                    elif not ok and st["fail"] >= probe.get("failureThreshold", 3) and self.ready:
                        self.ready = False
                        self.pod.changed()
                if kind in ("startup", "liveness") and st["fail"] >= probe.get(
                        "failureThreshold", 3):
                    self.kill_reason = f"{kind} probe failed"
                    log.info("%s/%s: %s, restarting", self.pod.key, self.name, self.kill_reason)
                    grace = probe.get("terminationGracePeriodSeconds",
                                      self.pod.spec.get("terminationGracePeriodSeconds", 30))
                    threading.Thread(target=self.terminate, args=(grace,), daemon=True).start()
                    return
            inst.done.wait(0.1)

    def _probe(self, probe: dict) -> bool:
        timeout = probe.get("timeoutSeconds", 1)
        try:
            if "httpGet" in probe:
                h = probe["httpGet"]
                scheme = h.get("scheme", "HTTP").lower()
                host = h.get("host") or self.pod.ip
                url = f"{scheme}://{host}:{probe_port(self.spec, h['port'])}{h.get('path', '/')}"
                ctx = ssl._create_unverified_context() if scheme == "https" else None
                req = urllib.request.Request(url, headers={
                    x["name"]: x["value"] for x in h.get("httpHeaders") or []})
                with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
                    return 200 <= resp.status < 400
            if "tcpSocket" in probe:
                t = probe["tcpSocket"]
                with socket.create_connection(
                        (t.get("host") or self.pod.ip, probe_port(self.spec, t["port"])), timeout):
                    return True
            if "exec" in probe:
                done = subprocess.run(probe["exec"]["command"], cwd=self.dir, timeout=timeout,
                                      capture_output=True, check=False)
                return done.returncode == 0
        except (OSError, ValueError, urllib.error.URLError, subprocess.SubprocessError):
            return False
        return True  # grpc and unknown handlers: not simulated, count as passing


# ----------------------------------------------------------------- pods

class PodRunner:
    """One pod on a simulated node: its containers, its status writer, its termination."""

    def __init__(self, sim: NodeSimulator, pod: dict, ip: str) -> None:
        self.sim = sim
        self.pod = pod
        self.meta = pod["metadata"]
        self.spec = pod["spec"]
        self.key = f"{self.meta['namespace']}/{self.meta['name']}"
        self.uid = self.meta["uid"]
        self.ip = ip
        self.dir = sim.work_dir / "pods" / f"{self.key.replace('/', '_')}_{self.uid}"
        self.start_ns = time.time_ns()
        self.init = [Container(self, c, init=True) for c in self.spec.get("initContainers") or []]
        self.main = [Container(self, c) for c in self.spec.get("containers") or []]
        self.init_done = not self.init
        self._changed = threading.Event()
        self._conditions: dict[str, tuple[str, str]] = {}
        self.gone = threading.Event()
        self.terminating = False
        self.sent: dict | None = None  # the status last written
        self.writer = threading.Thread(target=self._write_status, daemon=True,
                                       name=f"status {self.key}")

    def container(self, name: str) -> Container | None:
        return next((c for c in self.main + self.init if c.name == name), None)

    def changed(self) -> None:
        self._changed.set()

    def container_env(self, spec: dict) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items()
                if k in ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "TMPDIR")}
        base.update({"HOSTNAME": self.meta["name"], "PYTHONUNBUFFERED": "1"})
        base.update(resolve_env(self.pod, spec, self.ip, self.sim.lookup(self.meta["namespace"])))
        return base

    def start(self) -> None:
        self.writer.start()
        threading.Thread(target=self._run, daemon=True, name=f"pod {self.key}").start()

    def _run(self) -> None:
        for c in self.init:
            c.run()
            last = c.current_terminated
            if self.gone.is_set() or self.terminating or not last or last.exit_code != 0:
                self.changed()
                return
        self.init_done = True
        threads = [threading.Thread(target=c.run, daemon=True) for c in self.main]
        for t in threads:
            t.start()

    def stop(self, grace: float) -> None:
        """Stop every container (SIGTERM, grace, SIGKILL) and wait for them."""
        self.terminating = True
        for c in self.init + self.main:
            c.stop.set()
        threads = [threading.Thread(target=c.terminate, args=(grace,))
                   for c in self.init + self.main]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def status(self) -> dict:
        views = [c.view() for c in self.main]
        phase = pod_phase(self.spec.get("restartPolicy", "Always"), self.init_done, views)
        if not self.init_done and any(c.view().failed_for_good for c in self.init):
            phase = "Failed"
        ready = self.init_done and all(c.ready for c in self.main)

        def cond(kind: str, ok: bool) -> dict:
            status = "True" if ok else "False"
            if self._conditions.get(kind, ("", ""))[0] != status:
                self._conditions[kind] = (status, rfc3339())
            return {"type": kind, "status": status, "lastProbeTime": None,
                    "lastTransitionTime": self._conditions[kind][1]}

        return {
            "phase": phase, "hostIP": "127.0.0.1", "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "startTime": rfc3339(self.start_ns),
            "conditions": [cond("Initialized", self.init_done), cond("Ready", ready),
                           cond("ContainersReady", ready), cond("PodScheduled", True)],
            "containerStatuses": [c.status() for c in self.main],
            "initContainerStatuses": [c.status() for c in self.init],
        }

    def _write_status(self) -> None:
        """Coalesce changes into pods/status patches; retry API errors; stop when gone."""
        from kubernetes.client.exceptions import ApiException

        while not self.gone.is_set():
            self._changed.wait(5)
            self._changed.clear()
            if self.gone.is_set():
                return
            status = self.status()
            comparable = status
            if comparable == self.sent:
                continue
            try:
                self.sim.core.patch_namespaced_pod_status(
                    self.meta["name"], self.meta["namespace"], {"status": status},
                    _content_type=SMP)
                self.sent = comparable
            except ApiException as exc:
                if exc.status == 404:
                    self.gone.set()
                    return
                log.warning("status of %s: %s; retrying", self.key, exc.reason)
                time.sleep(1)
                self.changed()
            except Exception as exc:  # network trouble: retry
                log.warning("status of %s: %s; retrying", self.key, exc)
                time.sleep(1)
                self.changed()


# ----------------------------------------------------------------- pods that need no process

class LightEngines:
    """vLLM's HTTP surface for light pods, all on one asyncio loop (a thread of the simulator):
    /health, /ping, /metrics (progress counters that move with each completion), /v1/models,
    /v1/completions and /v1/chat/completions (answered at once), POST /sim/fault
    {"fault": "engine_dead"} (vLLM's engine-death lines in the log, /health 503 after) and
    POST /sim/log {"lines": [...]}. Thousands of pods cost one thread, not thousands of
    processes."""

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.servers: dict[str, Any] = {}
        threading.Thread(target=self.loop.run_forever, daemon=True, name="light-engines").start()

    def add(self, container: LightContainer, ip: str, port: int) -> None:
        import asyncio

        async def start():
            return await asyncio.start_server(
                lambda r, w: self._serve(container, r, w), ip, port, backlog=64)

        self.servers[ip] = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)

    def remove(self, ip: str) -> None:
        server = self.servers.pop(ip, None)
        if server is not None:
            self.loop.call_soon_threadsafe(server.close)

    async def _serve(self, container: LightContainer, reader, writer) -> None:
        try:
            method, path, _ = (await reader.readline()).decode("latin-1").split(" ", 2)
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            body = await reader.readexactly(length) if length else b""
            status, ctype, data = container.answer(method, path.split("?")[0], body)
            writer.write(f"HTTP/1.1 {status} {'OK' if status < 400 else 'Error'}\r\n"
                         f"Content-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                         "Connection: close\r\n\r\n".encode() + data)
            await writer.drain()
        except Exception:  # a client that went away
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        for ip in list(self.servers):
            self.remove(ip)
        self.loop.call_soon_threadsafe(self.loop.stop)


class LightContainer:
    """One container of a light pod: always running, its log a file with (for vLLM) the
    plugin's startup line, and for vLLM images an engine on LightEngines."""

    def __init__(self, pod: LightPod, spec: dict) -> None:
        from vlm_testbed import vllmsim

        self.pod, self.spec, self.name = pod, spec, spec["name"]
        directory = pod.sim.work_dir / "light" / pod.uid
        directory.mkdir(parents=True, exist_ok=True)
        self.instances = [Instance(0, directory / f"{self.name}.log",
                                   f"sim://{uuid.uuid4().hex}", time.time_ns(),
                                   appended=threading.Condition())]
        self.vllm = "vllm" in spec.get("image", "")
        self.dead = False
        self.counters = dict.fromkeys(("vllm:request_success_total", "vllm:prompt_tokens_total",
                                       "vllm:generation_tokens_total"), 0.0)
        tokens = list(spec.get("command") or []) + list(spec.get("args") or [])
        rest = tokens[tokens.index("serve") + 1:] if "serve" in tokens else []
        self.model = vllmsim.parse_serve_args(rest).model_name if self.vllm else ""
        self.real_rest = vllmsim.real_families(frozenset((*vllmsim.GAUGES, *self.counters)),
                                               self.model)
        self.version = "0.32.0"
        env = resolve_env(pod.pod, spec, pod.ip, lambda kind, name, key: None)
        self.prefix = env.get("VLLM_LOGGING_PREFIX", "")
        lines = [vllmsim.plugin_line(self.version, proc, 1, env) for proc in
                 ("APIServer", vllmsim.engine_proc_name(self.version))] if self.vllm else []
        self.append([line for line in lines if line])

    def append(self, lines: list[str]) -> None:
        inst = self.instances[0]
        with inst.appended, open(inst.log_path, "a", encoding="utf-8") as log:
            for line in lines:
                log.write(format_log_line(time.time_ns(), "stdout", line))
            inst.lines += len(lines)
            inst.appended.notify_all()

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        import json

        from vlm_testbed import vllmsim

        if method == "GET" and path in ("/health", "/ping"):
            return (503 if self.dead else 200), "text/plain", b""
        if method == "GET" and path == "/metrics":
            text = vllmsim.render_metrics(
                f'engine="0",model_name="{self.model}"', dict.fromkeys(vllmsim.GAUGES, 0.0),
                dict(self.counters), {}, self.real_rest)
            return 200, "text/plain; version=0.0.4", text.encode()
        if method == "GET" and path == "/v1/models":
            return 200, "application/json", json.dumps(
                {"object": "list", "data": [{"id": self.model, "object": "model"}]}).encode()
        request = json.loads(body or b"{}") if method == "POST" else {}
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            if self.dead:
                return 500, "application/json", b'{"error": {"type": "EngineDeadError"}}'
            self.counters["vllm:request_success_total"] += 1
            self.counters["vllm:prompt_tokens_total"] += 1
            self.counters["vllm:generation_tokens_total"] += int(request.get("max_tokens") or 1)
            return 200, "application/json", json.dumps(
                {"object": "text_completion", "model": self.model,
                 "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}).encode()
        if method == "POST" and path == "/sim/fault" and request.get("fault") == "engine_dead":
            self.dead = True
            self.append(vllmsim.engine_dead_lines(self.version, 1, prefix=self.prefix))
            return 200, "application/json", b'{"applied": "engine_dead"}'
        if method == "POST" and path == "/sim/log":
            self.append([str(line) for line in request.get("lines", [])])
            return 200, "application/json", b"{}"
        return 404, "application/json", b'{"detail": "Not Found"}'

    def status(self) -> dict:
        inst = self.instances[0]
        return {"name": self.name, "image": self.spec.get("image", ""),
                "imageID": f"sim://{self.spec.get('image', '')}", "ready": True,
                "restartCount": 0, "started": True, "containerID": inst.container_id,
                "state": {"running": {"startedAt": rfc3339(inst.started_ns)}}, "lastState": {}}


class LightPod:
    """A pod that needs no process (annotation vlm-testbed/process=none, or the simulator's
    `light` predicate): Running and Ready at once, its status written once from a shared pool,
    no probes, no restarts. The apiserver objects are what controllers see, so a cluster of
    thousands of pods fits on one machine; vLLM containers answer from LightEngines."""

    def __init__(self, sim: NodeSimulator, pod: dict, ip: str) -> None:
        self.sim, self.pod, self.ip = sim, pod, ip
        self.meta, self.spec, self.uid = pod["metadata"], pod["spec"], pod["metadata"]["uid"]
        self.key = f"{self.meta['namespace']}/{self.meta['name']}"
        self.main = [LightContainer(self, c) for c in self.spec.get("containers") or []]
        self.engines = [c for c in self.main if c.vllm]
        for container in self.engines[:1]:
            port = next((p["containerPort"] for p in container.spec.get("ports") or []), 8000)
            sim.light_engines().add(container, ip, int(port))

    def container(self, name: str) -> LightContainer | None:
        return next((c for c in self.main if c.name == name), None)

    def status(self) -> dict:
        now = rfc3339()
        conditions = [{"type": t, "status": "True", "lastProbeTime": None,
                       "lastTransitionTime": now}
                      for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")]
        return {"phase": "Running", "hostIP": "127.0.0.1", "podIP": self.ip,
                "podIPs": [{"ip": self.ip}], "startTime": now, "conditions": conditions,
                "containerStatuses": [c.status() for c in self.main]}

    def stop(self) -> None:
        if self.engines:
            self.sim.light_engines().remove(self.ip)

# ----------------------------------------------------------------- kubelet log endpoint

class LogServer(http.server.ThreadingHTTPServer):
    """The kubelet's HTTPS port, serving only GET /containerLogs/{ns}/{pod}/{container}."""

    daemon_threads = True

    def __init__(self, sim: NodeSimulator, cert: Path, key: Path) -> None:
        self.sim = sim
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(cert), str(key))
        super().__init__(("127.0.0.1", 0), LogHandler)

    def handle_error(self, request, client_address) -> None:
        log.debug("kubelet log endpoint: error from %s", client_address, exc_info=True)

    def get_request(self):
        sock, addr = self.socket.accept()
        return self.ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr


class LogHandler(http.server.BaseHTTPRequestHandler):
    server: LogServer

    def setup(self) -> None:
        self.request.settimeout(30)
        self.request.do_handshake()
        self.request.settimeout(None)
        super().setup()

    def log_message(self, *args) -> None:
        """Quiet: the apiserver polls and streams a lot."""

    def _text(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        if len(parts) != 4 or parts[0] != "containerLogs":
            self._text(404, "not found")
            return
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        runner = self.server.sim.runner_by_name(parts[1], parts[2])
        container = runner.container(parts[3]) if runner else None
        if not container:
            self._text(404, f'container "{parts[3]}" in pod "{parts[2]}" not found')
            return
        previous = q.get("previous") == "true"
        index = len(container.instances) - (2 if previous else 1)
        if index < 0 or container.instances[index].lost:  # the kubelet: no containerID to read
            what = "previous terminated container" if previous else "container"
            self._text(400, f'{what} "{parts[3]}" in pod "{parts[2]}" '
                       + ("not found" if previous else "is waiting to start: ContainerCreating"))
            return
        inst = container.instances[index]
        since = None
        if "sinceTime" in q:
            since = parse_rfc3339_ns(q["sinceTime"])
        elif "sinceSeconds" in q:
            since = time.time_ns() - int(q["sinceSeconds"]) * 1_000_000_000
        tail = int(q["tailLines"]) if "tailLines" in q else None
        limit = int(q["limitBytes"]) if "limitBytes" in q else None
        follow = q.get("follow") == "true" and not previous
        stamps = q.get("timestamps") == "true"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Connection", "close")
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            self._stream(inst, since, tail, limit, follow, stamps)

    def _stream(self, inst: Instance, since, tail, limit, follow: bool, stamps: bool) -> None:
        """Write the stored lines (filtered), then, with follow, new complete lines until the
        container instance has exited and its log is drained."""
        sent = 0

        def write(lines: list[str]) -> bool:
            nonlocal sent
            for line in lines:
                data = line.encode()
                if limit is not None and sent + len(data) >= limit:
                    self.wfile.write(data[:limit - sent])
                    return False
                self.wfile.write(data)
                sent += len(data)
            self.wfile.flush()
            return True

        with open(inst.log_path, "rb") as f:
            content = f.read()
            cut = content.rfind(b"\n") + 1
            f.seek(cut)
            lines = content[:cut].decode("utf-8", "replace").splitlines()
            if not write(render_log_lines(lines, since, tail, stamps)) or not follow:
                return
            while True:
                pos, seen = f.tell(), inst.lines
                line = f.readline()
                if line.endswith(b"\n"):
                    text = line.decode("utf-8", "replace")
                    if not write(render_log_lines([text], since, None, stamps)):
                        return
                    continue
                f.seek(pos)
                if inst.done.is_set():
                    if not line:
                        return
                    write(render_log_lines([line.decode("utf-8", "replace")], since, None,
                                           stamps))
                    return
                if inst.appended is None:
                    time.sleep(0.1)
                else:  # woken by the next write, not by polling
                    with inst.appended:
                        inst.appended.wait_for(lambda seen=seen: inst.lines != seen, 5.0)


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "365",
                    "-subj", "/CN=vlm-testbed-kubelet", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


# ----------------------------------------------------------------- the node simulator

_ip_counter = itertools.count(1)
_ip_lock = threading.Lock()


def next_pod_ip() -> str:
    """A fresh loopback address per pod (127.<pid-derived>.x.y), never 127.0.0.1."""
    with _ip_lock:
        n = next(_ip_counter)
    return f"127.{100 + os.getpid() % 150}.{(n // 250) % 250 + 1}.{n % 250 + 2}"


class NodeSimulator:
    """Simulated Nodes (kubelet + runtime) for a real control plane. A context manager:
    entering registers the Nodes and starts serving pods, leaving stops this simulator's
    processes and deletes its Nodes."""

    def __init__(self, kubeconfig: str | os.PathLike | None = None, nodes: int = 1,
                 gpus_per_node: int = 0, *, api_client: Any = None, cpu: str = "16",
                 memory: str = "64Gi", max_pods: int = 110, name_prefix: str = "vlm-sim-node",
                 command_for: CommandFor | None = None, backoff_base: float = 10.0,
                 backoff_cap: float = 300.0, heartbeat_s: float = 10.0,
                 work_dir: str | os.PathLike | None = None, labels: dict[str, str] | None = None,
                 light: Callable[[dict], bool] | None = None) -> None:
        """`light(pod)`: run this pod as a LightPod (default: its NO_PROCESS annotation)."""
        from kubernetes import client, config

        self.api = api_client or config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)
        self.node_names = [f"{name_prefix}-{i}" for i in range(nodes)]
        self.gpus = gpus_per_node
        self.cpu, self.memory, self.max_pods = cpu, memory, max_pods
        self.labels = {SIM_LABEL: "true", **(labels or {})}
        self.command_for = command_for or default_command
        self.backoff_base, self.backoff_cap = backoff_base, backoff_cap
        self.heartbeat_s = heartbeat_s
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="vlm-nodesim-"))
        self.runners: dict[str, PodRunner] = {}
        self.light: dict[str, LightPod] = {}
        self.is_light = light or (lambda pod: (pod["metadata"].get("annotations") or {}).get(
            NO_PROCESS) == "none")
        self._light_engines: LightEngines | None = None
        self._pool = None  # status writes and deletions of light pods
        self._engines_lock = threading.Lock()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.log_server: LogServer | None = None
        self.threads: list[threading.Thread] = []

    # -- lifecycle
    def __enter__(self) -> NodeSimulator:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        cert, key = self_signed_cert(self.work_dir)
        self.log_server = LogServer(self, cert, key)
        self._spawn(self.log_server.serve_forever, "kubelet-logs")
        for name in self.node_names:
            self._retry(lambda n=name: self._register(n), f"register {name}")
        self._spawn(self._heartbeat, "heartbeat")
        for name in self.node_names:
            self._spawn(lambda n=name: self._watch(n), f"watch {name}")

    def stop(self, grace: float = 5.0) -> None:
        """Stop our processes (SIGTERM, then SIGKILL after at most `grace`), delete our Nodes."""
        self.stopping.set()
        with self.lock:
            runners = list(self.runners.values())
        for r in runners:
            r.gone.set()
        threads = [threading.Thread(target=r.stop, args=(grace,)) for r in runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._light_engines is not None:
            self._light_engines.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for name in self.node_names:
            with contextlib.suppress(Exception):
                self.core.delete_node(name)
            with contextlib.suppress(Exception):
                self.coord.delete_namespaced_lease(name, "kube-node-lease")
        if self.log_server:
            self.log_server.shutdown()
            self.log_server.server_close()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, daemon=True, name=name)
        t.start()
        self.threads.append(t)

    def _retry(self, fn, what: str, attempts: int = 30):
        for i in range(attempts):
            try:
                return fn()
            except Exception as exc:  # API trouble: retry, never crash
                if i == attempts - 1:
                    raise
                log.warning("%s failed (%s); retrying", what, exc)
                time.sleep(min(5, 0.2 * 2**i))
        return None

    # -- nodes
    def node_status(self) -> dict:
        now = rfc3339()
        cap = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.max_pods),
               "ephemeral-storage": "100Gi", GPU: str(self.gpus)}

        def cond(kind: str, status: str, reason: str, msg: str) -> dict:
            return {"type": kind, "status": status, "reason": reason, "message": msg,
                    "lastHeartbeatTime": now, "lastTransitionTime": now}

        return {
            "capacity": cap, "allocatable": cap,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "simulated"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "simulated"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "simulated"),
                cond("Ready", "True", "KubeletReady", "simulated kubelet (vlm_testbed.nodesim)"),
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.log_server.server_address[1]}},
            "nodeInfo": {"machineID": "sim", "systemUUID": "sim", "bootID": "sim",
                         "kernelVersion": os.uname().release, "osImage": "vlm-testbed",
                         "containerRuntimeVersion": "sim://0.1", "kubeletVersion": "v1.20.2",
                         "kubeProxyVersion": "v1.20.2", "operatingSystem": "linux",
                         "architecture": "amd64"},
        }

    def _register(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
            **self.labels, "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64"}}, "spec": {}}
        try:
            self.core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        self.core.patch_node_status(name, {"status": self.node_status()},
                                   _content_type=SMP)
        self._untaint(name)
        self._renew_lease(name)

    def _untaint(self, name: str, node: Any = None) -> None:
        node = node or self.core.read_node(name)
        taints = node.spec.taints or []
        keep = [self.api.sanitize_for_serialization(t) for t in taints
                if t.key not in NOT_READY_TAINTS]
        if len(keep) != len(taints):
            self.core.patch_node(name, {"spec": {"taints": keep}}, _content_type=SMP)

    def _renew_lease(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        now = dt.datetime.now(dt.UTC)
        spec = {"holderIdentity": name, "leaseDurationSeconds": 40,
                "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        try:
            self.coord.patch_namespaced_lease(name, "kube-node-lease", {"spec": spec},
                                              _content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coord.create_namespaced_lease("kube-node-lease", {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": "kube-node-lease"}, "spec": spec})

    def _heartbeat(self) -> None:
        """As the kubelet with node leases: the Lease renewed every heartbeat, the Node's
        status written every STATUS_EVERY heartbeats or at once when someone else changed its
        Ready condition; all nodes at once, so 50 nodes on a busy machine do not miss the node
        controller's 40 s grace and flap NotReady (which marks every pod on them NotReady)."""
        from concurrent.futures import ThreadPoolExecutor

        beats = 0
        with ThreadPoolExecutor(8, thread_name_prefix="heartbeat") as pool:
            while not self.stopping.wait(self.heartbeat_s):
                beats += 1
                full = beats % STATUS_EVERY == 0
                list(pool.map(self._beat, self.node_names, [full] * len(self.node_names)))

    def _beat(self, name: str, full: bool) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self._renew_lease(name)
            node = self.core.read_node(name)
            ready = any(c.type == "Ready" and c.status == "True"
                        for c in node.status.conditions or [])
            if full or not ready:  # the node controller marked it: write ours back at once
                self.core.patch_node_status(name, {"status": self.node_status()},
                                            _content_type=SMP)
            self._untaint(name, node)
        except ApiException as exc:
            if exc.status == 404 and not self.stopping.is_set():
                with contextlib.suppress(Exception):
                    self._register(name)
            else:
                log.warning("heartbeat %s: %s", name, exc.reason)
        except Exception as exc:  # keep beating
            log.warning("heartbeat %s: %s", name, exc)

    # -- pods
    def lookup(self, namespace: str) -> Callable[[str, str, str | None], Any]:
        import base64

        def read(kind: str, name: str, key: str | None):
            try:
                if kind == "secret":
                    data = self.core.read_namespaced_secret(name, namespace).data or {}
                    data = {k: base64.b64decode(v).decode() for k, v in data.items()}
                else:
                    data = self.core.read_namespaced_config_map(name, namespace).data or {}
            except Exception as exc:  # a missing object leaves the var unset
                log.warning("env from %s %s/%s: %s", kind, namespace, name, exc)
                return None
            return data if key is None else data.get(key)

        return read

    def lose_container(self, namespace: str, name: str, container: str) -> None:
        """A node restart that lost the runtime's record of this pod's running container
        (Container.lose): it reports ContainerStatusUnknown, its log is gone, it starts again."""
        runner = self.runner_by_name(namespace, name)
        target = runner.container(container) if isinstance(runner, PodRunner) else None
        if target is None:
            raise KeyError(f"no running container {container!r} in pod {namespace}/{name}")
        target.lose()

    def runner_by_name(self, namespace: str, name: str) -> PodRunner | LightPod | None:
        with self.lock:
            return next((r for r in (*self.runners.values(), *self.light.values())
                         if r.meta["namespace"] == namespace and r.meta["name"] == name), None)

    def light_engines(self) -> LightEngines:
        with self._engines_lock:  # called under self.lock
            if self._light_engines is None:
                self._light_engines = LightEngines()
            return self._light_engines

    def _light(self, pod: dict, deleted: bool) -> None:
        """A pod that needs no process: status once, and on deletion the object removed."""
        from concurrent.futures import ThreadPoolExecutor

        uid = pod["metadata"]["uid"]
        with self.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="light")
            light = self.light.get(uid)
            if light is None and not deleted and not pod["metadata"].get("deletionTimestamp"):
                light = self.light[uid] = LightPod(self, pod, next_pod_ip())
                self._pool.submit(self._retry, lambda: self.core.patch_namespaced_pod_status(
                    light.meta["name"], light.meta["namespace"], {"status": light.status()},
                    _content_type=SMP), f"status of {light.key}", 10)
                return
            if light is not None and (deleted or pod["metadata"].get("deletionTimestamp")):
                del self.light[uid]
                light.stop()
            elif light is not None and not deleted and overwritten(pod, light.status()):
                self._pool.submit(self._retry, lambda: self.core.patch_namespaced_pod_status(
                    light.meta["name"], light.meta["namespace"], {"status": light.status()},
                    _content_type=SMP), f"status of {light.key}", 10)
                return
        if pod["metadata"].get("deletionTimestamp") and not deleted:
            from kubernetes.client.exceptions import ApiException

            def remove():
                try:
                    self.core.delete_namespaced_pod(
                        pod["metadata"]["name"], pod["metadata"]["namespace"],
                        grace_period_seconds=0,
                        body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
                except ApiException as exc:
                    if exc.status not in (404, 409):
                        raise

            self._pool.submit(self._retry, remove, f"delete pod {uid}", 10)

    def _watch(self, node: str) -> None:
        from kubernetes import watch

        selector = f"spec.nodeName={node}"
        while not self.stopping.is_set():
            try:
                listing = self.core.list_pod_for_all_namespaces(field_selector=selector)
                present = set()
                for pod in listing.items:
                    present.add(pod.metadata.uid)
                    self._reconcile(self.api.sanitize_for_serialization(pod), deleted=False)
                with self.lock:
                    lost = [r for uid, r in (*self.runners.items(), *self.light.items())
                            if r.spec.get("nodeName") == node and uid not in present]
                for r in lost:
                    self._reconcile(r.pod, deleted=True)
                w = watch.Watch()
                for ev in w.stream(self.core.list_pod_for_all_namespaces, field_selector=selector,
                                   resource_version=listing.metadata.resource_version,
                                   timeout_seconds=30):
                    if self.stopping.is_set():
                        w.stop()
                        return
                    if ev["type"] == "ERROR":
                        break
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._reconcile(self.api.sanitize_for_serialization(ev["object"]),
                                        deleted=ev["type"] == "DELETED")
            except Exception as exc:  # 410 Gone, network: relist
                if not self.stopping.is_set():
                    log.info("watch %s: %s; relisting", node, exc)
                    time.sleep(1)

    def _reconcile(self, pod: dict, deleted: bool) -> None:
        uid = pod["metadata"]["uid"]
        if uid in self.light or (uid not in self.runners and self.is_light(pod)):
            self._light(pod, deleted)
            return
        with self.lock:
            runner = self.runners.get(uid)
            if runner is None and not deleted and not pod["metadata"].get("deletionTimestamp"):
                if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    return
                runner = self.runners[uid] = PodRunner(self, pod, next_pod_ip())
                runner.start()
                return
        if runner and not deleted and overwritten(pod, runner.sent):
            runner.sent = None  # as the kubelet's status manager: write ours back
            runner.changed()
        if deleted and runner:
            runner.gone.set()
            threading.Thread(target=self._finish, args=(runner, 2.0, False), daemon=True).start()
        elif pod["metadata"].get("deletionTimestamp") and not (runner and runner.terminating):
            grace = pod["metadata"].get("deletionGracePeriodSeconds")
            if grace is None:
                grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            target = runner or PodRunner(self, pod, "")
            target.terminating = True
            threading.Thread(target=self._finish, args=(target, float(grace), True),
                             daemon=True).start()

    def _finish(self, runner: PodRunner, grace: float, delete: bool) -> None:
        """Kill the pod's processes, then remove the pod object (grace 0) as the kubelet does."""
        runner.stop(grace)
        runner.gone.set()
        with self.lock:
            self.runners.pop(runner.uid, None)
        if delete and not self.stopping.is_set():
            from kubernetes.client.exceptions import ApiException

            def remove():
                try:
                    self.core.delete_namespaced_pod(
                        runner.meta["name"], runner.meta["namespace"], grace_period_seconds=0,
                        body={"gracePeriodSeconds": 0, "preconditions": {"uid": runner.uid}})
                except ApiException as exc:
                    if exc.status not in (404, 409):
                        raise

            with contextlib.suppress(Exception):
                self._retry(remove, f"delete pod {runner.key}", attempts=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlm_testbed.nodesim", description=__doc__.split(
        "\n")[0])
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), required=False)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--cpu", default="16")
    p.add_argument("--memory", default="64Gi")
    p.add_argument("--name-prefix", default="vlm-sim-node")
    p.add_argument("--backoff-base", type=float, default=10.0)
    p.add_argument("--work-dir", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    with NodeSimulator(args.kubeconfig, args.nodes, args.gpus_per_node, cpu=args.cpu,
                       memory=args.memory, name_prefix=args.name_prefix,
                       backoff_base=args.backoff_base, work_dir=args.work_dir) as sim:
        log.info("nodes %s ready (kubelet log port %d)", ", ".join(sim.node_names),
                 sim.log_server.server_address[1])
        done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
