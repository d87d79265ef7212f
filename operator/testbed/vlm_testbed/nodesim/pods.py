"""One pod on a simulated node (PodRunner): its containers, its status writes, its termination;
and the loopback IP each pod gets."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import volumes
from .processes import Container
from .state import SMP, log, pod_phase, resolve_env, rfc3339

if TYPE_CHECKING:
    from .simulator import NodeSimulator


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
        self.volumes: dict[str, str] = {}  # volume name -> host directory
        self._downward: dict[str, dict[str, str]] = {}  # downwardAPI files last seen
        self.stopped = threading.Event()  # stop() was called
        self.writer = threading.Thread(target=self._write_status, daemon=True,
                                       name=f"status {self.key}")

    def container(self, name: str) -> Container | None:
        return next((c for c in self.main + self.init if c.name == name), None)

    def changed(self) -> None:
        self._changed.set()

    def container_env(self, spec: dict, writable: Path) -> dict[str, str]:
        """The environment of a container's process: the pod's env (with the node's
        image_env under it), mapped onto the pod's volumes and `writable`, the instance's
        writable layer (volumes.map_env)."""
        base = {k: v for k, v in os.environ.items()
                if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "TMPDIR")}
        base.update({"HOSTNAME": self.meta["name"], "PYTHONUNBUFFERED": "1"})
        if "vllm" in spec.get("image", ""):
            base.update(self.sim.vllm_env)
        pod_env = resolve_env(self.pod, spec, self.ip, self.sim.lookup(self.meta["namespace"]))
        mounts = volumes.container_mounts(spec, self.volumes)
        return {**base, **volumes.map_env(pod_env, mounts, writable)}

    def prepare_volumes(self) -> bool:
        """Set up every volume of the pod before its containers start, as the kubelet's
        volume manager does (claims wait to be bound and attachable); False if the pod went
        away first."""
        lookup = self.sim.lookup(self.meta["namespace"])
        for volume in self.spec.get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim:
                path = self.sim.claims.mount(self, volume["name"], claim, self.stopped)
                if path is None:
                    return False
            else:
                if "downwardAPI" in volume:
                    self._downward[volume["name"]] = volumes.downward_files(
                        self.pod, volume["downwardAPI"], self.ip)
                path = volumes.local_volume(self.dir, volume, self.pod, self.ip, lookup)
            self.volumes[volume["name"]] = path
        return not self.stopped.is_set()

    def update(self, pod: dict) -> None:
        """A newer pod object from the watch: its downwardAPI files follow it after the
        simulator's downward_api_lag, as the kubelet's next sync rewrites them."""
        self.pod = pod
        for volume in self.spec.get("volumes") or []:
            if "downwardAPI" not in volume or volume["name"] not in self.volumes:
                continue
            files = volumes.downward_files(pod, volume["downwardAPI"], self.ip)
            directory = Path(self.volumes[volume["name"]])
            if files == self._downward.get(volume["name"]):
                continue
            self._downward[volume["name"]] = files
            timer = threading.Timer(self.sim.downward_api_lag, self._rewrite, (directory, files))
            timer.daemon = True
            timer.start()

    def _rewrite(self, directory: Path, files: dict[str, str]) -> None:
        if not self.stopped.is_set():  # a deleted pod's volumes are gone for good
            volumes.write_files(directory, files)

    def start(self) -> None:
        self.changed()  # Pending, containers ContainerCreating, at once as the kubelet writes it
        self.writer.start()
        threading.Thread(target=self._run, daemon=True, name=f"pod {self.key}").start()

    def _run(self) -> None:
        if not self.prepare_volumes():
            return
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
        self.stopped.set()
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


_ip_counter = itertools.count(1)
_ip_lock = threading.Lock()


def next_pod_ip() -> str:
    """A fresh loopback address per pod (127.<net>.x.y), never 127.0.0.1. <net> is
    VLM_TESTBED_POD_NET where set (test runs side by side each take their own), else derived
    from the process id."""
    with _ip_lock:
        n = next(_ip_counter)
    net = int(os.environ.get("VLM_TESTBED_POD_NET") or 100 + os.getpid() % 150)
    return f"127.{net}.{(n // 250) % 250 + 1}.{n % 250 + 2}"
