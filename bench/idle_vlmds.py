"""What VLMDeployments with no pods cost the operator: 20 of them at replicas 0 (the default spec
otherwise) on a real kube-apiserver, each operator tree in turn on the same control plane (the
old one from --old-src, e.g. `git archive main operator | tar -x -C /tmp/vlm-main`), side by
side in one run.

Per operator, after it settled (no reconcile for 10 s), over --window seconds: its API requests
per second, read two ways (the apiserver's audit log of its user, kopf's requests included;
and its own vlm_operator_api_requests_total), its CPU (% of a core), and the VLMDeployment
rounds it ran (vlm_operator_rounds_total, where the operator has that counter).

Usage: .venv/bin/python bench/idle_vlmds.py --old-src /tmp/vlm-main [--window 60] [--count 20]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from common import cpu_seconds, machine
from vlm_operator.api import crd
from vlm_testbed.controlplane import (
    ControlPlane,
    api_client_from_kubeconfig,
    build,
    ready_namespace,
)
from vlm_testbed.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
USER = "vlm-operator"


def total(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def audit_requests(path: Path, start: int) -> Counter:
    """The operator's requests since `start`, by "verb resource"."""
    counts: Counter = Counter()
    with open(path, "rb") as f:
        f.seek(start)
        for line in f.read().splitlines():
            event = json.loads(line)
            counts[f"{event['verb']} {(event.get('objectRef') or {}).get('resource', '-')}"] += 1
    return counts


def measure(cp: ControlPlane, name: str, src: str | None, window: float) -> dict:
    env = {"PYTHONPATH": str(Path(src) / "operator")} if src else None
    op = OperatorProcess(cp.user_kubeconfig(USER), "--standalone", "-n", "idle", env=env)
    op.start()
    try:
        last, quiet_since = -1.0, time.monotonic()
        while time.monotonic() - quiet_since < 10:  # settled: no reconcile for 10 s
            time.sleep(1)
            now = total(op.metrics(), "vlm_operator_reconciles_total")
            if now != last:
                last, quiet_since = now, time.monotonic()
        audit = cp.log_path("audit")
        offset, before = audit.stat().st_size, op.metrics()
        cpu0, t0 = cpu_seconds(op.proc.pid), time.monotonic()
        time.sleep(window)
        elapsed = time.monotonic() - t0
        cpu = cpu_seconds(op.proc.pid) - cpu0
        after = op.metrics()
        requests = audit_requests(audit, offset)
        return {
            "operator": name,
            "window_s": round(elapsed, 1),
            "api_requests_per_s_audit": round(sum(requests.values()) / elapsed, 3),
            "api_requests_audit_by_verb": dict(sorted(requests.items())),
            "api_requests_per_s_own": round((total(after, "vlm_operator_api_requests_total")
                                             - total(before, "vlm_operator_api_requests_total"))
                                            / elapsed, 3),
            "reconciles_per_s": round((total(after, "vlm_operator_reconciles_total")
                                       - total(before, "vlm_operator_reconciles_total"))
                                      / elapsed, 3),
            "rounds_per_s": round((total(after, "vlm_operator_rounds_total")
                                   - total(before, "vlm_operator_rounds_total")) / elapsed, 2)
            if "vlm_operator_rounds_total" in after else None,
            "cpu_percent": round(100 * cpu / elapsed, 2),
        }
    finally:
        op.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-src", required=True)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--count", type=int, default=20)
    args = ap.parse_args()
    build()
    rows = []
    with ControlPlane(crd.get_all_crds(), audit_users=[USER]) as cp:
        api = api_client_from_kubeconfig(cp.kubeconfig)
        ready_namespace(api, "idle")
        custom = client.CustomObjectsApi(api)
        for i in range(args.count):
            custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, "idle", crd.PLURAL, {
                "apiVersion": crd.API_VERSION, "kind": crd.KIND,
                "metadata": {"name": f"idle-{i:02}"},
                "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct",
                         "image": "vllm/vllm-openai:v0.20.2", "replicas": 0}})
        for name, src in (("old", args.old_src), ("new", None)):
            rows.append(measure(cp, name, src, args.window))
            print(json.dumps(rows[-1]), flush=True)
    out = {"bench": "idle_vlmds", "vlmdeployments": args.count, "replicas": 0, "rows": rows,
           "machine": machine(control_plane="v1.20.2 (local build)")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "idle-vlmds.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "idle-vlmds.md").write_text(markdown(out))
    print(markdown(out))
    return 0


def markdown(out: dict) -> str:
    m = out["machine"]
    lines = [
        "# VLMDeployments with no pods: what they cost the operator",
        "",
        f"{out['vlmdeployments']} VLMDeployments at replicas {out['replicas']} (default spec "
        "otherwise), one namespace, a real kube-apiserver v1.20.2; each operator tree in turn "
        "on the same control plane, measured once it settled (no reconcile for 10 s). API "
        "requests: the apiserver's audit log of the operator's user (kopf's own requests "
        "included) and the operator's own vlm_operator_api_requests_total. Rounds: "
        "VLMDeployment rounds run (vlm_operator_rounds_total, which the old tree does not "
        "have). "
        f"Machine: {m['cores']} shared cores ({m['cpu']}), load average {m['load_avg'][0]:.1f}; "
        f"commit {m['commit']}; kopf {m.get('kopf')}, kubernetes {m.get('kubernetes')}.",
        "",
        "| operator | window | API requests/s (audit) | API requests/s (own counter) | "
        "reconciles/s | rounds/s | CPU |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in out["rows"]:
        rounds = "n/a" if r["rounds_per_s"] is None else f"{r['rounds_per_s']:g}"
        lines.append(f"| {r['operator']} | {r['window_s']:g} s | "
                     f"{r['api_requests_per_s_audit']:g} | {r['api_requests_per_s_own']:g} | "
                     f"{r['reconciles_per_s']:g} | {rounds} | {r['cpu_percent']:g} % |")
    lines += ["", "Every request in the windows (audit log), by operator:", ""]
    lines += [f"- {r['operator']}: " + (", ".join(
        f"{k} x{v}" for k, v in r["api_requests_audit_by_verb"].items()) or "none")
        for r in out["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
