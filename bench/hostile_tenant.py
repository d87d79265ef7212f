"""The failure-matrix row hostile-tenant (vlm_testbed.failure_matrix.hostile_tenant) with the
operator of another tree (--old-src, e.g. `git archive main operator | tar -x -C /tmp/vlm-main`)
and this one, side by side on one control plane: one tenant's 6 pods serve redirects to another
address, 100 MB /metrics pages and drip-fed headers, while another tenant's only replica has its
engine die.

Per operator: the other tenant's time to serving again, the requests the redirects' target got,
the operator's peak RSS (VmHWM: the process's lifetime peak, read from /proc at the end, so a
process too busy to answer its own metrics is still measured) and its CPU over the row, beside
the chart's memory limit (512 MiB).

Usage: .venv/bin/python bench/hostile_tenant.py --old-src /tmp/vlm-main
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path

from common import cpu_seconds, machine
from vlm_operator.api import crd
from vlm_testbed.controlplane import ControlPlane, api_client_from_kubeconfig, build
from vlm_testbed.failure_matrix import Bed, hostile_tenant
from vlm_testbed.firewall import OPERATOR_GID
from vlm_testbed.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PREFIX = "bench-ht-"


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(cp: ControlPlane, api, name: str, src: str | None) -> dict:
    env = {"PYTHONPATH": str(Path(src) / "operator")} if src else None
    op = OperatorProcess(cp.kubeconfig, "--standalone", "-n", f"{PREFIX}*", env=env,
                         gid=OPERATOR_GID)
    with op, Bed.new(api, cp.kubeconfig, f"{PREFIX}{uuid.uuid4().hex[:6]}") as bed:
        bed.watcher = op
        cpu0, t0 = cpu_seconds(op.proc.pid), time.monotonic()
        try:
            seen = hostile_tenant(bed, None).as_dict()
        except AssertionError as exc:  # a setup step timed out: record it
            seen = {"recovered_s": None, "error": str(exc)[:300]}
        elapsed = time.monotonic() - t0
        return {
            "operator": name,
            "recovered_s": seen.get("recovered_s"),
            "restarts": (seen.get("events") or {}).get("PodRestarted"),
            "redirects_followed": len(seen.get("redirect_target_requests") or []),
            "peak_rss_mib": round(peak_rss_mib(op.proc.pid), 1),
            "peak_rss_mib_sampled": seen.get("peak_rss_mib"),
            "cpu_percent": round(100 * (cpu_seconds(op.proc.pid) - cpu0) / elapsed, 1),
            "cpu_percent_peak_sampled": seen.get("cpu_percent_peak"),
            "row_s": round(elapsed, 1),
            "hostile_conditions": {m: (h.get("readable") or {}).get("reason")
                                   for m, h in (seen.get("hostile") or {}).items()},
            "error": seen.get("error"),
        }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-src", required=True)
    args = ap.parse_args()
    build()
    rows = []
    with ControlPlane([crd.get_crd(), *crd.get_peering_crds()]) as cp:
        api = api_client_from_kubeconfig(cp.kubeconfig)
        for name, src in (("old", args.old_src), ("new", None)):
            rows.append(run(cp, api, name, src))
            print(json.dumps(rows[-1]), flush=True)
    out = {"bench": "hostile_tenant", "rows": rows, "memory_limit_mib": 512,
           "machine": machine(control_plane="v1.20.2 (local build)")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hostile-tenant.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "hostile-tenant.md").write_text(markdown(out))
    print(markdown(out))
    return 0


def markdown(out: dict) -> str:
    m = out["machine"]
    lines = [
        "# A hostile tenant: the other tenant's engine death, the operator's memory and CPU",
        "",
        "The failure-matrix row hostile-tenant with each operator tree in turn on one real "
        "kube-apiserver v1.20.2: one tenant's 6 pods (vLLM stand-ins) serve redirects to another "
        "address (2 pods), 100 MB /metrics pages streamed without a Content-Length (2) and "
        "headers drip-fed a line every 0.5 s (2), while another tenant's only replica has its "
        "engine die (the process exits 0 after 5 s). Peak RSS: the operator process's VmHWM "
        "(lifetime peak) at the end of the row; CPU: % of one core over the row (about a "
        "minute), and the peak over any 2 s sampled from its process metrics. "
        f"Chart memory limit: {out['memory_limit_mib']} MiB. "
        f"Machine: {m['cores']} shared cores ({m['cpu']}), load average {m['load_avg'][0]:.1f}; "
        f"commit {m['commit']}; kopf {m.get('kopf')}, kubernetes {m.get('kubernetes')}, "
        f"Python {m['python']}.",
        "",
        "| operator | other tenant serving again | its restarts | redirects followed | "
        "peak RSS | CPU mean | CPU peak (2 s) | hostile VLMDeployments' PodsReadable |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in out["rows"]:
        served = "never" if r["recovered_s"] is None else f"{r['recovered_s']:g} s"
        peak = r["cpu_percent_peak_sampled"]
        conditions = ", ".join(f"{k}: {v or 'no condition'}"
                               for k, v in r["hostile_conditions"].items()) or "-"
        lines.append(f"| {r['operator']} | {served} | {r['restarts'] or 0} | "
                     f"{r['redirects_followed']} | {r['peak_rss_mib']:g} MiB | "
                     f"{r['cpu_percent']:g} % | {'n/a' if peak is None else f'{peak:g} %'} | "
                     f"{conditions} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
