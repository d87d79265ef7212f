"""A real local Kubernetes control plane (etcd + kube-apiserver + controller-manager + scheduler).

No registry ships kube-apiserver binaries usable here, so ``build()`` compiles Kubernetes v1.20.2
from Debian bookworm's ``kubernetes`` source package and caches the binaries (the kubelet too,
for vlm_testbed.realnode). ``ControlPlane`` starts etcd and the three control-plane components
on loopback with self-made certificates and RBAC on; nodes come from vlm_testbed.nodesim
(simulated) or vlm_testbed.realnode (a real kubelet on containerd); without one, pods stay
Pending.

CLI: ``python -m vlm_testbed.controlplane build|up|down|env``.

Modules: build (the binaries), certs, manifests, processes (child processes, ports), cluster
(ControlPlane), supervisor (`up`/`down`/`env` in the background), cli.
"""

from .build import K8S_VERSION, ControlPlaneError, bin_dir, binaries_ready, build, kubectl_path
from .certs import api_client_from_kubeconfig, write_kubeconfig
from .cluster import ControlPlane
from .manifests import apply_manifests, load_manifests, ready_namespace
from .processes import free_port, tail

__all__ = [
    "K8S_VERSION", "ControlPlane", "ControlPlaneError", "api_client_from_kubeconfig",
    "apply_manifests", "bin_dir", "binaries_ready", "build", "free_port", "kubectl_path",
    "load_manifests", "ready_namespace", "tail", "write_kubeconfig",
]
