"""A real local Kubernetes control plane (etcd + kube-apiserver + controller-manager + scheduler).

No registry ships kube-apiserver binaries usable here, so ``build()`` compiles Kubernetes v1.20.2
from Debian bookworm's ``kubernetes`` source package and caches the binaries (the kubelet too,
for vlm_testbed.realnode). ``ControlPlane`` starts etcd and the three control-plane components
on loopback with self-made certificates and RBAC on; nodes come from vlm_testbed.nodesim
(simulated) or vlm_testbed.realnode (a real kubelet on containerd); without one, pods stay
Pending.

CLI: ``python -m vlm_testbed.controlplane build|up|down|env``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .build import ControlPlaneError, build
from .supervisor import cmd_down, cmd_env, cmd_up


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlm_testbed.controlplane", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build and cache the Kubernetes binaries")
    b.add_argument("--force", action="store_true", help="rebuild even when cached")
    b.add_argument("--no-kubelet", action="store_true",
                   help="skip the kubelet (only the real-node test bed needs it)")
    up = sub.add_parser("up", help="start a control plane (background unless --foreground)")
    up.add_argument("--foreground", action="store_true")
    up.add_argument("--manifest", action="append", default=[],
                    help="YAML file applied before the controllers start (repeatable)")
    up.add_argument("--with-project-crd", action="store_true",
                    help="apply vlm_operator.api.crd.get_crd() before the controllers start")
    up.add_argument("--timeout", type=float, default=180.0)
    sub.add_parser("down", help="stop the control plane started by `up`")
    sub.add_parser("env", help="print shell exports for the running control plane")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            build(force=args.force, node=not args.no_kubelet)
            return 0
        return {"up": cmd_up, "down": cmd_down, "env": cmd_env}[args.cmd](args)
    except ControlPlaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
