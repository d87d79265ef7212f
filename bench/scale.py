"""The operator at cluster scale: one operator process's CPU, RSS and API requests/s,
and its reconcile and remediation latency, on a real kube-apiserver with 50 simulated nodes and
200 VLMDeployments.

Configurations (--configs, default all but smoke):
  pods-500     200 VLMDeployments, 500 managed pods (100 x 2 replicas, 100 x 3)
  pods-2000    200 VLMDeployments x 10 replicas
  cluster-10k  200 VLMDeployments x 1 replica (2 % of 10,000 pods) and 9,800 unmanaged pods
               (500 of them holding a GPU) that the operator must not pay for
  cluster-200  the same 200 VLMDeployments x 1 replica and no other pod: what cluster-10k
               is compared with

Every pod is a node-simulator LightPod (no process per pod: 2,000 vLLM stand-in processes do
not fit on one machine): the apiserver objects are real, and each managed pod answers vLLM's
/metrics (the page of a real vLLM 0.32.0, 50 KB), /health and completions and has a log that
the operator follows through the apiserver, as with real pods. Half of the VLMDeployments run
Builtin autoscaling (steady load: no scaling), so the GPU budget and the rounds are exercised.

Per configuration:
- reconcile latency: VLMDeployments created 8 at a time; create -> Deployment exists and
  create -> Ready=True, from watches.
- steady state over --window seconds, once the operator reconciles fewer than 2 times a second
  (the convergence's tail: controllers' status writes to Deployments and PDBs) and the
  machine's 1-minute load average is below 4 (creating 9,800 pods leaves it loaded for
  minutes): operator CPU (s/s), RSS; kube-apiserver CPU and RSS; the operator's API
  requests/s by verb from the apiserver's audit log (the operator runs as user vlm-operator:
  kopf's requests count too); Builtin rounds completed per second; and what the operator did
  per second and why, from its own counters (reconciles, Events by reason, autoscaler decisions
  by reason, scrape errors, canaries by result).
- remediation latency: --faults engine deaths on pods of different VLMDeployments; the last
  engine-death line written -> the pod's deletion seen by a watch.

--old-src DIR runs the operator from another tree instead (e.g. `git archive` of an older
commit), --append adds its rows to the results in --out.

Usage: .venv/bin/python bench/scale.py [--configs pods-500,pods-2000,cluster-10k]
       [--window 60] [--faults 20] [--old-src /tmp/vlm-old --append]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client, watch
from prometheus_client.parser import text_string_to_metric_families

from common import cpu_seconds, machine, percentile, rss_mib
from vlm_operator.api import crd
from vlm_operator.desired import children
from vlm_operator.podreads import reader
from vlm_testbed.controlplane import (
    K8S_VERSION,
    ControlPlane,
    api_client_from_kubeconfig,
    build,
    ready_namespace,
)
from vlm_testbed.nodesim import NO_PROCESS, NodeSimulator
from vlm_testbed.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
USER = "vlm-operator"
NODES, GPUS_PER_NODE, MAX_PODS = 50, 64, 250
VLMDS = 200
METRICS_PAGE = "real vLLM 0.32.0, 50 KB"  # what each pod's /metrics serves (vllmsim)
CONFIGS = {  # name: (replicas of each VLMDeployment, unmanaged pods, of which hold a GPU)
    "pods-500": ([2] * 100 + [3] * 100, 0, 0),
    "pods-2000": ([10] * VLMDS, 0, 0),
    "cluster-10k": ([1] * VLMDS, 9800, 500),
    "cluster-200": ([1] * VLMDS, 0, 0),  # the same managed pods with no others: the baseline
    "smoke": ([1] * 10, 100, 10),  # a quick check of the bench itself
}


def vlmd_body(i: int, replicas: int) -> dict:
    spec = {"model": "m", "image": "vllm/vllm-openai:v0.32.0", "replicas": replicas,
            "vllm": {"env": [{"name": "VLM_SIM_STATS_INTERVAL", "value": "0"}]}}
    if i % 2:  # Builtin autoscaling that stays put: min = max = replicas
        spec["autoscaling"] = {"enabled": True, "minReplicas": replicas,
                               "maxReplicas": replicas}
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": f"v{i:03d}"}, "spec": spec}


class Seen:
    """First times things were seen by watches of the bench's own."""

    def __init__(self, api, ns: str) -> None:
        self.api, self.ns = api, ns
        self.deployment: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.deleted: dict[str, float] = {}  # pod name -> deletionTimestamp first seen
        self.stop = threading.Event()
        for target in (self._deployments, self._vlmds, self._pods):
            threading.Thread(target=target, daemon=True).start()

    def _loop(self, list_fn, on, **kw) -> None:
        while not self.stop.is_set():
            try:
                for event in watch.Watch().stream(list_fn, self.ns, timeout_seconds=30, **kw):
                    on(event["object"])
            except Exception:  # re-watch
                time.sleep(0.5)

    def _deployments(self) -> None:
        self._loop(client.AppsV1Api(self.api).list_namespaced_deployment,
                   lambda d: self.deployment.setdefault(d.metadata.name, time.time()))

    def _vlmds(self) -> None:
        def on(obj):
            conds = (obj.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                self.ready.setdefault(obj["metadata"]["name"], time.time())
        custom = client.CustomObjectsApi(self.api)
        self._loop(lambda ns, **kw: custom.list_namespaced_custom_object(
            crd.GROUP, crd.VERSION, ns, crd.PLURAL, **kw), on)

    def _pods(self) -> None:
        def on(pod):
            if pod.metadata.deletion_timestamp is not None:
                self.deleted.setdefault(pod.metadata.name, time.time())
        self._loop(client.CoreV1Api(self.api).list_namespaced_pod, on,
                   label_selector="app.kubernetes.io/managed-by=vlm-operator")


def lat(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(percentile(values, 50), 3),
            "p99": round(percentile(values, 99), 3), "max": round(values[-1], 3)}


def audit_counts(path: Path, start: int, end: int) -> Counter:
    counts: Counter = Counter()
    with open(path, "rb") as f:
        f.seek(start)
        for line in f.read(end - start).splitlines():
            event = json.loads(line)
            resource = (event.get("objectRef") or {}).get("resource", "-")
            counts[f"{event['verb']} {resource}"] += 1
    return counts


WHY = (("vlm_operator_reconciles_total", "result"), ("vlm_operator_events_total", "reason"),
       ("vlm_operator_autoscaler_decisions_total", "reason"),
       ("vlm_operator_autoscaler_scrape_errors_total", "vlmdeployment_namespace"),
       ("vlm_operator_canaries_total", "result"))


def by_label(op: OperatorProcess) -> dict[str, Counter]:
    """For each counter of WHY: its samples summed by that label, from the operator's
    /metrics (what the operator did in a window, and why: the request rate's causes)."""
    out = {name: Counter() for name, _ in WHY}
    labels = dict(WHY)
    for family in text_string_to_metric_families(op.metrics()):
        for sample in family.samples:
            if sample.name in labels:
                out[sample.name][sample.labels.get(labels[sample.name], "")] += sample.value
    return out


def wait_load(limit: float, timeout: float) -> float:
    """Seconds until the 1-minute load average is below `limit` (creating thousands of pods
    leaves the machine loaded for minutes, and a window taken then measures that load)."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= limit and time.monotonic() - t0 < timeout:
        time.sleep(5)
    return time.monotonic() - t0


def metric(op: OperatorProcess, name: str) -> float:
    """The operator's sample `name`, summed over its label sets."""
    return reader.parse_metrics(op.metrics(), {name}).get(name, 0.0)


def retried(create, attempts: int = 10) -> None:
    """create(), again after an apiserver error (a loaded apiserver answers 500 or 429); 409:
    an earlier attempt made it."""
    for attempt in range(attempts):
        try:
            create()
            return
        except client.exceptions.ApiException as exc:
            if exc.status == 409:
                return
            if attempt == attempts - 1:
                raise
            time.sleep(1 + attempt)


def unmanaged(core, ns: str, nodes: list[str], count: int, gpus: int) -> None:
    """Pods no controller owns, bound to nodes directly (no process; the scheduler is spared
    binding 9,800 pods), `gpus` of them holding a GPU."""
    def make(i: int) -> None:
        resources = {"limits": {"nvidia.com/gpu": "1"}} if i < gpus else {
            "requests": {"cpu": "10m"}}
        body = {"metadata": {"name": f"u{i:05d}", "labels": {"app": "other"},
                             "annotations": {NO_PROCESS: "none"}},
                "spec": {"nodeName": nodes[i % len(nodes)], "containers": [
                    {"name": "c", "image": "example.org/batch:1", "resources": resources}]}}
        retried(lambda: core.create_namespaced_pod(ns, body))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(make, range(count)))


