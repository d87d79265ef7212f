"""Detection-to-action latency: a failure line written by the pod -> its deletion at the apiserver.

Real apiserver, controllers and operator process; pods run vllmsim on the node simulator. For
each incident a ready pod writes one tokenizer-retry warning (POST /sim/log; the write time is
taken just before the request) and a pod watch records when the apiserver shows the pod's
deletionTimestamp. Policy: threshold 1, Restart, no budget limit, minAvailable 0.

Usage: .venv/bin/python bench/remediation_latency.py [--incidents 100] [--replicas 4]
       [--old-src DIR: another checkout's operator measured first, on the same control plane]
       [--rounds N: the trees measured N times each, alternating] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

from kubernetes import client, watch

from common import machine, percentile
from vlm_operator.api import crd
from vlm_operator.desired import children
from vlm_testbed import vllmsim
from vlm_testbed.controlplane import (
    ControlPlane,
    api_client_from_kubeconfig,
    build,
    ready_namespace,
)
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess

RESULTS = Path(__file__).parent / "results"
NS = "bench-latency"


def post(ip: str, path: str, body: dict) -> None:
    req = urllib.request.Request(f"http://{ip}:8000{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=5).read()


def measure(cp: ControlPlane, api, args, tree: str, src: str | None, round_: int = 0) -> dict:
    """`args.incidents` incidents with the operator of `src` (a checkout's root; None: this
    tree), in a namespace of its own."""
    core = client.CoreV1Api(api)
    ns = f"{NS}-{tree}-{round_}"
    ready_namespace(api, ns)
    deleted_at: dict[str, float] = {}
    stop = threading.Event()

    def watch_pods() -> None:
        while not stop.is_set():
            w = watch.Watch()
            for ev in w.stream(core.list_namespaced_pod, ns, timeout_seconds=30):
                p = ev["object"]
                if p.metadata.deletion_timestamp and p.metadata.uid not in deleted_at:
                    deleted_at[p.metadata.uid] = time.time()
                if stop.is_set():
                    break

    threading.Thread(target=watch_pods, daemon=True).start()
    env = {"PYTHONPATH": str(Path(src) / "operator")} if src else None
    with NodeSimulator(cp.kubeconfig, nodes=1, gpus_per_node=args.replicas + 2,
                       backoff_base=1.0, name_prefix=f"bench-lat-{tree}-{round_}"), \
            OperatorProcess(cp.kubeconfig, "--standalone", "-n", ns, env=env) as op:
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, ns, crd.PLURAL, {
                "apiVersion": crd.API_VERSION, "kind": crd.KIND,
                "metadata": {"name": "lat"},
                "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2",
                         "replicas": args.replicas,
                         "health": {"tokenizerRetry": {"threshold": 1, "windowSeconds": 60,
                                                       "action": "Restart"},
                                    "maxRestartsPerHour": 1000, "minAvailable": 0}}})
        used: set[str] = set()
        latencies: list[float] = []
        missed = 0
        while len(latencies) + missed < args.incidents:
            ready = [p for p in core.list_namespaced_pod(
                ns, label_selector=children.get_selector("lat")).items
                if p.metadata.uid not in used and not p.metadata.deletion_timestamp
                and any(c.type == "Ready" and c.status == "True"
                        for c in p.status.conditions or [])]
            if not ready:
                time.sleep(0.2)
                continue
            p = ready[0]
            used.add(p.metadata.uid)
            time.sleep(1.0)  # let the operator's follower attach to a fresh pod
            line = vllmsim.retry_warning("0.20.2", 1, 1)
            t0 = time.time()
            post(p.status.pod_ip, "/sim/log", {"lines": [line]})
            deadline = time.monotonic() + 10
            while p.metadata.uid not in deleted_at and time.monotonic() < deadline:
                time.sleep(0.005)
            if p.metadata.uid in deleted_at:
                latencies.append(deleted_at[p.metadata.uid] - t0)
            else:
                missed += 1
        stop.set()
        metrics = op.metrics()
        client.CustomObjectsApi(api).delete_namespaced_custom_object(
            crd.GROUP, crd.VERSION, ns, crd.PLURAL, "lat")
    return {
        "tree": tree, "src": src, "round": round_, "incidents": args.incidents, "missed": missed,
        "p50_s": statistics.median(latencies), "p99_s": percentile(latencies, 99),
        "max_s": max(latencies), "mean_s": statistics.fmean(latencies),
        "remediations_metric": [ln for ln in metrics.splitlines()
                                if ln.startswith("vlm_operator_remediations_total")],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--incidents", type=int, default=100)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--old-src", help="also measure the operator of this checkout, first, on "
                    "the same control plane (e.g. `git archive REV | tar -x -C DIR`)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "remediation-latency.json")
    args = ap.parse_args()
    build()
    trees = ([("old", args.old_src)] if args.old_src else []) + [("this", None)]
    with ControlPlane([crd.get_crd()]) as cp:
        api = api_client_from_kubeconfig(cp.kubeconfig)
        runs = [measure(cp, api, args, tree, src, r)
                for r in range(args.rounds) for tree, src in trees]
    result = {"bench": "remediation_latency", "replicas": args.replicas, "runs": runs,
              "machine": machine(control_plane="v1.20.2 (local build)")}
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    rows = "".join(
        f"| {r['tree']}{' (' + r['src'] + ')' if r['src'] else ''} | {r['p50_s']:.3f} s | "
        f"{r['p99_s']:.3f} s | {r['max_s']:.3f} s | {r['mean_s']:.3f} s | "
        f"{r['incidents'] - r['missed']} ({r['missed']} missed) |\n" for r in runs)
    m = result["machine"]
    args.out.with_suffix(".md").write_text(
        "# Remediation latency (log line written -> pod deletion seen at the apiserver)\n\n"
        f"{args.replicas} replicas, threshold 1, Restart; real kube-apiserver v1.20.2, operator "
        "as a process (each tree's in turn, on one control plane), pods = vllmsim on the node "
        f"simulator, all on one shared {m['cores']}-core machine; commit {m['commit']}.\n\n"
        "| operator | p50 | p99 | max | mean | incidents |\n"
        "| --- | --- | --- | --- | --- | --- |\n" + rows +
        "\nTarget: p99 < 1 s. Peers relying on /health probes detect in 30-100 s "
        "(facts.md).\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
