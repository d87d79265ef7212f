"""Recovery at the cost of real hardware: for the failure-matrix rows that restart or replace a
pod, the time from the fault to the first request answered through the Service again, the
requests that failed, the requests that still reached the sick pod more than 1 s after the
operator acted on it, the time from the fault's log line to the sick pod leaving a pod list with
its InferencePool's selector (what a gateway's endpoint picker chooses from; every VLMDeployment
here has spec.gateway.inferencePool, the extension's CRD installed without its CEL rules on the
1.20 apiserver) beside the time to its Ready condition going False (all a gateway sees without
the operator), and what the recovery threw away, for three ways to recover:

- in place: spec.health.recovery InPlace (fence, then the kubelet's in-place restart, the
  plugin's restart request, a new pod only when those fail);
- new pod: spec.health.recovery NewPod (the pod deleted, its ReplicaSet makes a new one);
- probes only: every signature's action Ignore (what the kubelet's probes do alone).

Real kube-apiserver v1.20.2 and controllers, the operator as its own process, pods run by the
node simulator with the vLLM stand-in at the published start figures (vlm_testbed/vllmsim/
startup.py: cold 110 s, 52 s with the weights on the node, 48 s with the compile cache too; an
in-place restart keeps both on the pod's emptyDirs), the kubelet's downwardAPI refresh on its
sync of the updated pod (nodesim: 2 s; --downward-api-lag 60 for the periodic sync's bound),
its restart back-off and probes as the operator's pod spec sets them. Requests: a client
following the Service's EndpointSlices as kube-proxy does (vlm_testbed/load.py), 10 a second,
from the fault on; every one started is counted.

Usage: .venv/bin/python bench/recovery.py [--trials 1] [--rows id,id] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from pathlib import Path

from kubernetes import watch as kwatch
from kubernetes.client.exceptions import ApiException

from common import machine
from vlm_operator.api import crd
from vlm_operator.api.names import FENCE, IN_SERVICE_LABEL
from vlm_testbed import gateway
from vlm_testbed.controlplane import ControlPlane, api_client_from_kubeconfig, build
from vlm_testbed.failure_matrix import IGNORE_ALL, ROWS, Bed, Observed, Row, instance
from vlm_testbed.firewall import OPERATOR_GID
from vlm_testbed.load import LoadClient
from vlm_testbed.nodesim.volumes import DOWNWARD_API_LAG_S
from vlm_testbed.operator_process import OperatorProcess

RESULTS = Path(__file__).parent / "results"
PREFIX = "bench-rec-"
ROW_IDS = ("engine-dead-exit0-1", "engine-dead-alive-1", "hung-engine",
           "storm-only-gpu-free", "engine-dead-all-3")
MODES = {"in place": {"recovery": "InPlace"}, "new pod": {"recovery": "NewPod"},
         "probes only": IGNORE_ALL}
GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
RATE = 10.0
PROBES_BLIND_S = 180.0
FETCHED, COMPILED = "Time spent downloading weights", "Compiling a graph"
POOL = {"inferencePool": {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}


def hung_engine(bed: Bed, health: dict | None) -> Observed:
    """The only replica's engine process stops (its heartbeat with it; /health still 200),
    with the default stallSeconds (30)."""
    bed.nodes(gpus_per_node=2)
    bed.create("row", replicas=1, health=health)
    (pod,) = bed.wait_ready("row", 1)
    bed.wait("the engine heartbeat in the log", lambda: "vlm-engine-heartbeat" in
             bed.core.read_namespaced_pod_log(pod.metadata.name, bed.ns, container="vllm"))
    start = time.time()
    bed.fault(pod, {"fault": "stall", "heartbeat": "stops"})
    return bed.follow("row", 1, {instance(pod)}, start)


HUNG = Row("hung-engine", "hung engine (its process stopped), 1 replica", hung_engine)


class Watch:
    """Around one row: the VLMDeployments it creates, each with an InferencePool (wrapping
    bed.create), the faults it injects (wrapping bed.fault), the load from the first fault on,
    when the operator first acted on each faulted pod (fenced it, took it out of the Service,
    or deleted it) and when its Ready condition went False, polled every 0.1 s, and when it
    left the pool's pod list, from a watch with the pool's selector opened before the fault."""

    def __init__(self, bed: Bed) -> None:
        self.bed = bed
        self.fault_at: float | None = None
        self.pods: dict[str, dict] = {}  # name -> {ip, node, uid, acted_at, ...}
        self.load: LoadClient | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._pool_watch: kwatch.Watch | None = None
        self.left_pool: dict[str, float] = {}  # pod name -> when it left the pool's list
        inject, create = bed.fault, bed.create

        def fault(pod, spec):
            if self.fault_at is None:
                self._watch_pool("row")
                self.fault_at = time.time()
                self.load = LoadClient.for_service(bed.api, bed.ns, "row", rate=RATE).start()
                self._thread.start()
            self.pods[pod.metadata.name] = {"ip": pod.status.pod_ip, "uid": pod.metadata.uid,
                                            "node": pod.spec.node_name, "acted_at": None,
                                            "not_ready_at": None, "instance": instance(pod)}
            inject(pod, spec)

        bed.fault = fault
        bed.create = lambda name, **kw: create(name, gateway=POOL, **kw)

    def _watch_pool(self, name: str) -> None:
        """Follow the pods the InferencePool `name` selects: a DELETED event is a pod leaving
        its selection (its labels no longer match, or it is gone)."""
        pool = self.bed.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.bed.ns, PLURAL, name)
        selector = ",".join(f"{k}={v}" for k, v in
                            pool["spec"]["selector"]["matchLabels"].items())
        listed = self.bed.core.list_namespaced_pod(self.bed.ns, label_selector=selector)
        self._pool_watch = kwatch.Watch()
        stream = self._pool_watch.stream(
            self.bed.core.list_namespaced_pod, self.bed.ns, label_selector=selector,
            resource_version=listed.metadata.resource_version, timeout_seconds=900)

        def follow():
            try:
                for event in stream:
                    if event["type"] == "DELETED":
                        self.left_pool.setdefault(event["object"].metadata.name, time.time())
            except Exception:  # the watch closed when the row ended
                return
        threading.Thread(target=follow, daemon=True).start()

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            for name, seen in list(self.pods.items()):
                if seen["acted_at"] is not None and seen["not_ready_at"] is not None:
                    continue
                try:
                    pod = self.bed.core.read_namespaced_pod(name, self.bed.ns)
                except ApiException:
                    if seen["acted_at"] is None:
                        seen["acted_at"] = time.time()  # gone
                    seen["not_ready_at"] = seen["not_ready_at"] or time.time()
                    continue
                meta = pod.metadata
                if seen["not_ready_at"] is None and any(
                        c.type == "Ready" and c.status == "False"
                        for c in pod.status.conditions or []):
                    seen["not_ready_at"] = time.time()
                if seen["acted_at"] is None and (
                        meta.deletion_timestamp or FENCE in (meta.annotations or {}) or
                        (meta.labels or {}).get(IN_SERVICE_LABEL) == "false"):
                    seen["acted_at"] = time.time()

    def stop(self) -> None:
        self._stop.set()
        if self._pool_watch is not None:
            self._pool_watch.stop()
        if self.load is not None:
            self.load.stop()

    def measured(self) -> dict:
        if self.load is None or self.fault_at is None:
            return {}
        first = self.load.first_answer_after(self.fault_at + 1.0)
        reached = 0
        for seen in self.pods.values():
            if seen["acted_at"] is not None:  # until it serves again (in place: the same IP)
                reached += self.load.sent_to(seen["ip"], seen["acted_at"] + 1.0,
                                             before=first or float("inf"))
        after = [s["acted_at"] - self.fault_at for s in self.pods.values() if s["acted_at"]]
        left = [self.left_pool[n] - self.fault_at for n in self.pods if n in self.left_pool]
        not_ready = [s["not_ready_at"] - self.fault_at for s in self.pods.values()
                     if s["not_ready_at"]]
        result = self.load.result()
        return {"serving_again_s": round(first - self.fault_at, 2) if first else None,
                "requests": {"started": result["started"],
                             "failed": self.load.failed_after(self.fault_at)},
                "reached_after_action": reached,
                "acted_s": round(min(after), 2) if after else None,
                "left_pool_s": round(min(left), 2) if left else None,
                "not_ready_s": round(min(not_ready), 2) if not_ready else None}

    def thrown_away(self) -> dict:
        """What the pods serving now had to redo: a new pod, weights fetched, a compile."""
        out = {"new_pod": False, "weights_fetched": False, "compiled": False,
               "node_changed": False}
        if not self.pods:  # no fault was injected: nothing to compare
            return {}
        faulted = {s["uid"] for s in self.pods.values()}
        hit = {s["instance"] for s in self.pods.values()}
        nodes = {s["node"] for s in self.pods.values()}
        for pod in self.bed.pods("row"):
            if pod.metadata.deletion_timestamp or instance(pod) in hit:
                continue  # going, or the faulted container itself (it never restarted)
            if pod.metadata.uid not in faulted:
                out["new_pod"] = True
                out["node_changed"] |= pod.spec.node_name not in nodes
            try:
                log = self.bed.core.read_namespaced_pod_log(pod.metadata.name, self.bed.ns,
                                                            container="vllm")
            except ApiException:
                continue
            out["weights_fetched"] |= FETCHED in log
            out["compiled"] |= COMPILED in log
        return out


def run(api, kubeconfig, row, health: dict, node_options: dict, limit: float) -> dict:
    with Bed.new(api, kubeconfig, f"{PREFIX}{uuid.uuid4().hex[:6]}", node_options=node_options,
                 ready_timeout_s=limit) as bed:
        bed.limit_s = limit
        watch = Watch(bed)
        started = time.monotonic()
        try:
            seen = row.run(bed, health).as_dict()
        except AssertionError as exc:
            seen = {"recovered_s": None, "error": str(exc)[:300]}
        finally:
            watch.stop()
        seen.update(watch.measured())
        seen["thrown_away"] = watch.thrown_away()
        seen["wall_s"] = round(time.monotonic() - started, 1)
        return seen


def median(runs: list[dict], key: str, digits: int = 1) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "never"
    missed = len(runs) - len(values)
    return f"{statistics.median(values):.{digits}f} s" + (f" ({missed} never)" if missed else "")


def left_pool(runs: list[dict]) -> str:
    """The pool column: when the pod left the pool's list, beside when it went not Ready (what
    a gateway goes by without the operator); "not measured" for runs from before the column."""
    if not any("left_pool_s" in r for r in runs):
        return "not measured"
    return f"{median(runs, 'left_pool_s', 2)} (not Ready: {median(runs, 'not_ready_s', 2)})"


def thrown(runs: list[dict]) -> str:
    if not any(r.get("serving_again_s") is not None for r in runs):
        return "n/a (not serving again)"
    parts = []
    for key, text in (("new_pod", "new pod"), ("weights_fetched", "weights fetched"),
                      ("compiled", "compiled again"), ("node_changed", "node changed")):
        n = sum(1 for r in runs if r.get("thrown_away", {}).get(key))
        if n:
            parts.append(text if n == len(runs) else f"{text} ({n}/{len(runs)})")
    return ", ".join(parts) or "nothing (weights and compile cache kept)"


def markdown(out: dict) -> str:
    m = out["machine"]
    lines = [
        "# Recovery at real start costs: in place, new pod, probes only",
        "",
        f"{out['trials']} trial(s) per row and mode (median); start figures scaled by "
        f"{out['scale']:g} (1: cold 110 s, weights cached 52 s, weights and compile cache "
        "48 s); the kubelet's downwardAPI refresh "
        f"{out['node_options']['downward_api_lag']:g} s; limit {out['limit_s']:g} s. "
        "Serving again: the first request answered through the Service (a client following "
        "its EndpointSlices, 10 requests a second from the fault on) among those sent 1 s "
        "or more after the fault. The clock contains vLLM's own exit delay after engine death "
        "(5 s), the detection (a log line, or stallSeconds 30 for the hung engine), the "
        "kubelet's probes (readiness every 5 s; liveness every 10 s, 6 failures) and "
        "back-off (none before a first restart), the restart request's refresh, and the "
        f"start. Machine: {m['cores']} shared cores, load average {m['load_avg'][0]:.1f} at "
        f"the end, commit {m['commit']}. The hung engine under probes only is given "
        f"{PROBES_BLIND_S:g} s: its /health answers 200, so no probe acts.",
        "",
        "Left the pool: from the fault (the stand-in writes the log line at once) to the pod "
        "leaving a pod list with its InferencePool's selector, from a watch opened before "
        "the fault; beside it, when the pod's Ready condition went False or the pod was gone "
        "(polled every 0.1 s), the only signal a gateway has without the operator.",
        "",
        "| row | mode | serving again | requests failed | reached the pod > 1 s after the "
        "action | left the pool | thrown away |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes = list(out.get("notes", []))  # how runs of several commits were put together
    for entry in out["rows"]:
        for mode, runs in entry["modes"].items():
            failed = sum(r.get("requests", {}).get("failed", 0) for r in runs)
            started = sum(r.get("requests", {}).get("started", 0) for r in runs)
            reached = sum(r.get("reached_after_action", 0) for r in runs)
            acted = any(r.get("acted_s") is not None for r in runs)
            lines.append(f"| {entry['id']}: {entry['what']} | {mode} | "
                         f"{median(runs, 'serving_again_s')} | {failed} of {started} | "
                         f"{reached if acted else 'n/a (nothing acted)'} | {left_pool(runs)} | "
                         f"{thrown(runs)} |")
    return "\n".join(lines + [part for note in notes for part in ("", note)]) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--rows", default=",".join(ROW_IDS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--scale", type=float, default=1.0, help="the stand-in's start figures")
    ap.add_argument("--downward-api-lag", type=float, default=DOWNWARD_API_LAG_S)
    ap.add_argument("--limit", type=float, default=600.0)
    ap.add_argument("--out", default="recovery")
    ap.add_argument("--markdown", type=Path, help="only write the Markdown of this JSON")
    args = ap.parse_args()
    if args.markdown:
        out = json.loads(args.markdown.read_text())
        args.markdown.with_suffix(".md").write_text(markdown(out))
        return 0
    wanted = args.rows.split(",")
    rows = sorted((r for r in (*ROWS, HUNG) if r.id in wanted), key=lambda r: wanted.index(r.id))
    modes = {m: MODES[m] for m in args.modes.split(",")}
    node_options = {"vllm_time_scale": args.scale, "downward_api_lag": args.downward_api_lag}
    build()
    results = []
    with ControlPlane([crd.get_crd(), *crd.get_peering_crds()]) as cp:
        api = api_client_from_kubeconfig(cp.kubeconfig)
        gateway.install_crd(api)  # CEL rules stripped on the 1.20 apiserver
        with OperatorProcess(cp.kubeconfig, "--standalone", "-n", f"{PREFIX}*",
                             gid=OPERATOR_GID):
            for row in rows:
                entry = {"id": row.id, "what": row.what, "modes": {m: [] for m in modes}}
                for trial in range(args.trials):
                    for mode, health in modes.items():
                        # the probes never see a hung engine (/health 200): 180 s show it
                        limit = min(args.limit, PROBES_BLIND_S) if (
                            row is HUNG and health is IGNORE_ALL) else args.limit
                        seen = run(api, cp.kubeconfig, row, health, node_options, limit)
                        entry["modes"][mode].append(seen)
                        print(row.id, mode, trial, json.dumps(seen), flush=True)
                results.append(entry)
                out = write(args, node_options, results)  # after every row: a long run
                # stopped early keeps what it measured
    print(markdown(out))
    return 0


def write(args: argparse.Namespace, node_options: dict, results: list[dict]) -> dict:
    out = {"bench": "recovery", "trials": args.trials, "scale": args.scale,
           "limit_s": args.limit, "node_options": node_options, "rows": results,
           "machine": machine(control_plane="v1.20.2 (local build)")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(out))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
