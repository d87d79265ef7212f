"""One local process per container in place of the container: the command an image maps to,
start, probes, restarts with back-off, the preStop hook and termination."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from .logserver import format_log_line
from .state import (
    LOST,
    MIN_GRACE_S,
    ContainerView,
    Instance,
    Terminated,
    backoff_delay,
    crashes_after_exit,
    exit_code_of,
    log,
    probe_port,
    rfc3339,
    should_restart,
    terminated_state,
)

if TYPE_CHECKING:
    from .pods import PodRunner


CommandFor = Callable[[dict, str], list[str]]


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
        # restartCount, state and lastState change together under it: status() never shows a
        # new restartCount with the previous container's start
        self.lock = threading.Lock()

    # -- the kubelet's view for pods/status
    def status(self) -> dict:
        with self.lock:
            inst = self.instances[-1] if self.instances else None
            waiting, current, last = self.waiting, self.current_terminated, self.last
            restarts = self.restart_count
        if waiting:
            state = {"waiting": {"reason": waiting[0], **(
                {"message": waiting[1]} if waiting[1] else {})}}
        elif current:
            state = terminated_state(current)
        else:
            state = {"running": {"startedAt": rfc3339(inst.started_ns if inst else None)}}
        out = {"name": self.name, "image": self.spec.get("image", ""),
               "imageID": f"sim://{self.spec.get('image', '')}", "ready": self.ready,
               "restartCount": restarts, "state": state,
               "lastState": terminated_state(last) if last else {}}
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
                    with self.lock:  # waiting, with the exited container as lastState
                        self.last, self.current_terminated = self.current_terminated, None
                        self.waiting = ("CrashLoopBackOff",
                                        f"back-off {delay:g}s restarting failed container="
                                        f"{self.name} pod={meta['name']}_{meta['namespace']}"
                                        f"({meta['uid']})")
                    self.pod.changed()
                    if self.stop.wait(delay):
                        break
            started = time.monotonic()
            term = self._run_once()
            if term is None:  # could not start
                break
            lost, self.losing = self.losing, False
            if lost:  # the restarted node's kubelet starts it again at once
                self.instances[-1].lost = True
                term = self.current_terminated = LOST
            self.crashes = crashes_after_exit(self.crashes, time.monotonic() - started,
                                              self.pod.sim.backoff_cap)
            if self.stop.is_set() or not should_restart(policy, term.exit_code, self.init):
                break
            # the exited container stays the current state (terminated) until the next starts
        self.ready = False
        self.finished.set()
        self.pod.changed()

    def _run_once(self) -> Terminated | None:
        index = len(self.instances)
        inst = Instance(index, self.dir / f"{index}.log", f"sim://{uuid.uuid4().hex}")
        if not self.pod.sim.images.ensure(self):
            return None
        try:
            argv = self.pod.sim.command_for(self.spec, self.pod.ip)
            writable = self.pod.dir / "rootfs" / self.dir.name / str(index)
            env = self.env = self.pod.container_env(self.spec, writable)
            inst.proc = subprocess.Popen(
                argv, env=env, cwd=self.dir, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=_die_with_parent)
        except Exception as exc:  # any start failure is the container's error
            log.warning("cannot start %s/%s: %s", self.pod.key, self.name, exc)
            inst.started_ns = time.time_ns()
            inst.log_path.write_text(format_log_line(time.time_ns(), "stderr", str(exc)))
            inst.done.set()
            now = time.time_ns()
            term = Terminated(128, "StartError", now, now, inst.container_id)
            self._now_current(inst, term)
            return term
        inst.started_ns = time.time_ns()
        self.ready = False
        self._now_current(inst, None)
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
            # the container's main process is gone: so is every process it started, as when
            # PID 1 of a container's PID namespace exits (vLLM's engine processes included)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(inst.proc.pid, signal.SIGKILL)
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

    def _now_current(self, inst: Instance, terminated: Terminated | None) -> None:
        """`inst` is the container now (running, or `terminated` where it could not start): a
        restart counts it, and the container before becomes lastState, in one step."""
        with self.lock:
            if self.instances:
                self.restart_count += 1
                self.last = self.current_terminated or self.last
            self.instances.append(inst)
            self.waiting, self.current_terminated = None, terminated

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
