"""A simulated Node's registration and heartbeat, as the kubelet with node leases: the Node object,
its status and taints, its Lease in kube-node-lease."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
from typing import Any

from .state import GPU, NOT_READY_TAINTS, SMP, STATUS_EVERY, log, rfc3339


class NodeLeases:
    """NodeSimulator's Nodes: registration, status, taints and the Lease heartbeat (uses its
    core, coord, api, node_names, stopping and log_server)."""

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
