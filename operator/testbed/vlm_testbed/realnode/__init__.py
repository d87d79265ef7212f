"""Real nodes for the test bed: a real kubelet (v1.20.2, built with the control plane) on a
containerd of its own, registered with the test bed's control plane.

Each RealNode has its own directory (containerd root, state and socket; the kubelet's root
dir; logs), its own bridge vlmbr<N> with 10.244.<N>.0/24 for its pods (CNI bridge +
host-local, no masquerade: nothing leaves the machine), its own mount namespace shared by its
containerd and kubelet (the kubelet's fixed paths, device-plugins and pod logs, are the node's
own there), and a device plugin advertising stand-in GPUs as nvidia.com/gpu (Allocate sets
NVIDIA_VISIBLE_DEVICES). Its containerd pulls images from a local registry (registry.py): the
project's images, built from images/ by buildah on stand-in bases (imagebuild.py), and the pod
sandbox's.

Needs root, containerd, runc, the CNI plugins, iproute2, buildah, debootstrap and
docker-registry (hack/install-deps.sh), and the kubelet (`python -m vlm_testbed.controlplane
build`).

Modules: config (network, containerd config, kubelet flags, mount namespace), registry,
imagebuild, node (RealNode), pods (a stand-in pod and waits), stale (what a killed session
left). `python -m vlm_testbed.realnode prepare` makes the image base ahead of build_images.
"""

from .imagebuild import OPERATOR_IMAGE, PAUSE_IMAGE, VLLM_IMAGE, build_images
from .node import GPU, RealNode, real_nodes
from .registry import LocalRegistry

__all__ = ["GPU", "OPERATOR_IMAGE", "PAUSE_IMAGE", "VLLM_IMAGE", "LocalRegistry", "RealNode",
           "build_images", "real_nodes"]