def settle(op: OperatorProcess, quiet_per_s: float = 2.0, span: float = 30.0,
           timeout: float = 900.0) -> float:
    """Seconds until the operator reconciles fewer than `quiet_per_s` times a second over
    `span` seconds: Ready on every VLMDeployment comes before the controllers' last status
    writes to Deployments and PDBs, each a child event the operator reconciles, and those are
    the convergence's tail, not the steady state (the resync alone is 0.7/s)."""
    t0 = time.monotonic()
    marks = [(t0, metric(op, "vlm_operator_reconciles_total"))]
    while time.monotonic() - t0 < timeout:
        time.sleep(5)
        now = time.monotonic()
        marks.append((now, metric(op, "vlm_operator_reconciles_total")))
        old = [m for m in marks if now - m[0] >= span]
        if old and (marks[-1][1] - old[-1][1]) / (now - old[-1][0]) < quiet_per_s:
            return now - t0
    raise TimeoutError(f"operator still reconciling after {timeout:.0f} s")


def wait(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(2)


def run(config: str, window: float, faults: int, old_src: str | None) -> dict:
    _, others, gpu_others = CONFIGS[config]
    with ControlPlane(crd.get_all_crds(), audit_users=[USER]) as cp:
        api = api_client_from_kubeconfig(cp.kubeconfig)
        core = client.CoreV1Api(api)
        with NodeSimulator(cp.kubeconfig, nodes=NODES, gpus_per_node=GPUS_PER_NODE,
                           max_pods=MAX_PODS, name_prefix="scale", light=lambda pod: True,
                           heartbeat_s=10) as sim:
            if others:
                ns_other = ready_namespace(api, "others")
                t0 = time.monotonic()
                unmanaged(core, ns_other, sim.node_names, others, gpu_others)
                wait("unmanaged pods running", lambda: len(sim.light) >= others, 1800)
                print(f"  {others} unmanaged pods in {time.monotonic() - t0:.0f} s", flush=True)
            env = {"PYTHONPATH": str(Path(old_src) / "operator")} if old_src else None
            op = OperatorProcess(cp.user_kubeconfig(USER), "--standalone", env=env).start()
            try:
                return measure(config, cp, api, core, op, window, faults, old_src)
            finally:
                op.stop()


def measure(config: str, cp: ControlPlane, api, core, op: OperatorProcess, window: float,
            faults: int, old_src: str | None) -> dict:
    replicas, others, gpu_others = CONFIGS[config]
    managed, vlmds = sum(replicas), len(replicas)
    ns = ready_namespace(api, "bench")
    seen = Seen(api, ns)
    custom = client.CustomObjectsApi(api)
    created: dict[str, float] = {}

    def create(i: int) -> None:
        body = vlmd_body(i, replicas[i])
        created[body["metadata"]["name"]] = time.time()
        retried(lambda: custom.create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, ns, crd.PLURAL, body))
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, range(vlmds)))
    wait("every VLMDeployment Ready", lambda: len(seen.ready) >= vlmds, 3600)
    converge_s = time.monotonic() - t0
    print(f"  {vlmds} VLMDeployments, {managed} pods Ready in {converge_s:.0f} s",
          flush=True)
    settle_s = settle(op)
    load_wait_s = wait_load(4.0, 900)
    print(f"  settled in {settle_s:.0f} s, load below 4 after {load_wait_s:.0f} s more "
          f"({os.getloadavg()[0]:.1f})", flush=True)

    apiserver = cp.apiserver_pid
    audit = cp.log_path("audit")
    ticks0 = metric(op, "vlm_operator_autoscaler_tick_seconds_count")
    why0, load0 = by_label(op), os.getloadavg()
    cpu0, api_cpu0 = cpu_seconds(op.proc.pid), cpu_seconds(apiserver)
    offset0, t0 = audit.stat().st_size, time.monotonic()
    stalled = 0.0
    while time.monotonic() - t0 < window:
        time.sleep(5)
        stalled = max(stalled, metric(op, "vlm_operator_rounds_stalled"))
    elapsed = time.monotonic() - t0
    cpu, api_cpu = cpu_seconds(op.proc.pid) - cpu0, cpu_seconds(apiserver) - api_cpu0
    requests = audit_counts(audit, offset0, audit.stat().st_size)
    ticks = metric(op, "vlm_operator_autoscaler_tick_seconds_count") - ticks0
    why = {name.removeprefix("vlm_operator_"): {k: round(v / elapsed, 3)
                                                for k, v in sorted((c - why0[name]).items())
                                                if v}
           for name, c in by_label(op).items()}
    steady = {
        "window_s": round(elapsed, 1),
        "operator_cpu_per_s": round(cpu / elapsed, 3),
        "operator_rss_mib": round(rss_mib(op.proc.pid), 1),
        "apiserver_cpu_per_s": round(api_cpu / elapsed, 3),
        "apiserver_rss_mib": round(rss_mib(apiserver), 1),
        "api_requests_per_s": round(sum(requests.values()) / elapsed, 2),
        "api_requests_by_verb": {k: round(v / elapsed, 3)
                                 for k, v in sorted(requests.items())},
        "builtin_rounds_per_s": round(ticks / elapsed, 1),
        "builtin_vlmds": vlmds // 2,
        "vlmds_with_stalled_round_max": stalled,
        "operator_per_s": why,  # reconciles, Events, decisions, scrape errors, canaries
        "load_avg_start": load0, "load_avg_end": os.getloadavg(),
    }
    print(f"  steady: {json.dumps(steady)}", flush=True)

    # remediation: engine deaths on pods of different VLMDeployments
    victims = []
    for i in range(faults):
        pods = core.list_namespaced_pod(
            ns, label_selector=children.get_selector(f"v{(i * 7) % vlmds:03d}")).items
        pod = next(p for p in pods if p.metadata.deletion_timestamp is None)
        req = urllib.request.Request(
            f"http://{pod.status.pod_ip}:8000/sim/fault",
            data=b'{"fault": "engine_dead"}', method="POST",
            headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()
        victims.append((pod.metadata.name, time.time()))
        time.sleep(1)
    wait("every faulted pod deleted",
         lambda: all(name in seen.deleted for name, _ in victims), 600)
    remediation = lat([seen.deleted[name] - t for name, t in victims])
    everything = audit_counts(audit, 0, audit.stat().st_size)
    reconcile = {
        "create_to_deployment_s": lat([seen.deployment[n] - t
                                       for n, t in created.items()
                                       if n in seen.deployment]),
        "create_to_ready_s": lat([seen.ready[n] - t for n, t in created.items()
                                  if n in seen.ready]),
        "all_ready_s": round(converge_s, 1), "settled_after_s": round(settle_s, 1)}
    seen.stop.set()
    return {"config": config, "operator": "old" if old_src else "new",
            "commit": machine()["commit"], "metrics_page": METRICS_PAGE,
            "vlmdeployments": vlmds, "managed_pods": managed, "unmanaged_pods": others,
            "unmanaged_gpu_pods": gpu_others, "nodes": NODES, "steady": steady,
            "reconcile": reconcile, "remediation_s": remediation, "load_wait_s": load_wait_s,
            "api_requests_whole_run": dict(sorted(everything.items())),
            "load_avg_end": os.getloadavg()}


def table(results: list[dict]) -> str:
    head = ("| configuration | operator (commit) | pods' /metrics | pods (managed + other) "
            "| operator CPU | operator RSS | API requests/s | apiserver CPU | apiserver RSS "
            "| Builtin rounds/s | create -> Ready p50 / p99 "
            "| engine death -> pod deleted p50 / p99 |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    rows = []
    for r in results:
        s, rec, rem = r["steady"], r["reconcile"]["create_to_ready_s"], r["remediation_s"]
        rows.append(
            f"| {r['config']} | {r['operator']} ({r['commit']}) | {r['metrics_page']} "
            f"| {r['managed_pods']} + {r['unmanaged_pods']} "
            f"| {100 * s['operator_cpu_per_s']:.0f} % | {s['operator_rss_mib']:.0f} MiB "
            f"| {s['api_requests_per_s']} | {100 * s['apiserver_cpu_per_s']:.0f} % "
            f"| {s['apiserver_rss_mib']:.0f} MiB "
            f"| {s['builtin_rounds_per_s']} of {s['builtin_vlmds']} "
            f"| {rec.get('p50')} / {rec.get('p99')} s | {rem.get('p50')} / {rem.get('p99')} s |")
    return head + "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(c for c in CONFIGS if c != "smoke"))
    ap.add_argument("--window", type=float, default=60)
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--old-src", default=None)
    ap.add_argument("--out", default=str(RESULTS / "scale.json"))
    ap.add_argument("--append", action="store_true", help="add to the results in --out")
    args = ap.parse_args()
    build()
    results = json.loads(Path(args.out).read_text())["results"] if args.append else []
    for config in args.configs.split(","):
        print(f"{config} ({'old' if args.old_src else 'new'} operator)", flush=True)
        results.append(run(config, args.window, args.faults, args.old_src))
        out = {"benchmark": "scale", "results": results,  # written after every run
               "machine": machine(control_plane=K8S_VERSION, note=(
                   "2 shared cores; control plane, node simulator (every pod a LightPod), the "
                   "bench's watches and the operator on one machine"))}
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(
            "# The operator at cluster scale\n\n" + table(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
