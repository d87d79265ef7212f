"""The failure-matrix row hostile-tenant (vlm_testbed.failure_matrix.hostile_tenant) with the
operator of another tree and this one, side by side on one control plane: one tenant's 6 pods
serve redirects to another address, 100 MB /metrics pages and drip-fed headers, while another
tenant's only replica has its engine die. Around the row a third tenant (namespace `<ns>-x`)
holds these shapes from before the row starts to its end:

- `line`: 2 pods whose /metrics (read every second by its Builtin autoscaler) is one wanted
  sample line of about 2 MiB (under the read cap) with a label value that never closes;
- `flood`: 1 pod logging 50,000 ordinary INFO lines a second (from when the row's own pods
  serve, for FLOOD_SECONDS);
- `forged`: its VLMDeployment's in-flight annotation holds 2,800 forged records (231 KB);
- `nested-history`, `nested-in-flight`: 200 KB of `[` in the restart-history and in-flight
  annotations;
- 20 busybox-like pods labelled as `line`'s (`app.kubernetes.io/instance` and the rest) with no
  owner, logging, each with 250 KB of annotations.

The third tenant has a node of its own and a pod quota (POD_QUOTA), as a shared cluster gives
it: what its shapes make the operator do must not reach the row only through the scheduler.

The other tree is by default OLD_REF (main before the tenant-isolation fixes), extracted with
`git archive` into a temporary directory at run time; --old-src names a directory instead.

Per operator: when it acted on the other tenant's engine death (the dead pod deleted, or
fenced out of the Service under the default in-place recovery, from the moment its /health
answered 503), its time to serving again, the requests the redirects' target
got, the operator's peak RSS (VmHWM: the process's lifetime peak, read from /proc at the end, so
a process too busy to answer its own metrics is still measured) beside the chart's memory limit
(512 MiB), its CPU over the row, tracebacks in its log, whether it was still running, and what
it did to the shapes (foreign pods written or deleted, the forged VLMDeployment's replicas).

Usage: VLM_TESTBED_POD_NET=<n> .venv/bin/python bench/hostile_tenant.py [--old-src DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from common import cpu_seconds, machine
from vlm_operator.api import crd
from vlm_operator.api.names import FENCE, GROUP, HISTORY, IN_FLIGHT
from vlm_operator.desired import children
from vlm_operator.podreads import reader
from vlm_testbed.controlplane import ControlPlane, api_client_from_kubeconfig, build
from vlm_testbed.failure_matrix import Bed, hostile_tenant
from vlm_testbed.failure_matrix.bed import is_ready
from vlm_testbed.failure_matrix.stalls import metric
from vlm_testbed.firewall import OPERATOR_GID
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PREFIX = "bench-ht-"
MEMORY_LIMIT_MIB = 512  # the chart's resources.limits.memory
# main before the tenant-isolation fixes (sec-parsers, sec-input, sec-pods, sec-chart): what
# they are measured against, also once they are merged into main
OLD_REF = "b07fd8b0858dea5e6238e5f7cd823c282406d3cf"

# The third tenant's shapes (module docstring)
METRICS_LINE_BYTES = reader.METRICS_CAP - 4096  # the status line and headers fit beside it
FLOOD_RATE = 50_000  # lines a second
FLOOD_SECONDS = 100  # from the row's pods serving: its wait for PodsReadable (60 s at most),
# the engine death and the recovery
FORGED_RECORDS = 2_800
NESTED_BYTES = 200_000
FOREIGN_PODS = 20
FOREIGN_ANNOTATION_BYTES = 250_000
POD_QUOTA = 40  # the third tenant's own 26 pods (foreign ones first), and room for a few more
NODE_LABEL = "bench.vlm-operator.dev/tenant"
COMMAND = "VLM_TESTBED_POD_NET=<n> .venv/bin/python bench/hostile_tenant.py [--preliminary NOTE]"


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def old_tree(ref: str, into: Path) -> Path:
    """`operator/` of commit `ref`, extracted with git archive into `into`."""
    archive = subprocess.run(["git", "archive", ref, "operator"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def forged_in_flight(now: float) -> str:
    """FORGED_RECORDS in-flight records (about 80 bytes each) for pods that do not exist,
    well formed and started `now`."""
    records = {str(i): {"action": "Replace", "pod": "p", "incident": 1, "since": int(now),
                        "replicas": 1} for i in range(FORGED_RECORDS)}
    return json.dumps(records, separators=(",", ":"))


class Tenant:
    """The third tenant's shapes (module docstring) on namespace `<ns>-x` and nodes of its own."""

    def __init__(self, bed: Bed) -> None:
        self.bed = bed.tenant("x")
        self.core = client.CoreV1Api(bed.api)
        self.notes: dict = {}
        # its pods only on its own node: the forged records' surge replicas (2,800 Pending
        # pods on the old code) must not take the GPUs of the row's pods
        self.placed = {"scheduling": {"nodeSelector": {NODE_LABEL: self.bed.ns}}}
        bed._stack.enter_context(NodeSimulator(
            bed.kubeconfig, nodes=1, gpus_per_node=8, backoff_base=1.0,
            name_prefix=f"sim-{self.bed.ns}", labels={NODE_LABEL: self.bed.ns}))

    def start(self) -> Tenant:
        t = self.bed
        # a tenant's pod quota, as shared clusters set one: without it the old code's surge
        # for the forged records (2,800 Pending pods) swamps the scheduler and the row cannot
        # even start its own pods
        self.core.create_namespaced_resource_quota(t.ns, {
            "metadata": {"name": "pods"}, "spec": {"hard": {"pods": str(POD_QUOTA)}}})
        # Builtin autoscaling reads `line`'s /metrics every second (stall detection reads the
        # engine heartbeat from the log instead, and would not read it)
        t.create("line", replicas=2, autoscaling={
            "enabled": True, "mode": "Builtin", "minReplicas": 2, "maxReplicas": 2}, **self.placed)
        t.create("flood", replicas=1, **self.placed)
        line = 'vllm:num_requests_running{model_name="'
        line += "a" * (METRICS_LINE_BYTES - len(line))
        for pod in t.wait_ready("line", 2):
            t.fault(pod, {"fault": "huge_metrics", "line": line, "bytes": len(line),
                          "length": True})
        (self.flood_pod,) = t.wait_ready("flood", 1)
        for i in range(FOREIGN_PODS):
            self.core.create_namespaced_pod(t.ns, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"foreign-{i}", "labels": children.get_labels("line"),
                             "annotations": {"bench/padding": "x" * FOREIGN_ANNOTATION_BYTES}},
                "spec": {"nodeSelector": {NODE_LABEL: t.ns}, "containers": [{
                    "name": children.CONTAINER, "image": "busybox:1.36",
                    "command": ["sh", "-c", "while :; do echo foreign; sleep 1; done"]}]}})
        forged = forged_in_flight(time.time())
        self.notes.update(metrics_line_bytes=len(line), forged_records=FORGED_RECORDS,
                          forged_bytes=len(forged))
        for name, values in (("nested-history", {HISTORY: "[" * NESTED_BYTES}),
                             ("nested-in-flight", {IN_FLIGHT: "[" * NESTED_BYTES}),
                             ("forged", {IN_FLIGHT: forged})):
            t.create(name, replicas=1, **self.placed)
            t.custom.patch_namespaced_custom_object(
                crd.GROUP, crd.VERSION, t.ns, crd.PLURAL, name,
                {"metadata": {"annotations": values}})
        return self

    def flood(self) -> None:
        self.notes["flood_started"] = time.time()
        self.bed.fault(self.flood_pod, {"fault": "log_flood", "rate": FLOOD_RATE,
                                        "seconds": FLOOD_SECONDS})

    def outcome(self) -> dict:
        """What the operator did to the shapes: foreign pods it wrote (an annotation or label of
        its group) or deleted, the forged VLMDeployment's Deployment replicas, the conditions."""
        t = self.bed
        pods = {p.metadata.name: p for p in self.core.list_namespaced_pod(t.ns).items}
        foreign = [pods.get(f"foreign-{i}") for i in range(FOREIGN_PODS)]
        written = [p.metadata.name for p in foreign if p is not None and any(
            k.startswith(GROUP) for k in {**(p.metadata.annotations or {}),
                                          **(p.metadata.labels or {})})]
        deployment = client.AppsV1Api(t.api).list_namespaced_deployment(
            t.ns, field_selector="metadata.name=forged").items
        # the flood's last lines: `flood <n>` numbers them from 0, so the rate it kept
        tail = self.core.read_namespaced_pod_log(self.flood_pod.metadata.name, t.ns,
                                                 tail_lines=5).splitlines()
        read_at = time.time()
        done = [x for x in tail if "log_flood: " in x]
        numbers = [int(x.rsplit(" ", 1)[1]) for x in tail if x.rsplit(" ", 2)[-2:-1] == ["flood"]]
        if numbers and "flood_started" in self.notes and not done:
            self.notes["flood_lines_per_s"] = round(
                (max(numbers) + 1) / (read_at - self.notes["flood_started"]))
        return {**self.notes,
                "foreign_written": written,
                "foreign_deleted": sum(1 for p in foreign
                                       if p is None or p.metadata.deletion_timestamp),
                "forged_deployment_replicas": (deployment[0].spec.replicas if deployment
                                               else None),
                "flood_done": done[-1].split("log_flood: ")[1] if done else None,
                "conditions": {name: {c["type"]: f"{c.get('status')} {c.get('reason')}"
                                      for c in (t.get(name).get("status") or {}).get(
                                          "conditions", [])}
                               for name in ("line", "flood", "forged", "nested-history",
                                            "nested-in-flight")}}


