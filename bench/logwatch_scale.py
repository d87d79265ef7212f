"""One operator following many pods' logs: CPU seconds per million lines, RSS per watched pod,
lines lost.

Pods run vllmsim with VLM_SIM_LOG_RATE ordinary INFO lines per second each. After --duration
seconds every vllmsim process is frozen (SIGSTOP), the operator's vlm_operator_log_lines_total
is read once it stops moving, and compared with the lines in the node simulator's container log
files: lost = lines written - lines the operator read (duplicates would make it negative).

Usage: .venv/bin/python bench/logwatch_scale.py [--pods 200] [--rate 50] [--duration 60]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from kubernetes import client

from common import cpu_seconds, machine, rss_mib
from vlm_operator.api import crd
from vlm_operator.desired import children
from vlm_testbed.controlplane import (
    ControlPlane,
    api_client_from_kubeconfig,
    build,
    ready_namespace,
)
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess

RESULTS = Path(__file__).parent / "results"
NS = "bench-scale"


def lines_read(op: OperatorProcess) -> float:
    for line in op.metrics().splitlines():
        if line.startswith("vlm_operator_log_lines_total "):
            return float(line.split()[1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=200)
    ap.add_argument("--rate", type=float, default=50)
    ap.add_argument("--duration", type=float, default=60)
    args = ap.parse_args()
    build()
    with ControlPlane([crd.get_crd()]) as cp:
        api = api_client_from_kubeconfig(cp.kubeconfig)
        core = client.CoreV1Api(api)
        ready_namespace(api, NS)
        with NodeSimulator(cp.kubeconfig, nodes=1, gpus_per_node=args.pods, max_pods=args.pods
                           + 10, backoff_base=1.0, name_prefix="bench-scale") as sim, \
                OperatorProcess(cp.kubeconfig, "--standalone", "-n", NS) as op:
            pid = op.proc.pid
            time.sleep(3)
            rss0 = rss_mib(pid)
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                crd.GROUP, crd.VERSION, NS, crd.PLURAL, {
                    "apiVersion": crd.API_VERSION, "kind": crd.KIND,
                    "metadata": {"name": "scale"},
                    "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2",
                             "replicas": args.pods,
                             "health": {"tokenizerRetry": {"action": "Ignore"},
                                        "engineDead": {"action": "Ignore"}},
                             "vllm": {"env": [
                                 {"name": "VLM_SIM_LOG_RATE", "value": str(args.rate)},
                                 {"name": "VLM_SIM_STATS_INTERVAL", "value": "0"}]}}})
            start = time.monotonic()
            while time.monotonic() - start < 600:
                items = core.list_namespaced_pod(
                    NS, label_selector=children.get_selector("scale")).items
                running = [p for p in items if p.status.phase == "Running"]
                if len(running) >= args.pods:
                    break
                time.sleep(2)
            up_s = time.monotonic() - start
            cpu0, lines0, t0 = cpu_seconds(pid), lines_read(op), time.monotonic()
            time.sleep(args.duration)
            procs = [inst.proc for r in list(sim.runners.values()) for c in r.main
                     for inst in c.instances if inst.proc and inst.proc.poll() is None]
            for proc in procs:
                os.kill(proc.pid, signal.SIGSTOP)
            last, still = -1.0, 0
            while still < 3:  # the operator drains what is in flight
                time.sleep(2)
                now = lines_read(op)
                still = still + 1 if now == last else 0
                last = now
            elapsed = time.monotonic() - t0
            cpu = cpu_seconds(pid) - cpu0
            rss = rss_mib(pid)
            written = sum(Path(inst.log_path).read_bytes().count(b"\n")
                          for r in list(sim.runners.values()) for c in r.main
                          for inst in c.instances)
            read = last
            for proc in procs:
                os.kill(proc.pid, signal.SIGCONT)
    watched = len(procs)
    window_lines = read - lines0
    result = {
        "bench": "logwatch_scale", "pods_requested": args.pods, "pods_watched": watched,
        "rate_per_pod": args.rate, "duration_s": args.duration, "pods_up_s": round(up_s, 1),
        "lines_written": written, "lines_read": read, "lines_lost": written - read,
        "lines_in_window": window_lines,
        "lines_per_s_achieved": round(window_lines / elapsed, 1),
        "operator_cpu_s": round(cpu, 2),
        "cpu_s_per_million_lines": round(cpu / window_lines * 1e6, 1) if window_lines else None,
        "rss_mb_base": round(rss0, 1), "rss_mb_end": round(rss, 1),
        "rss_mb_per_pod": round((rss - rss0) / watched, 3) if watched else None,
        "machine": machine(control_plane="v1.20.2 (local build)"),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "logwatch-scale.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "logwatch-scale.md").write_text(
        "# Log watching at scale (one operator process)\n\n"
        f"{watched} pods, {args.rate:g} lines/s each requested, {args.duration:g} s window; "
        "real kube-apiserver v1.20.2, pods = vllmsim on the node simulator; apiserver, node "
        f"simulator, {watched} simulated engines and the operator share one "
        f"{os.cpu_count()}-core machine, so the achieved rate is what the whole machine "
        "could push, not the operator's limit.\n\n"
        "| lines written | lines read | lost | achieved lines/s | operator CPU s / 1M lines "
        "| RSS per watched pod |\n| --- | --- | --- | --- | --- | --- |\n"
        f"| {written} | {read:.0f} | {written - read:.0f} | {result['lines_per_s_achieved']} | "
        f"{result['cpu_s_per_million_lines']} | {result['rss_mb_per_pod']} MB |\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
