"""Real nodes for the test bed: a real kubelet (v1.20.2, built with the control plane) on a
containerd of its own, registered with the test bed's control plane.

Each RealNode has its own directory (containerd root, state and socket; the kubelet's root
dir; logs), its own bridge vlmbr<N> with 10.244.<N>.0/24 for its pods (CNI bridge +
host-local, no masquerade: nothing leaves the machine), its own mount namespace shared by its
containerd and kubelet (the kubelet's fixed paths, device-plugins and pod logs, are the node's
own there), and a device plugin advertising stand-in GPUs as nvidia.com/gpu (Allocate sets
NVIDIA_VISIBLE_DEVICES). Images are made here and imported without a registry: the vLLM
stand-in (images.py) and the sandbox's pause.

Needs root, containerd, runc, the CNI plugins and iproute2 (hack/install-deps.sh), and the
kubelet (`python -m vlm_testbed.controlplane build`).

Modules: config (network, containerd config, kubelet flags, mount namespace), images, node
(RealNode).
"""

from .images import PAUSE_IMAGE, STANDIN_IMAGES, pause_image, standin_image
from .node import GPU, RealNode, real_nodes

__all__ = ["GPU", "PAUSE_IMAGE", "STANDIN_IMAGES", "RealNode", "pause_image", "real_nodes",
           "standin_image"]
