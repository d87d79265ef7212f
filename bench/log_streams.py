"""What following pods' logs costs the kube-apiserver: its CPU and memory with 0,
200 and 1,000 open `pods/log?follow=true` streams, and how late a line arrives.

The operator follows every managed pod's log through the apiserver, which proxies each stream
to the node's kubelet: one long-lived request per pod. This bench opens the streams the way the
operator's followers do (the official client, one thread per stream) against a real
kube-apiserver v1.20.2, with the node simulator as the kubelets (pods without processes; each
writes a line every --line-interval seconds, as vLLM's stats logger does every 10 s while it
serves). Per stage it measures, over --window seconds: the apiserver's CPU (s/s) and RSS, its
goroutines, and each line's delay from being written to the node's log file to reaching the
follower (every line written in the window counts: one that never arrived is reported as
missing, not dropped from the percentiles).

Usage: .venv/bin/python bench/log_streams.py [--stages 0,200,1000] [--window 60]
       [--line-interval 10]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client

from common import cpu_seconds, machine, percentile, rss_mib
from vlm_testbed.controlplane import (
    K8S_VERSION,
    ControlPlane,
    api_client_from_kubeconfig,
    ready_namespace,
)
from vlm_testbed.nodesim import NO_PROCESS, NodeSimulator

RESULTS = Path(__file__).resolve().parent / "results"
NODES = 20
MARK = "bench-line "


class Streams:
    """Follow streams opened one thread each; `arrived[(pod, seq)]` = time a line came."""

    def __init__(self, api, ns: str) -> None:
        self.core = client.CoreV1Api(api)
        self.ns = ns
        self.arrived: dict[tuple[str, int], float] = {}
        self.open: set[str] = set()
        self.lock = threading.Lock()

    def follow(self, pod: str, opened: threading.Event) -> None:
        rsp = self.core.read_namespaced_pod_log(pod, self.ns, follow=True,
                                                _preload_content=False)
        with self.lock:
            self.open.add(pod)
        opened.set()
        buf = b""
        try:
            for chunk in rsp.stream(65536):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                now = time.time()
                for line in lines:
                    text = line.decode(errors="replace")
                    if MARK in text:
                        seq = int(text.rsplit(MARK, 1)[1].split()[0])
                        with self.lock:
                            self.arrived.setdefault((pod, seq), now)
        except Exception:  # the stream broke: counted by `open`, its lines as missing
            pass
        with self.lock:
            self.open.discard(pod)

    def start(self, pods: list[str]) -> None:
        for pod in pods:
            opened = threading.Event()
            threading.Thread(target=self.follow, args=(pod, opened), daemon=True).start()
            opened.wait(30)


GO_METRICS = ("go_goroutines", "go_memstats_heap_inuse_bytes", "go_memstats_stack_inuse_bytes")


def go_metrics(api) -> dict[str, float]:
    """The apiserver's goroutines and Go heap and stack in use, from its /metrics (RSS says
    little: the Go runtime returns freed memory to the system late, in bursts)."""
    rsp = api.call_api("GET", api.configuration.host + "/metrics", _request_timeout=10)
    out = {}
    for line in rsp.read().decode().splitlines():
        name, _, value = line.partition(" ")
        if name in GO_METRICS:
            out[name] = float(value)
    return out


def stage(cp: ControlPlane, api, sim: NodeSimulator, ns: str, streams: Streams,
          followed: list[str], window: float, interval: float) -> dict:
    """Every pod writes a line every `interval` s (spread); measure over `window` s."""
    pods = [sim.runner_by_name(ns, name) for name in followed]
    written: dict[tuple[str, int], float] = {}
    pid = cp.apiserver_pid
    samples: list[dict[str, float]] = []
    done = threading.Event()

    def sample() -> None:  # the Go heap's floor over the window: its live data, not garbage
        while not done.wait(5):
            samples.append(go_metrics(api))
    threading.Thread(target=sample, daemon=True).start()
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    seq = 0
    while time.monotonic() - t0 < window:
        round_start = time.monotonic()
        for i, (name, pod) in enumerate(zip(followed, pods, strict=True)):
            target = round_start + interval * i / max(1, len(pods))
            time.sleep(max(0.0, target - time.monotonic()))
            written[(name, seq)] = time.time()
            pod.main[0].append([f"INFO {MARK}{seq} from {name}"])
        seq += 1
        time.sleep(max(0.0, round_start + interval - time.monotonic()))
    elapsed = time.monotonic() - t0
    cpu = cpu_seconds(pid) - cpu0
    done.set()
    go = go_metrics(api)
    go["go_memstats_heap_inuse_bytes"] = min(
        m["go_memstats_heap_inuse_bytes"] for m in [*samples, go])
    time.sleep(5)  # lines in flight at the stop still count, as late or missing
    with streams.lock:
        delays = sorted(streams.arrived[k] - t for k, t in written.items()
                        if k in streams.arrived)
        still_open = len(streams.open & set(followed))
    missing = len(written) - len(delays)
    return {"streams": len(followed), "open_at_end": still_open, "window_s": round(elapsed, 1),
            "apiserver_cpu_per_s": round(cpu / elapsed, 4),
            "apiserver_rss_mib": round(rss_mib(pid), 1),
            **{f"apiserver_{k}": v for k, v in go.items()},
            "lines_written": len(written), "lines_missing": missing,
            "line_delay_s": ({"p50": round(percentile(delays, 50), 4),
                              "p99": round(percentile(delays, 99), 4),
                              "max": round(delays[-1], 4)} if delays else None)}


def write(rows: list[dict], args: argparse.Namespace) -> None:
    """Results so far (after every stage: a later stage that breaks keeps the earlier)."""
    base = rows[0]
    for row in rows[1:]:
        extra = row["streams"] - base["streams"]
        row["per_stream"] = {
            "apiserver_cpu_ms_per_s": round((row["apiserver_cpu_per_s"]
                                             - base["apiserver_cpu_per_s"]) / extra * 1000, 4),
            "goroutines": round((row["apiserver_go_goroutines"]
                                 - base["apiserver_go_goroutines"]) / extra, 2),
            "heap_and_stack_kib": round(sum(row[f"apiserver_{k}"] - base[f"apiserver_{k}"]
                                            for k in GO_METRICS[1:]) / extra / 1024, 1)}
    result = {"benchmark": "log-streams", "kubernetes": K8S_VERSION, "nodes": NODES,
              "window_s": args.window, "line_interval_s": args.line_interval, "stages": rows,
              "machine": machine()}
    (RESULTS / "log-streams.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# What followed logs cost the kube-apiserver", "",
             f"`bench/log_streams.py`: kube-apiserver {K8S_VERSION}, {NODES} simulated nodes, "
             f"pods writing one line every {args.line_interval:g} s each, {args.window:g} s per "
             "stage; CPU of the apiserver process only; Go heap: the lowest of the samples "
             "taken every 5 s in the window (its live data; RSS and a single heap reading "
             "swing by hundreds of MiB with garbage collection). Per stream: the difference "
             "to the 0-stream stage, divided by the streams.", "",
             "| streams | apiserver CPU | apiserver RSS | Go heap + stacks in use | goroutines "
             "| lines (missing) | line delay p50 / p99 / max "
             "| per stream: CPU, heap + stacks, goroutines |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        d = r["line_delay_s"] or {}
        per = r.get("per_stream")
        per_text = (f"{per['apiserver_cpu_ms_per_s']} ms/s, {per['heap_and_stack_kib']} KiB, "
                    f"{per['goroutines']}") if per else "-"
        in_use = sum(r[f"apiserver_{k}"] for k in GO_METRICS[1:]) / 2**20
        lines.append(f"| {r['streams']} | {r['apiserver_cpu_per_s'] * 100:.1f} % "
                     f"| {r['apiserver_rss_mib']} MiB | {in_use:.0f} MiB "
                     f"| {r['apiserver_go_goroutines']:.0f} "
                     f"| {r['lines_written']} ({r['lines_missing']}) "
                     f"| {d.get('p50', '-')} / {d.get('p99', '-')} / {d.get('max', '-')} s "
                     f"| {per_text} |")
    m = result["machine"]
    lines += ["", f"Python {m['python']}, {m['platform']}, {m['cores']} CPUs ({m['cpu']}), "
              f"load average {m['load_avg'][0]:.1f} at the end, commit {m['commit']}, "
              f"{m['time']}. The node simulator and the followers run on the same machine.",
              ""]
    (RESULTS / "log-streams.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="0,200,1000")
    ap.add_argument("--window", type=float, default=60)
    ap.add_argument("--line-interval", type=float, default=10)
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    rows = []
    with ControlPlane([]) as cp:
        api = api_client_from_kubeconfig(cp.kubeconfig)
        core = client.CoreV1Api(api)
        with NodeSimulator(cp.kubeconfig, nodes=NODES, max_pods=110,
                           name_prefix="logs") as sim:
            ns = ready_namespace(api, "logs")
            names = [f"p{i:04d}" for i in range(max(stages))]

            def make(i: int) -> None:
                core.create_namespaced_pod(ns, {
                    "metadata": {"name": names[i], "annotations": {NO_PROCESS: "none"}},
                    "spec": {"nodeName": sim.node_names[i % NODES], "containers": [
                        {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}]}})
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(make, range(len(names))))
            while len(sim.light) < len(names):
                time.sleep(1)
            time.sleep(120)  # the pods' status writes settle, the Go heap shrinks back
            print(f"{len(names)} pods running", flush=True)
            streams = Streams(api_client_from_kubeconfig(cp.kubeconfig), ns)
            for n in stages:
                streams.start(names[len(streams.open):n])
                time.sleep(5)
                row = stage(cp, api, sim, ns, streams, names[:n], args.window,
                            args.line_interval)
                rows.append(row)
                print(json.dumps(row), flush=True)
                write(rows, args)


if __name__ == "__main__":
    main()
