"""RealNode: a real kubelet on a containerd of its own, registered with the test bed's control
plane, its pods in network namespaces on a bridge of its own, GPUs advertised by a device
plugin."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vlm_testbed.controlplane.build import ControlPlaneError, build, cache_root, node_binary
from vlm_testbed.controlplane.certs import write_kubeconfig
from vlm_testbed.controlplane.processes import _die_with_parent, _kill_group, free_port, tail

from . import config as cfg
from . import stale
from .imagebuild import PAUSE_IMAGE

GPU = "nvidia.com/gpu"
_CA_LOCK = threading.Lock()  # the CA's serial file is shared by nodes started side by side


class RealNode:
    """One real node; use as a context manager (or start()/stop()).

    `control_plane`: a started controlplane.ControlPlane (its CA signs the node's client
    certificate, CN system:node:<name>, O system:nodes). `index`: the node's network
    (vlmbr<index>, 10.244.<index>.0/24); None picks the first free one. `gpus`: stand-in GPUs
    the device plugin advertises as nvidia.com/gpu (0: no plugin). `registry`: the local
    registry's address (registry.LocalRegistry holding imagebuild.build_images' images, the
    pod sandbox's among them), which the node's containerd pulls docker.io and ghcr.io names
    from.

    stop() deletes the node's pods and its Node, then stops only what it started: the
    kubelet, the device plugin, the containers (through its containerd), containerd and the
    processes left in its mount namespace; the namespace goes with its mounts; then the bridge
    and the node's directory. Start it from a thread that outlives it: its processes get
    SIGTERM when the thread that started them ends (PR_SET_PDEATHSIG follows the thread)."""

    def __init__(self, control_plane: Any, index: int | None = None, *, name: str | None = None,
                 registry: str, gpus: int = 4, ready_timeout_s: float = 120.0,
                 labels: dict[str, str] | None = None, verbosity: int = 1) -> None:
        self.cp = control_plane
        self.index = index
        self.name = name
        self.gpus = gpus
        self.registry = registry
        self.ready_timeout_s = ready_timeout_s
        self.labels = labels or {}
        self.verbosity = verbosity
        self.root: Path | None = None
        self.net: cfg.NodeNet | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready_seconds: float | None = None
        self.kubelet_port: int | None = None
        self.kubelet_ready_seconds: float | None = None  # from the kubelet's start
        self._kubelet_t0: float | None = None
        self._kubelet_cmd: list[str] = []
        self._bridge_added = False
        self._holder_ns: str | None = None

    # -- public -----------------------------------------------------------------------------

    @property
    def ip(self) -> str:
        assert self.net is not None
        return self.net.gateway

    @property
    def socket(self) -> Path:
        assert self.root is not None
        return self.root / "containerd" / "containerd.sock"

    def log_path(self, component: str) -> Path:
        assert self.root is not None
        return self.root / f"{component}.log"

    def ctr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`ctr -n k8s.io <args>` against this node's containerd."""
        return subprocess.run(["ctr", "--address", str(self.socket), "-n", "k8s.io", *args],
                              capture_output=True, text=True, timeout=timeout)

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RealNode:
        t0 = time.monotonic()
        build(node=True)
        self.root = Path(tempfile.mkdtemp(prefix="vlm-node-"))
        os.chmod(self.root, 0o755)
        try:
            self._start_all()
            self._wait_ready(t0)
        except BaseException:
            print(f"real node failed to start; logs kept in {self.root}", file=sys.stderr)
            self.stop(keep_logs=True)
            raise
        self.ready_seconds = time.monotonic() - t0
        assert self._kubelet_t0 is not None
        self.kubelet_ready_seconds = time.monotonic() - self._kubelet_t0
        return self

    def task_pid(self, container_id: str) -> int | None:
        """Host pid of a running container's main process (`containerd://<id>` or `<id>`)."""
        cid = container_id.split("://")[-1]
        for line in self.ctr("tasks", "ls", timeout=20).stdout.splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3 and parts[0] == cid and parts[2] == "RUNNING":
                return int(parts[1])
        return None

    def read_in_container(self, container_id: str, path: str) -> str | None:
        """A file as the container sees it (through /proc/<pid>/root), None if unreadable."""
        pid = self.task_pid(container_id)
        if pid is None:
            return None
        try:
            return Path(f"/proc/{pid}/root{path}").read_text()
        except OSError:
            return None

    def stop_kubelet(self) -> None:
        """Stop the kubelet alone (SIGTERM, SIGKILL after 10 s): its containers keep running
        under containerd and it watches nothing until start_kubelet, as during a kubelet
        upgrade or crash."""
        _kill_group(self.procs["kubelet"])

    def start_kubelet(self) -> None:
        """Start the kubelet again with the same flags and state; returns at once (it takes
        its pods over from containerd and syncs each as it would after a crash)."""
        self._spawn("kubelet", self._kubelet_cmd)

    def freeze_kubelet(self) -> None:
        """SIGSTOP the kubelet: it syncs nothing and its watch stays open, unread, as with a
        kubelet starved of CPU or stuck in a long pause."""
        os.killpg(self.procs["kubelet"].pid, signal.SIGSTOP)

    def thaw_kubelet(self) -> None:
        os.killpg(self.procs["kubelet"].pid, signal.SIGCONT)

    def stop(self, keep_logs: bool = False) -> None:
        with contextlib.suppress(Exception):
            self._delete_pods_and_node()
        for name in ("device-plugin", "kubelet"):
            if name in self.procs:
                _kill_group(self.procs[name])
        if "containerd" in self.procs and self.procs["containerd"].poll() is None:
            with contextlib.suppress(Exception):
                self._remove_containers()
            _kill_group(self.procs["containerd"])
        self._kill_namespace()
        if "holder" in self.procs:
            _kill_group(self.procs["holder"], grace_s=2)
        if self._bridge_added and self.net is not None:
            cfg.ip("link", "del", self.net.bridge, check=False)
            self._bridge_added = False
            stale.forget(self.net.index)
        if self.root is not None:
            if keep_logs:
                for d in ("containerd", "kubelet"):
                    shutil.rmtree(self.root / d, ignore_errors=True)
            else:
                shutil.rmtree(self.root, ignore_errors=True)

    # -- start ------------------------------------------------------------------------------

    def _start_all(self) -> None:
        root = self.root
        assert root is not None
        self._claim_network()
        assert self.net is not None
        self.name = self.name or f"real-node-{self.net.index}"
        ca = self.cp.ca
        with _CA_LOCK:
            crt, key = ca.issue(f"node-{self.name}", f"system:node:{self.name}",
                                orgs=["system:nodes"])
        kubeconfig = write_kubeconfig(root / "kubelet.kubeconfig", self.cp.server, ca.cert,
                                      crt, key, f"system:node:{self.name}")
        cfg.prepare_fixed_paths(root)
        cfg.write_cni(root, self.net)
        (root / "containerd").mkdir()
        (root / "containerd.toml").write_text(
            cfg.containerd_config(root, PAUSE_IMAGE, self.registry))

        holder = self._spawn("holder", cfg.namespace_holder_cmd(root), stdout=subprocess.PIPE)
        line = holder.stdout.readline() if holder.stdout else b""
        if line.strip() != b"ready":
            raise ControlPlaneError(f"mount namespace not set up; {tail(self.log_path('holder'))}")
        self._holder_ns = os.readlink(f"/proc/{holder.pid}/ns/mnt")
        if self._holder_ns == os.readlink("/proc/self/ns/mnt"):
            self._holder_ns = None
            raise ControlPlaneError("unshare left the node in this process's mount namespace")
        enter = ["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", "--"]

        self._spawn("containerd", [*enter, "containerd", "--config", str(root / "containerd.toml")])
        self._wait("containerd", lambda: self.ctr("version", timeout=5).returncode == 0, 60)

        self.kubelet_port = free_port()
        args = cfg.kubelet_args(
            kubelet=node_binary("kubelet"), root=root, name=self.name, net=self.net,
            kubeconfig=kubeconfig, ca=ca.cert, socket=self.socket, port=self.kubelet_port,
            healthz_port=free_port(), pause_image=PAUSE_IMAGE,
            labels={"vlm-testbed/real-node": "true", **self.labels}, verbosity=self.verbosity)
        self._kubelet_t0 = time.monotonic()
        self._kubelet_cmd = [*enter, *args]
        self._spawn("kubelet", self._kubelet_cmd)
        if self.gpus:
            self._spawn("device-plugin", [
                str(node_binary("vlm-gpu-device-plugin")),
                f"-dir={root / 'fixed' / 'device-plugins'}", f"-resource={GPU}",
                f"-count={self.gpus}", f"-id-prefix=GPU-{self.name}-"])

    def _claim_network(self) -> None:
        """Take bridge vlmbr<index> (the first free index when none is given), under a lock so
        that nodes started side by side do not pick the same one."""
        lock_path = cache_root() / "realnode-net.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for root in stale.clean_stale():
                print(f"real node: removed what a dead test run left in {root}", file=sys.stderr)
            candidates = [self.index] if self.index is not None else range(1, 250)
            for i in candidates:
                assert i is not None
                net = cfg.NodeNet(i)
                if not cfg.bridge_exists(net.bridge):
                    cfg.add_bridge(net)
                    self.net, self._bridge_added = net, True
                    assert self.root is not None
                    stale.record(i, self.root)
                    return
            raise ControlPlaneError(f"bridge for node index {self.index} exists already "
                                    "(another node, or one left by a killed run: ip link del)")

    def _spawn(self, name: str, cmd: list[str], stdout: Any = None) -> subprocess.Popen:
        log = open(self.log_path(name), "ab")  # noqa: SIM115 - owned by the child
        try:
            proc = subprocess.Popen(cmd, stdout=stdout or log, stderr=log, cwd=self.root,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        finally:
            log.close()
        self.procs[name] = proc
        return proc

    def _wait(self, name: str, ready: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for n, p in self.procs.items():
                if p.poll() is not None:
                    raise ControlPlaneError(f"{n} exited with {p.returncode} while waiting for "
                                            f"{name}; {self.log_path(n)} ends with:\n"
                                            f"{tail(self.log_path(n))}")
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{name} not ready after {timeout_s:.0f} s; "
                                        f"{self.log_path(name)} ends with:\n"
                                        f"{tail(self.log_path(name))}")
            time.sleep(0.2)

    def _wait_ready(self, t0: float) -> None:
        from kubernetes import client

        def ready() -> bool:
            try:
                node = v1.read_node(self.name)
            except client.ApiException:
                return False
            conds = {c.type: c.status for c in node.status.conditions or []}
            gpus = (node.status.allocatable or {}).get(GPU, "0")
            return conds.get("Ready") == "True" and int(gpus) == self.gpus

        with self.cp.api_client() as api:
            v1 = client.CoreV1Api(api)
            self._wait("kubelet", ready, max(1.0, self.ready_timeout_s - (time.monotonic() - t0)))

    # -- stop -------------------------------------------------------------------------------

    def _delete_pods_and_node(self) -> None:
        from kubernetes import client

        if not self.name or "kubelet" not in self.procs:
            return
        with self.cp.api_client() as api:
            v1 = client.CoreV1Api(api)
            pods = v1.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.name}")
            for pod in pods.items:
                with contextlib.suppress(client.ApiException):
                    v1.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                             grace_period_seconds=0)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.procs["kubelet"].poll() is None:
                left = v1.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.name}")
                if not left.items:
                    break
                time.sleep(0.5)
            with contextlib.suppress(client.ApiException):
                v1.delete_node(self.name)

    def _remove_containers(self) -> None:
        """Kill and delete every task and container left in this node's containerd."""
        tasks = self.ctr("tasks", "ls", "-q", timeout=20).stdout.split()
        for t in tasks:
            self.ctr("tasks", "kill", "-s", "SIGKILL", t, timeout=20)
        for t in tasks:
            for _ in range(20):
                if self.ctr("tasks", "delete", t, timeout=20).returncode == 0:
                    break
                time.sleep(0.25)
        for c in self.ctr("containers", "ls", "-q", timeout=20).stdout.split():
            self.ctr("containers", "delete", c, timeout=20)

    def _kill_namespace(self) -> None:
        """SIGKILL what is still in the node's mount namespace (shims, ...) but the holder, and
        every process below them first (a container whose shim died would live on): only
        processes this node started are in there."""
        if not self._holder_ns:
            return
        holder = self.procs.get("holder")
        pids = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or (holder and int(pid) == holder.pid):
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/ns/mnt") == self._holder_ns:
                    pids.append(int(pid))
        stale.kill_with_descendants(pids)


@contextlib.contextmanager
def real_nodes(control_plane: Any, count: int, **kwargs: Any) -> Iterator[list[RealNode]]:
    """`count` RealNodes started side by side (each picks the next free network), stopped
    together; `kwargs` go to each RealNode. The threads that start them live until the nodes
    are stopped: a node's processes get SIGTERM when the thread that started them ends
    (PR_SET_PDEATHSIG follows the thread)."""
    build(node=True)  # once, before the threads
    nodes = [RealNode(control_plane, **kwargs) for _ in range(count)]
    with ThreadPoolExecutor(count) as pool, contextlib.ExitStack() as stack:
        futures = [pool.submit(n.start) for n in nodes]
        errors = []
        for n, f in zip(nodes, futures, strict=True):
            try:
                f.result()
                stack.callback(n.stop)
            except BaseException as exc:  # the others still get stopped by the stack
                errors.append(exc)
        if errors:
            raise errors[0]
        yield nodes
