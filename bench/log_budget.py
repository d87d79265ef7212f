"""The log budget (operator/vlm_operator/logs/budget.py) and the owner-chain check on the pod
cache, in one process, without a cluster.

Part 1, per line: a follower's cost for a plain vLLM INFO line scanned, and for one skipped
over its pod's budget line by line (µs of CPU per line, one thread); whole chunks of a pod
already over its budget are skipped without being split into lines (part 2).

Part 2, the GIL: 16 followers (4 namespaces) follow endless floods through their own stream
loop (distinct lines in 64 KiB chunks, at most 6,000 lines/s each, as a stream through the
apiserver delivers them: 96,000 lines/s together, twice what saturates the GIL) while a
probe thread sleeps 1 ms at a time; its wake-up delay (how late it woke, p50/p99) says how long
other threads of the operator wait. Once with a budget too large to bind (the code before the
budget), with the default budget and with a smaller one, each after the first BURST_S + 1 s
(the buckets start full).

Part 3, memory: 200 pods labelled like a VLMDeployment's with 250 KB annotations each, as the
managed-pod cache held them (every labelled pod, all but managedFields) and as it holds them now
(pods whose owner chain does not lead to a VLMDeployment not at all; the operator's own pods in
the form of pods.kept_pod), by tracemalloc.

Usage: .venv/bin/python bench/log_budget.py [--lines-per-s N] [--cpu-per-s S]
(a third run with that whole budget, default 2,000 lines/s and 0.05 s of CPU per second: on a
small machine 16 flooding threads cannot offer more lines than the default budget admits.)
Writes bench/results/log-budget.json and log-budget.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import tracemalloc
from pathlib import Path

from common import machine, percentile
from vlm_operator.desired import children
from vlm_operator.k8s.pods import kept_pod
from vlm_operator.logs import budget as budget_module
from vlm_operator.logs.budget import LineBudget
from vlm_operator.logs.stream import Follower

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FLOODERS = 16
FLOOD_LINES_PER_S = 6_000  # what each flooding pod's stream delivers at most: 96,000 lines/s
RUN_S = 4.0


class Endless:
    """A pods/log answer: the lines again and again in 64 KiB chunks, each line with a fresh
    time (so none is a duplicate), until `stop` is set."""

    status = 200

    def __init__(self, tag: str, stop: threading.Event) -> None:
        self.response, self.tag, self.stop = self, tag, stop

    def stream(self, size, decode_content=False):
        template = b"\n".join(lines(self.tag, 480)) + b"\n"  # about 64 KiB
        old = template[:19]  # the time to the second: a fresh second for every chunk
        second = 0
        while not self.stop.is_set():
            second += 1
            yield template.replace(old, time.strftime(
                "%Y-%m-%dT%H:%M:%S", time.gmtime(1_796_000_000 + second)).encode())
            time.sleep(480 / FLOOD_LINES_PER_S)  # the network's pace: the GIL is free meanwhile

    def release_conn(self):
        pass


class Sink:
    """What a follower calls back, doing nothing; its log requests answered by `answer`."""

    def __init__(self, budget: LineBudget, answer=None) -> None:
        self.budget, self.answer = budget, answer
        self.kube = self
        self.api = self

    def param_serialize(self, method, path, query_params, header_params, auth_settings):
        return ()

    def call_api(self, *params, _request_timeout=None):
        return self.answer()

    def extra_signatures(self, namespace, owner):
        return ()

    def detected(self, follower, det, t):
        pass

    def log_news(self, follower):
        pass

    def throttled(self, follower, lines):
        pass


def pod(name: str, namespace: str) -> dict:
    return {"metadata": {"name": name, "namespace": namespace, "uid": name,
                         "labels": children.get_labels("m")},
            "spec": {"containers": [{"name": "vllm"}]}, "status": {}}


def lines(tag: str, n: int) -> list[bytes]:
    return [(f"2026-12-03T12:00:00.{i:09d}Z (APIServer pid=1) INFO 12-03 12:00:00 "
             f"[logger.py:39] {tag} request {i}: prompt: 'hello', params: SamplingParams("
             f"n=1, temperature=0.7), lora_request: None.").encode() for i in range(n)]


def per_line_us() -> dict:
    flood = lines("p", 50_000)
    out = {}
    for name, budget in (("scanned", LineBudget(lines_per_s=10**9, cpu_per_s=1e6)),
                         ("skipped", LineBudget(lines_per_s=1, cpu_per_s=1e-9))):
        follower = Follower(Sink(budget), pod("p", "ns"))
        for raw in flood[:600]:  # the skipped case spends its minimum burst first
            follower._offer(raw)
        started = time.thread_time()
        for raw in flood[600:]:
            follower._offer(raw)
        out[name] = (time.thread_time() - started) / (len(flood) - 600) * 1e6
    return out


def wakeups(budget: LineBudget) -> dict:
    """Followers reading endless floods through their own stream loop (Follower._stream)."""
    stop = threading.Event()
    skipped = [0]

    class Counting(Sink):
        def throttled(self, follower, n):
            skipped[0] += n

    followers = [Follower(Counting(budget, lambda i=i: Endless(f"f{i}", stop)),
                          pod(f"f{i}", f"ns{i % 4}")) for i in range(FLOODERS)]
    threads = [threading.Thread(target=f._stream, args=(False,), daemon=True)
               for f in followers]
    for thread in threads:
        thread.start()
    time.sleep(budget_module.BURST_S + 1.0)  # past the buckets' first burst
    scanned_before, skipped_before = sum(f.scanner.headered for f in followers), skipped[0]
    late = []
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        before = time.perf_counter()
        time.sleep(0.001)
        late.append((time.perf_counter() - before - 0.001) * 1000)
    stop.set()
    for thread in threads:
        thread.join()
    scanned = sum(f.scanner.headered for f in followers) - scanned_before
    offered = scanned + skipped[0] - skipped_before
    return {"wakeup_late_ms_p50": percentile(late, 50), "wakeup_late_ms_p99": percentile(late, 99),
            "lines_offered_per_s": round(offered / RUN_S),
            "lines_scanned_per_s": round(scanned / RUN_S)}


def memory() -> dict:
    blob = {"tenant.example/blob": "x" * 250_000}
    pods = []
    for i in range(200):
        p = pod(f"intruder-{i}", "tenant")
        p["metadata"]["annotations"] = dict(blob)
        p["metadata"]["managedFields"] = [{"manager": "kubectl", "fieldsV1": {"f:x": {}}}]
        pods.append(p)
    raw = [json.dumps(p) for p in pods]
    out = {}
    for name, keep in (
            ("before: every labelled pod, less managedFields",
             lambda p: {**p, "metadata": {k: v for k, v in p["metadata"].items()
                                          if k != "managedFields"}}),
            ("now: foreign pods not held", lambda p: None),
            ("now: were they ours, kept_pod", kept_pod)):
        tracemalloc.start()
        held = [v for text in raw if (v := keep(json.loads(text))) is not None]
        size, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[name] = round(size / 2**20, 2)
        del held
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines-per-s", type=int, default=2_000)
    parser.add_argument("--cpu-per-s", type=float, default=0.05)  # a fifth of the default
    args = parser.parse_args()
    budgets = {"unbounded (before)": LineBudget(lines_per_s=10**9, cpu_per_s=1e6),
               "default": LineBudget()}
    budgets[f"{args.lines_per_s:,} lines/s, {args.cpu_per_s:g} s CPU/s"] = LineBudget(
        lines_per_s=args.lines_per_s, cpu_per_s=args.cpu_per_s)
    result = {"machine": machine(), "flooders": FLOODERS, "run_s": RUN_S,
              "default_budget": {"lines_per_s": budget_module.LINES_PER_S,
                                 "cpu_per_s": budget_module.CPU_PER_S,
                                 "burst_s": budget_module.BURST_S},
              "per_line_us": per_line_us(),
              "gil": {name: wakeups(budget) for name, budget in budgets.items()},
              "memory_mib_200_pods_250kb": memory()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "log-budget.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["machine"]
    md = ["# Log budget", "",
          f"`bench/log_budget.py` on {m['cpu']} ({m['cores']} cores, load {m['load_avg']}), "
          f"Python {m['python']}, commit {m['commit']}, {m['time']}.", "",
          "## Per line (one thread, µs of CPU)", "",
          "| line | µs |", "| --- | --- |"]
    md += [f"| {k} | {v:.1f} |" for k, v in result["per_line_us"].items()]
    md += ["", f"## {FLOODERS} flooding followers: a probe thread's 1 ms sleeps, how late it "
           f"woke ({RUN_S:g} s, after the first burst)", "",
           "| budget | p50 ms | p99 ms | lines offered/s | lines scanned/s |",
           "| --- | --- | --- | --- | --- |"]
    md += [f"| {k} | {v['wakeup_late_ms_p50']:.2f} | {v['wakeup_late_ms_p99']:.2f} | "
           f"{v['lines_offered_per_s']:,} | {v['lines_scanned_per_s']:,} |"
           for k, v in result["gil"].items()]
    md += ["", "Lines offered/s is what the 16 streams delivered and the followers took in; with "
           "no budget every such line is scanned, so the followers' own speed caps it. Where "
           "that is below the default budget (a small or busy machine: see the load above) "
           "the default run hardly binds, and the smaller budget shows what a binding one "
           "does: chunks of a pod over its budget are dropped unsplit, so the followers take "
           "in more lines and scan few of them."]
    md += ["", "## 200 labelled pods with 250 KB of annotations: what the pod cache holds "
           "(MiB, tracemalloc)", "", "| | MiB |", "| --- | --- |"]
    md += [f"| {k} | {v} |" for k, v in result["memory_mib_200_pods_250kb"].items()]
    (RESULTS / "log-budget.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