class DeathWatch(threading.Thread):
    """Watches the row's victim ("row" in the bed's namespace): once a pod of it serves,
    `on_serving` runs (the flood starts); `dead_at` when its /health answers 503 (the engine
    died: a failed or slow read is not death), `acted_at` when the operator deleted it or
    fenced it (in-place recovery: out of the Service, its fence annotation written)."""

    def __init__(self, bed: Bed, on_serving) -> None:
        super().__init__(daemon=True, name="death-watch")
        self.bed, self.on_serving = bed, on_serving
        self.victim: str | None = None
        self.dead_at: float | None = None
        self.acted_at: float | None = None
        self.done = threading.Event()

    @staticmethod
    def status(ip: str) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{ip}:{children.PORT}/health",
                                        timeout=2) as rsp:
                return rsp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    def run(self) -> None:
        core = client.CoreV1Api(self.bed.api)
        while not self.done.wait(0.1) and self.acted_at is None:
            pods = {p.metadata.uid: p for p in core.list_namespaced_pod(
                self.bed.ns, label_selector="app.kubernetes.io/instance=row").items}
            if self.victim is None:
                serving = [p for p in pods.values()
                           if is_ready(p) and self.status(p.status.pod_ip) == 200]
                if serving:
                    self.victim, self.ip = serving[0].metadata.uid, serving[0].status.pod_ip
                    self.on_serving()
                continue
            pod = pods.get(self.victim)
            if self.dead_at is None and pod is not None and self.status(self.ip) == 503:
                self.dead_at = time.time()
            if self.dead_at is not None and (
                    pod is None or pod.metadata.deletion_timestamp
                    or FENCE in (pod.metadata.annotations or {})):
                self.acted_at = time.time()

    def acted_s(self) -> float | None:
        if self.dead_at is None or self.acted_at is None:
            return None
        return round(self.acted_at - self.dead_at, 2)


