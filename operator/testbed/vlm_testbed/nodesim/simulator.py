"""NodeSimulator: simulated Nodes (kubelet + runtime) for a real control plane; watches the pods
bound to its Nodes and runs them (PodRunner, LightPod)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .claims import MOUNT_TIMEOUT_S, Claims
from .images import NodeImages, pull_seconds
from .leases import NodeLeases
from .light import LightEngines, LightPod
from .logserver import LogServer, self_signed_cert
from .pods import PodRunner, next_pod_ip
from .processes import default_command
from .state import NO_PROCESS, SIM_LABEL, SMP, log, overwritten
from .volumes import DOWNWARD_API_LAG_S

if TYPE_CHECKING:
    from .images import PullSeconds
    from .processes import CommandFor


class NodeSimulator(NodeLeases):
    """Simulated Nodes (kubelet + runtime) for a real control plane. A context manager:
    entering registers the Nodes and starts serving pods, leaving stops this simulator's
    processes and deletes its Nodes."""

    def __init__(self, kubeconfig: str | os.PathLike | None = None, nodes: int = 1,
                 gpus_per_node: int = 0, *, api_client: Any = None, cpu: str = "16",
                 memory: str = "64Gi", max_pods: int = 110, name_prefix: str = "vlm-sim-node",
                 command_for: CommandFor | None = None, backoff_base: float = 10.0,
                 backoff_cap: float = 300.0, heartbeat_s: float = 10.0,
                 work_dir: str | os.PathLike | None = None, labels: dict[str, str] | None = None,
                 light: Callable[[dict], bool] | None = None,
                 image_pull_seconds: float | dict[str, float] | PullSeconds = 0.0,
                 downward_api_lag: float = DOWNWARD_API_LAG_S,
                 mount_timeout: float = MOUNT_TIMEOUT_S, vllm_time_scale: float = 0.0,
                 provision: bool = True) -> None:
        """`light(pod)`: run this pod as a LightPod (default: its NO_PROCESS annotation).
        `image_pull_seconds`: an image's pull time on a node that lacks it (a number, a dict by
        image or a function; images.VLLM_IMAGE_PULL_S is the real figure, 0 keeps tests fast).
        `downward_api_lag`: seconds until a pod's change shows in its downwardAPI files
        (volumes.DOWNWARD_API_LAG_S, the kubelet's). `mount_timeout`: the kubelet's wait
        before a FailedMount Event (claims.MOUNT_TIMEOUT_S). `vllm_time_scale`: the vLLM
        stand-in's VLM_SIM_TIME_SCALE where a pod does not set it, as the image's env would
        (0: it starts at once, as tests want; 1: the published start-up figures,
        vllmsim.startup). `provision`: run the claim provisioner (claims.Claims)."""
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
        self.images = NodeImages(pull_seconds(image_pull_seconds))
        self.downward_api_lag, self.mount_timeout = downward_api_lag, mount_timeout
        self.vllm_env = {"VLM_SIM_TIME_SCALE": f"{vllm_time_scale:g}"}
        self.provision = provision
        self.claims = Claims(self)

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
        if self.provision:
            self._spawn(self.claims.run, "claims")
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
        if runner and not deleted:
            runner.update(pod)
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
        """Kill the pod's processes, remove its volumes (emptyDirs) and its containers'
        writable layers, then remove the pod object (grace 0) as the kubelet does."""
        runner.stop(grace)
        runner.gone.set()
        for part in ("volumes", "rootfs"):
            shutil.rmtree(runner.dir / part, ignore_errors=True)
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
