"""Reconcile benchmark on the local control plane (real apiserver, simulated GPU nodes).

1. latency: 50 VLMDeployments created one after another; time from create to the Deployment
   existing, and to the VLMDeployment's status Ready=True (its simulated pod ready): p50/p99.
2. burst: 100 VLMDeployments created at once; time until all are Ready.
3. idle: the operator's CPU and RSS over a quiet minute with those 100 converged.

Usage: .venv/bin/python bench/reconcile.py [--out bench/results/reconcile.json]
       [--old-src DIR: another checkout's operator measured first, on the same control plane]
       [--rounds N: the trees measured N times each, alternating; results listed per run]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from common import cpu_seconds, machine, percentile, rss_mib
from vlm_operator.api import crd
from vlm_testbed.controlplane import (
    K8S_VERSION,
    ControlPlane,
    api_client_from_kubeconfig,
    build,
    ready_namespace,
)
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[1]


def body(name: str) -> dict:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
            "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", "image": "vllm/vllm-openai:v0.20.2"}}


def is_ready(obj: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def wait_ready(custom: client.CustomObjectsApi, ns: str, names: list[str],
               timeout: float) -> float:
    start, pending = time.monotonic(), set(names)
    while pending and time.monotonic() - start < timeout:
        items = custom.list_namespaced_custom_object(crd.GROUP, crd.VERSION, ns,
                                                     crd.PLURAL)["items"]
        pending -= {o["metadata"]["name"] for o in items if is_ready(o)}
        time.sleep(0.5)
    if pending:
        raise TimeoutError(f"{len(pending)} never became Ready")
    return time.monotonic() - start


def latency(api, ns: str, count: int) -> dict:
    custom, apps = client.CustomObjectsApi(api), client.AppsV1Api(api)
    to_deployment, to_ready = [], []
    for i in range(count):
        name = f"lat-{i}"
        t0 = time.monotonic()
        custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL,
                                               body(name))
        dep_at = None
        while True:
            now = time.monotonic()
            if dep_at is None:
                try:
                    apps.read_namespaced_deployment(name, ns)
                    dep_at = now
                except ApiException:
                    pass
            obj = custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL,
                                                      name)
            if dep_at is not None and is_ready(obj):
                to_deployment.append(dep_at - t0)
                to_ready.append(now - t0)
                break
            if now - t0 > 120:
                raise TimeoutError(f"{name} not Ready after 120 s")
            time.sleep(0.05)
        print(f"  {name}: deployment {to_deployment[-1]:.2f} s, ready {to_ready[-1]:.2f} s",
              flush=True)
    return {"count": count,
            "deployment_s": {"p50": statistics.median(to_deployment),
                             "p99": percentile(to_deployment, 99)},
            "ready_s": {"p50": statistics.median(to_ready), "p99": percentile(to_ready, 99)}}


def burst(api, ns: str, count: int) -> dict:
    custom = client.CustomObjectsApi(api)
    names = [f"burst-{i}" for i in range(count)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: custom.create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, ns, crd.PLURAL, body(n)), names))
    created = time.monotonic() - t0
    ready = wait_ready(custom, ns, names, timeout=600) + created
    return {"count": count, "create_all_s": created, "all_ready_s": ready}


def idle(operator: OperatorProcess, seconds: float) -> dict:
    cpu0 = cpu_seconds(operator.proc.pid)
    time.sleep(seconds)
    used = cpu_seconds(operator.proc.pid) - cpu0
    return {"seconds": seconds, "cpu_seconds": used, "cpu_percent": 100 * used / seconds,
            "rss_mib": rss_mib(operator.proc.pid)}


def measure(cp: ControlPlane, api, args, tree: str, src: str | None, round_: int = 0) -> dict:
    """The three measures with the operator of `src` (a checkout's root; None: this tree),
    in namespaces of its own."""
    env = {"PYTHONPATH": str(Path(src) / "operator")} if src else None
    prefix = f"bench-{tree}{round_}-"
    with OperatorProcess(cp.kubeconfig, "--standalone", "-n", f"{prefix}*",
                         env=env) as operator:
        core = client.CoreV1Api(api)
        print(f"[{tree}] latency: one VLMDeployment at a time", flush=True)
        ns = ready_namespace(api, f"{prefix}{uuid.uuid4().hex[:6]}")
        lat = latency(api, ns, args.latency_count)
        core.delete_namespace(ns)
        print(f"[{tree}] burst: all at once", flush=True)
        ns = ready_namespace(api, f"{prefix}{uuid.uuid4().hex[:6]}")
        bur = burst(api, ns, args.burst_count)
        print(f"  {bur}", flush=True)
        time.sleep(10)  # let the burst's event storm settle
        print(f"[{tree}] idle", flush=True)
        quiet = idle(operator, args.idle_seconds)
        print(f"  {quiet}", flush=True)
        core.delete_namespace(ns)
    return {"tree": tree, "src": src, "round": round_, "latency": lat, "burst": bur,
            "idle": quiet}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench/results/reconcile.json"))
    parser.add_argument("--latency-count", type=int, default=50)
    parser.add_argument("--burst-count", type=int, default=100)
    parser.add_argument("--idle-seconds", type=float, default=60)
    parser.add_argument("--old-src", help="also measure the operator of this checkout, first, "
                        "on the same control plane (e.g. `git archive REV | tar -x -C DIR`)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    build()
    trees = ([("old", args.old_src)] if args.old_src else []) + [("this", None)]
    with ControlPlane(crd.get_all_crds()) as cp, \
            NodeSimulator(cp.kubeconfig, nodes=2, gpus_per_node=80, max_pods=110,
                          name_prefix="bench-node"):
        api = api_client_from_kubeconfig(cp.kubeconfig)
        runs = [measure(cp, api, args, tree, src, r)
                for r in range(args.rounds) for tree, src in trees]
    result = {
        "benchmark": "reconcile",
        "machine": machine(control_plane=K8S_VERSION,
                           note="2 shared cores; simulated nodes (one vLLM stand-in process "
                                "per pod), real apiserver/controller-manager/scheduler"),
        "old_src": args.old_src, **({"runs": runs} if len(runs) > 1 else {
            "latency": runs[0]["latency"], "burst": runs[0]["burst"],
            "idle_with_100": runs[0]["idle"]}),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