def run(cp: ControlPlane, api, name: str, src: str | None) -> dict:
    env = {"PYTHONPATH": str(Path(src) / "operator")} if src else None
    op = OperatorProcess(cp.kubeconfig, "--standalone", "-n", f"{PREFIX}*", env=env,
                         gid=OPERATOR_GID)
    namespace = f"{PREFIX}{uuid.uuid4().hex[:6]}"
    try:
        with op, Bed.new(api, cp.kubeconfig, namespace) as bed:
            return _row(op, bed, name)
    finally:
        print(json.dumps({"pods_left_after_wipe": wipe(api, [namespace, f"{namespace}-x"])}),
              flush=True)


def _row(op: OperatorProcess, bed: Bed, name: str) -> dict:
    bed.watcher = op
    cpu0, t0 = cpu_seconds(op.proc.pid), time.monotonic()
    tenant = Tenant(bed)
    watch = None
    try:
        tenant.start()
        watch = DeathWatch(bed, tenant.flood)
        watch.start()
        seen = hostile_tenant(bed, None).as_dict()
    except (AssertionError, ApiException) as exc:  # a setup step failed: record it
        seen = {"recovered_s": None, "error": str(exc)[:300]}
    if watch is not None:
        watch.done.set()
        watch.join(10)
    elapsed = time.monotonic() - t0
    alive = op.proc.poll() is None
    rss = peak_rss_mib(op.proc.pid) if alive else None
    return {
        "operator": name,
        "acted_s": watch.acted_s() if watch else None,
        "flood_on_at_death": bool(watch and watch.dead_at and "flood_started" in tenant.notes
                                  and watch.dead_at - tenant.notes["flood_started"]
                                  < FLOOD_SECONDS),
        "recovered_s": seen.get("recovered_s"),
        # a Restart's first rung: a new pod, a fence or the restart request (in place)
        "restarts": sum((seen.get("events") or {}).get(reason, 0) for reason in (
            "PodRestarted", "PodFenced", "PodRestartRequested")),
        "redirects_followed": len(seen.get("redirect_target_requests") or []),
        "peak_rss_mib": None if rss is None else round(rss, 1),
        "peak_rss_mib_sampled": seen.get("peak_rss_mib"),
        "under_memory_limit": None if rss is None else rss < MEMORY_LIMIT_MIB,
        "cpu_percent": round(100 * (cpu_seconds(op.proc.pid) - cpu0) / elapsed, 1)
        if alive else None,
        "cpu_percent_peak_sampled": seen.get("cpu_percent_peak"),
        "row_s": round(elapsed, 1),
        "operator_running_at_end": alive,
        "tracebacks": seen.get("tracebacks"),
        "hostile_conditions": {m: (h.get("readable") or {}).get("reason")
                               for m, h in (seen.get("hostile") or {}).items()},
        "tenant_x": _safe(tenant.outcome),
        "log_lines_read": _safe(lambda: {"all_pods": metric(
            op.metrics(), "vlm_operator_log_lines_total")}) if alive else None,
        "error": seen.get("error"),
    }


