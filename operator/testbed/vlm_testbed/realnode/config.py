"""What a real node is started with: its bridge and CNI network, its containerd's config, the
kubelet's command line, and the mount namespace they share."""

from __future__ import annotations

import json
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vlm_testbed.controlplane.build import ControlPlaneError

from .registry import MIRRORED

CNI_BIN_DIR = "/usr/lib/cni"
# The kubelet 1.20 keeps these at fixed paths, whatever its --root-dir: the device manager's
# socket directory and the container logs (its container GC removes log directories of pods it
# does not know, i.e. another node's). Each node bind-mounts its own over them in a mount
# namespace of its own, shared by its containerd and kubelet.
FIXED_PATHS = {"device-plugins": "/var/lib/kubelet/device-plugins", "pod-logs": "/var/log/pods",
               "container-logs": "/var/log/containers"}


@dataclass(frozen=True)
class NodeNet:
    """Node `index`'s network: bridge vlmbr<index> holding 10.244.<index>.1/24, pods on the
    rest of that /24 (host-local) with the bridge as their default gateway (so they reach
    this machine's own addresses, the apiserver's pod_address among them), no masquerade:
    nothing they send leaves the machine."""

    index: int

    @property
    def bridge(self) -> str:
        return f"vlmbr{self.index}"

    @property
    def gateway(self) -> str:
        return f"10.244.{self.index}.1"

    @property
    def subnet(self) -> str:
        return f"10.244.{self.index}.0/24"

    def conflist(self, ipam_dir: Path) -> dict:
        return {
            "cniVersion": "0.4.0", "name": f"vlm-node{self.index}",
            "plugins": [{
                "type": "bridge", "bridge": self.bridge, "isGateway": True,
                "isDefaultGateway": True, "ipMasq": False,
                "hairpinMode": True,
                "ipam": {"type": "host-local", "dataDir": str(ipam_dir),
                         "ranges": [[{"subnet": self.subnet, "gateway": self.gateway}]]},
            }],
        }


def host_address() -> str:
    """This machine's address on its route out: pods on every real node reach it through
    their bridge's gateway (the kubelet and the apiserver refuse loopback for what pods use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: picks the route, sends nothing
        except OSError as exc:
            raise ControlPlaneError(f"no address but loopback on this machine ({exc}): pods "
                                    "on a real node reach the apiserver at one") from exc
        address = s.getsockname()[0]
    if address.startswith("127."):
        raise ControlPlaneError("no address but loopback on this machine: pods on a real node "
                                "reach the apiserver at one")
    return address


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise ControlPlaneError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")
    return r


def bridge_exists(name: str) -> bool:
    return ip("link", "show", name, check=False).returncode == 0


def add_bridge(net: NodeNet) -> None:
    ip("link", "add", net.bridge, "type", "bridge")
    ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
    ip("link", "set", net.bridge, "up")


def containerd_config(root: Path, sandbox_image: str, registry: str) -> str:
    """containerd 1.6 config (version 2): root, state, socket and runc state under `root`;
    restrict_oom_score_adj (runc fails every sandbox here without it: "can't get final
    child's PID from pipe"); network namespaces under its state dir; `registry` (host:port,
    plain HTTP) as the mirror of the registries registry.MIRRORED names."""
    cd = root / "containerd"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    mirrors = "".join(f"""
[{cri}.registry.mirrors."{host}"]
  endpoint = ["http://{registry}"]
""" for host in MIRRORED)
    return f"""version = 2
root = "{cd / 'root'}"
state = "{cd / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = "{cd / 'containerd.sock'}"

[ttrpc]
  address = "{cd / 'containerd.sock.ttrpc'}"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{cd / 'opt'}"

[{cri}]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  Root = "{cd / 'runc'}"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{root / 'cni' / 'net.d'}"
{mirrors}"""


def write_cni(root: Path, net: NodeNet) -> None:
    d = root / "cni" / "net.d"
    d.mkdir(parents=True, exist_ok=True)
    (root / "cni" / "ipam").mkdir(exist_ok=True)
    (d / "10-vlm.conflist").write_text(json.dumps(net.conflist(root / "cni" / "ipam"), indent=1))


def kubelet_args(*, kubelet: Path, root: Path, name: str, net: NodeNet, kubeconfig: Path,
                 ca: Path, socket: Path, port: int, healthz_port: int, pause_image: str,
                 labels: dict[str, str], verbosity: int = 1) -> list[str]:
    kd = root / "kubelet"
    return [
        str(kubelet), f"--v={verbosity}", f"--kubeconfig={kubeconfig}", f"--root-dir={kd}",
        f"--cert-dir={kd / 'pki'}", f"--volume-plugin-dir={kd / 'volume-plugins'}",
        "--container-runtime=remote", f"--container-runtime-endpoint=unix://{socket}",
        f"--pod-infra-container-image={pause_image}", "--runtime-request-timeout=2m",
        f"--hostname-override={name}", f"--node-ip={net.gateway}", f"--address={net.gateway}",
        f"--port={port}", "--read-only-port=0", "--healthz-bind-address=127.0.0.1",
        f"--healthz-port={healthz_port}",
        # cgroup v1 here, no systemd: no QoS hierarchy, nothing reserved, cgroupfs
        "--cgroups-per-qos=false", "--enforce-node-allocatable=", "--fail-swap-on=false",
        "--cgroup-driver=cgroupfs",
        f"--client-ca-file={ca}", "--anonymous-auth=false", "--authorization-mode=AlwaysAllow",
        "--rotate-certificates=false", "--make-iptables-util-chains=false",
        "--container-log-max-size=5Mi", "--container-log-max-files=2",
        # the local registry goes with the session: never collect its images; no eviction
        # for disk
        "--image-gc-high-threshold=100", "--image-gc-low-threshold=99",
        "--eviction-hard=memory.available<1Mi,nodefs.available<1%,imagefs.available<1%",
        "--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
    ]


def namespace_holder_cmd(root: Path) -> list[str]:
    """A process holding the node's mount namespace (private propagation: nothing mounted in
    it is seen outside, and all of it goes with the namespace) with the node's own directories
    bind-mounted over FIXED_PATHS; it prints `ready` and sleeps."""
    mounts = []
    for key, target in FIXED_PATHS.items():
        src = root / "fixed" / key
        mounts.append(f"mount --bind '{src}' '{target}'")
    script = "set -e; " + "; ".join(mounts) + "; echo ready; exec sleep infinity"
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script]


def prepare_fixed_paths(root: Path) -> None:
    for key, target in FIXED_PATHS.items():
        (root / "fixed" / key).mkdir(parents=True, exist_ok=True)
        Path(target).mkdir(parents=True, exist_ok=True)  # the mount point, empty on the host
