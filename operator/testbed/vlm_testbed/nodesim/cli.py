"""Simulated node side of the local test bed: kubelet + container runtime, nothing else.

Usage: python -m vlm_testbed.nodesim --kubeconfig K --nodes N --gpus-per-node G"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from .images import VLLM_IMAGE_PULL_S
from .simulator import NodeSimulator
from .state import log
from .volumes import DOWNWARD_API_LAG_S


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlm_testbed.nodesim", description=__doc__.split(
        "\n")[0])
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), required=False)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--cpu", default="16")
    p.add_argument("--memory", default="64Gi")
    p.add_argument("--name-prefix", default="vlm-sim-node")
    p.add_argument("--backoff-base", type=float, default=10.0)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--image-pull-seconds", type=float, default=0.0,
                   help="an image's pull time on a node that lacks it (real vLLM image: "
                        f"{VLLM_IMAGE_PULL_S:g})")
    p.add_argument("--downward-api-lag", type=float, default=DOWNWARD_API_LAG_S)
    p.add_argument("--vllm-time-scale", type=float, default=0.0,
                   help="the vLLM stand-in's start-time scale (1: the published figures)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    with NodeSimulator(args.kubeconfig, args.nodes, args.gpus_per_node, cpu=args.cpu,
                       memory=args.memory, name_prefix=args.name_prefix,
                       backoff_base=args.backoff_base, work_dir=args.work_dir,
                       image_pull_seconds=args.image_pull_seconds,
                       downward_api_lag=args.downward_api_lag,
                       vllm_time_scale=args.vllm_time_scale) as sim:
        log.info("nodes %s ready (kubelet log port %d)", ", ".join(sim.node_names),
                 sim.log_server.server_address[1])
        done.wait()
    return 0