def wipe(api, namespaces: list[str], timeout_s: float = 180.0) -> int:
    """Every Deployment, ReplicaSet and pod of these namespaces deleted at once (grace 0: their
    nodes are gone), so the next row starts on an idle apiserver and no Pending pod of this one
    is left to take its GPUs; the pods left at the timeout."""
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    deadline = time.monotonic() + timeout_s
    left = 0
    while time.monotonic() < deadline:
        left = 0
        for ns in namespaces:
            with contextlib.suppress(ApiException):
                apps.delete_collection_namespaced_deployment(ns)
                apps.delete_collection_namespaced_replica_set(ns)
                core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
            left += len(core.list_namespaced_pod(ns).items)
        if not left:
            break
        time.sleep(2)
    return left


def _safe(call) -> dict:
    try:
        return call()
    except Exception as exc:  # a result, not a crash: the bench still writes the other row
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-src", help="a tree holding the old operator/ (default: OLD_REF "
                                      "extracted with git archive at run time)")
    ap.add_argument("--old-ref", default=OLD_REF)
    ap.add_argument("--preliminary", default="",
                    help="a note that marks the results as preliminary, and why")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the .md from the .json of the last run")
    args = ap.parse_args()
    if args.render:
        out = json.loads((RESULTS / "hostile-tenant.json").read_text())
        (RESULTS / "hostile-tenant.md").write_text(markdown(out))
        return 0
    build()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vlm-old-") as tmp, \
            ControlPlane([crd.get_crd(), *crd.get_peering_crds()]) as cp:
        old = args.old_src or str(old_tree(args.old_ref, Path(tmp)))
        api = api_client_from_kubeconfig(cp.kubeconfig)
        for name, src in ((f"old ({args.old_ref[:7]})" if not args.old_src else "old", old),
                          ("new (this tree)", None)):
            rows.append(run(cp, api, name, src))
            print(json.dumps(rows[-1]), flush=True)
    out = {"bench": "hostile_tenant", "rows": rows, "memory_limit_mib": MEMORY_LIMIT_MIB,
           "old_ref": None if args.old_src else args.old_ref,
           "preliminary": args.preliminary or None,
           "shapes": {"metrics_line_bytes": METRICS_LINE_BYTES, "flood_lines_per_s": FLOOD_RATE,
                      "flood_seconds": FLOOD_SECONDS, "forged_records": FORGED_RECORDS,
                      "nested_bytes": NESTED_BYTES, "foreign_pods": FOREIGN_PODS,
                      "foreign_annotation_bytes": FOREIGN_ANNOTATION_BYTES},
           "machine": machine(control_plane="v1.20.2 (local build)")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hostile-tenant.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "hostile-tenant.md").write_text(markdown(out))
    print(markdown(out))
    return 0


def markdown(out: dict) -> str:
    m, shapes = out["machine"], out["shapes"]
    lines = [
        "# A hostile tenant: the other tenant's engine death, the operator's memory and CPU",
        "",
    ]
    if out.get("preliminary"):
        lines += [f"**Preliminary:** {out['preliminary']}", ""]
    lines += [
        f"Command: `{COMMAND}` (about 10 minutes). The old operator is `operator/` of "
        f"{out.get('old_ref') or OLD_REF} (main before the tenant-isolation fixes), extracted "
        "with `git archive` into a temporary directory at run time; the new one is the "
        "checkout's. `--render` rewrites this file from the .json.", "",
        "The failure-matrix row hostile-tenant with each operator tree in turn on one real "
        "kube-apiserver v1.20.2: one tenant's 6 pods (vLLM stand-ins) serve redirects to another "
        "address (2 pods), 100 MB /metrics pages streamed without a Content-Length (2) and "
        "headers drip-fed a line every 0.5 s (2), while another tenant's only replica has its "
        "engine die (the process exits 0 after 5 s). A third tenant holds, from before the row "
        f"to its end: 2 pods whose /metrics is one wanted sample line of "
        f"{shapes['metrics_line_bytes']:,} bytes with a label value that never closes; 1 pod "
        f"asked to log {shapes['flood_lines_per_s']:,} INFO lines a second (for "
        f"{shapes['flood_seconds']} s from when the row's pods serve; the rate its log kept, "
        "from its numbered lines, is in the second table: less on a loaded 2-core machine, "
        "where the stand-in writes and the simulated kubelet stores every line); "
        f"{shapes['forged_records']:,} forged records in a VLMDeployment's in-flight "
        f"annotation; {shapes['nested_bytes']:,} bytes of `[` in the restart-history and "
        f"in-flight annotations of two more; {shapes['foreign_pods']} busybox-like pods "
        "labelled as a VLMDeployment's, with no owner, each with "
        f"{shapes['foreign_annotation_bytes']:,} bytes of annotations. "
        "Acted on: from the dead pod's /health answering 503 to the operator deleting it (a "
        "new pod) or fencing it (in place, the default from this tree on). "
        "Peak RSS: the operator process's VmHWM (lifetime peak) at the end of the row; CPU: % "
        "of one core over the row, and the peak over any 2 s sampled from its process metrics. "
        f"Chart memory limit: {out['memory_limit_mib']} MiB. "
        f"Machine: {m['cores']} shared cores ({m['cpu']}), load average {m['load_avg'][0]:.1f}; "
        f"commit {m['commit']}; kopf {m.get('kopf')}, kubernetes {m.get('kubernetes')}, "
        f"Python {m['python']}.",
        "",
        "| operator | engine death acted on | serving again | its restarts | redirects "
        "followed | peak RSS (limit) | CPU mean | CPU peak (2 s) | running at end | tracebacks "
        "| hostile VLMDeployments' PodsReadable |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in out["rows"]:
        acted = "never" if r["acted_s"] is None else f"{r['acted_s']:g} s"
        served = "never" if r["recovered_s"] is None else f"{r['recovered_s']:g} s"
        peak = r["cpu_percent_peak_sampled"]
        rss = "n/a" if r["peak_rss_mib"] is None else (
            f"{r['peak_rss_mib']:g} MiB ({'under' if r['under_memory_limit'] else 'OVER'})")
        cpu = "n/a" if r["cpu_percent"] is None else f"{r['cpu_percent']:g} %"
        conditions = ", ".join(f"{k}: {v or 'no condition'}"
                               for k, v in r["hostile_conditions"].items()) or "-"
        lines.append(f"| {r['operator']} | {acted} | {served} | {r['restarts'] or 0} | "
                     f"{r['redirects_followed']} | {rss} | {cpu} | "
                     f"{'n/a' if peak is None else f'{peak:g} %'} | "
                     f"{'yes' if r['operator_running_at_end'] else 'NO'} | "
                     f"{r['tracebacks']} | {conditions} |")
    lines += ["", "The third tenant, per operator:", "",
              "| operator | flood rate | foreign pods written / deleted | forged "
              "VLMDeployment's Deployment replicas | log lines read (all pods) | error |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in out["rows"]:
        x = r["tenant_x"]
        flood = x.get("flood_done") or (f"{x['flood_lines_per_s']:,} lines/s (still on)"
                                        if x.get("flood_lines_per_s") else "n/a")
        lines.append(f"| {r['operator']} | {flood} | "
                     f"{len(x.get('foreign_written') or [])} / {x.get('foreign_deleted')} | "
                     f"{x.get('forged_deployment_replicas')} | "
                     f"{(r.get('log_lines_read') or {}).get('all_pods')} | "
                     f"{r.get('error') or x.get('error') or '-'} |")
    lines += ["", "Conditions of the third tenant's VLMDeployments (status reason), per "
              "operator:", ""]
    for r in out["rows"]:
        for name, conds in (r["tenant_x"].get("conditions") or {}).items():
            lines.append(f"- {r['operator']}, `{name}`: " + (", ".join(
                f"{k}={v}" for k, v in conds.items()) or "no status"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
