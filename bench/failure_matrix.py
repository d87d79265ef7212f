"""Time from fault to serving again for every failure mode of vlm_testbed.failure_matrix,
with the operator remediating and, side by side, with remediation off (every signature's
action Ignore: what the kubelet's probes alone do with the same pod spec).

Real kube-apiserver v1.20.2 and controllers, the operator as its own process, pods run by the
node simulator with the vLLM stand-in. A run that is not serving again within the limit counts
as "not within <limit> s" (never dropped).

Usage: .venv/bin/python bench/failure_matrix.py [--trials 1] [--limit 150] [--rows id,id]
       .venv/bin/python bench/failure_matrix.py --markdown results/failure-matrix.json
       .venv/bin/python bench/failure_matrix.py --merge results/failure-matrix-partial.json
(--rows writes results/failure-matrix-partial.*; --merge folds such runs into
results/failure-matrix.*, each row keeping the commit, trials and load of the run that measured
it)
Real-cost starts: --scale 1 runs the stand-in at the published start figures (cold 110 s, 48 s
warm), --recovery InPlace sets spec.health.recovery on the operator's side, --no-probes leaves
the probes-only side out, --out NAME names the results (and the whole a --merge folds into).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from common import machine
from vlm_operator.api import crd
from vlm_testbed.controlplane import ControlPlane, api_client_from_kubeconfig, build
from vlm_testbed.failure_matrix import IGNORE_ALL, ROWS, Bed
from vlm_testbed.failure_matrix.bed import READY_TIMEOUT_S
from vlm_testbed.firewall import OPERATOR_GID
from vlm_testbed.operator_process import OperatorProcess
from vlm_testbed.vllmsim.startup import StartCosts, phases

RESULTS = Path(__file__).parent / "results"

PREFIX = "bench-fm-"


def start_s(scale: float, *, cached: bool) -> float:
    """The stand-in's start at `scale`: cold, or warm (weights and compile cache there)."""
    return sum(phases(StartCosts(scale=scale), weights_present=cached, compiled=cached).values())


def run_row(api, kubeconfig, row, health, limit: float, operator=None,
            scale: float | None = None) -> dict:
    """One run of a row; scale: the stand-in's start figures (None: the test bed's instant
    starts), with a wait for pods that covers a cold start at that scale."""
    prefix = "bench-solo-" if row.own_operator else PREFIX
    options = {} if scale is None else {
        "node_options": {"vllm_time_scale": scale},
        "ready_timeout_s": max(READY_TIMEOUT_S, 3 * start_s(scale, cached=False) + 60)}
    with Bed.new(api, kubeconfig, f"{prefix}{uuid.uuid4().hex[:6]}", **options) as bed:
        bed.limit_s = limit
        bed.watcher = None if row.own_operator else operator
        started = time.monotonic()
        try:
            seen = row.run(bed, health).as_dict()
        except AssertionError as exc:  # a setup step timed out: record it, go on
            seen = {"recovered_s": None, "error": str(exc)[:300]}
        seen["wall_s"] = round(time.monotonic() - started, 1)
        return seen


def summary(runs: list[dict]) -> str:
    times = [r["recovered_s"] for r in runs if r.get("recovered_s") is not None]
    missed = len(runs) - len(times)
    if not times:
        return "never"
    text = f"{statistics.median(times):.1f} s" if len(times) > 1 else f"{times[0]:.1f} s"
    return text + (f" ({missed} of {len(runs)} never)" if missed else "")


def load_and_drain(runs: list[dict]) -> str:
    """Requests failed of those started under the row's steady load (every trial), and how
    long `kubectl drain` took (median), where the row has them."""
    parts = []
    loads = [r["load"] for r in runs if r.get("load")]
    if loads:
        parts.append(f"{sum(x['failed'] for x in loads)} of "
                     f"{sum(x['started'] for x in loads)}")
    drains = [r["drain_s"] for r in runs if r.get("drain_s") is not None]
    if drains:
        parts.append(f"drain {statistics.median(drains):.1f} s")
    return ", ".join(parts) or "-"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--limit", type=float, default=150.0,
                    help="seconds a run may take to serve again")
    ap.add_argument("--rows", default="", help="comma-separated row ids (default: all)")
    ap.add_argument("--markdown", type=Path, help="only write the Markdown of this JSON")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="PARTIAL",
                    help="fold these partial runs' rows into results/<out>.json")
    ap.add_argument("--scale", type=float, default=None,
                    help="the stand-in's start figures (1: the published ones)")
    ap.add_argument("--recovery", choices=("NewPod", "InPlace"), default=None,
                    help="spec.health.recovery on the operator's side")
    ap.add_argument("--no-probes", action="store_true", help="leave the probes-only side out")
    ap.add_argument("--out", default="failure-matrix")
    args = ap.parse_args()
    if args.merge:
        whole = RESULTS / f"{args.out}.json"
        partials = [json.loads(path.read_text()) for path in args.merge]
        # a whole not there yet starts from the first partial's settings, without rows
        out = merged(json.loads(whole.read_text()) if whole.exists() else
                     {**partials[0], "rows": []}, partials)
        whole.write_text(json.dumps(out, indent=2) + "\n")
        whole.with_suffix(".md").write_text(markdown(out))
        return 0
    if args.markdown:
        out = json.loads(args.markdown.read_text())
        args.markdown.with_suffix(".md").write_text(markdown(out))
        return 0
    rows = [r for r in ROWS if not args.rows or r.id in args.rows.split(",")]
    started_at = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    health = {"recovery": args.recovery} if args.recovery else None
    build()
    results = []
    with ControlPlane([crd.get_crd(), *crd.get_peering_crds()]) as cp:
        api = api_client_from_kubeconfig(cp.kubeconfig)
        with OperatorProcess(cp.kubeconfig, "--standalone", "-n", f"{PREFIX}*",
                             gid=OPERATOR_GID) as operator:
            for row in rows:
                entry = {"id": row.id, "what": row.what, "must_not": row.must_not,
                         "operator": [], "probes_only": []}
                for trial in range(args.trials):
                    entry["operator"].append(run_row(api, cp.kubeconfig, row, health, args.limit,
                                                     operator, args.scale))
                    if row.probes and not args.no_probes:
                        entry["probes_only"].append(run_row(
                            api, cp.kubeconfig, row, IGNORE_ALL, args.limit, operator, args.scale))
                    print(row.id, trial, json.dumps(entry["operator"][-1]),
                          json.dumps(entry["probes_only"][-1:]), flush=True)
                results.append(entry)
    out = {"bench": "failure_matrix", "trials": args.trials, "limit_s": args.limit,
           "scale": args.scale, "recovery": args.recovery, "probes": not args.no_probes,
           "rows": results, "started_at_commit": started_at,
           "machine": machine(control_plane="v1.20.2 (local build)")}
    RESULTS.mkdir(exist_ok=True)
    name = args.out if not args.rows else f"{args.out}-partial"
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(out))
    print(markdown(out))
    return 0


def merged(whole: dict, partials: list[dict]) -> dict:
    """`whole` with each partial run's rows put in place of the row of the same id (or added,
    in ROWS order), each noting the run that measured it."""
    rows = {entry["id"]: entry for entry in whole["rows"]}
    for part in partials:
        run = {"commit": part.get("started_at_commit"), "trials": part["trials"],
               "limit_s": part["limit_s"], "load_avg": part["machine"]["load_avg"][0]}
        for entry in part["rows"]:
            rows[entry["id"]] = {**entry, "run": run}
    order = [r.id for r in ROWS]
    return {**whole, "rows": sorted(rows.values(), key=lambda e: (
        order.index(e["id"]) if e["id"] in order else len(order), e["id"]))}


def markdown(out: dict) -> str:
    m = out["machine"]
    lines = [
        "# Failure-mode matrix: fault -> serving again",
        "",
        f"{out['trials']} trial(s) per row and mode (median shown); limit {out['limit_s']:g} s. "
        "Real kube-apiserver v1.20.2, operator as a process, pods = vllmsim on the node "
        "simulator, the default spec (minAvailable 1, maxRestartsPerHour 6) unless the row says "
        "otherwise. \"Probes only\": the same pod spec with every signature's action Ignore, so "
        "only the kubelet's startup/readiness/liveness probes act (liveness: /health every 10 s, "
        "6 failures). Serving again: spec.replicas pods ready, /health 200, none of them a "
        "container the fault hit; it includes the new pod's start ("
        + (f"the stand-in's start figures scaled by {out['scale']:g}: cold "
           f"{start_s(out['scale'], cached=False):.0f} s, "
           f"warm {start_s(out['scale'], cached=True):.0f} s; "
           "scheduling, the 5 s readiness period"
           if out.get("scale") else "about 10 s here: scheduling, the stand-in's start, the 5 s "
           "readiness period")
        + "), the operator's own action takes about 0.1 s "
        "(bench/results/remediation-latency.md). "
        + (f"spec.health.recovery {out['recovery']} on the operator's side. "
           if out.get("recovery") else "")
        + ("The probes-only side was not run. " if out.get("probes") is False else "")
        +
        f"Machine: {m['cores']} shared cores, load average {m['load_avg'][0]:.1f} at the end; "
        f"started at commit {out.get('started_at_commit', '?')} (rows with operators of their "
        f"own start them from the tree of their time), ended at {m['commit']}.",
        "",
        "| row | failure | operator | probes only | fewest ready | operator Events | "
        "requests failed, drain |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in out["rows"]:
        runs = entry["operator"]
        events = runs[-1].get("events") or {}
        shown = ", ".join(f"{k} {v}" for k, v in sorted(events.items()) if k in (
            "PodRestarted", "PodReplacing", "PodReplaced", "RemediationSkipped",
            "ScaleDownStarted", "ScaledDown", "DrainTimedOut", "ReplaceFailed",
            "ReplaceAbandoned", "NodeDrainHeld", "NodeDrainWaitExpired", "PodFenced",
            "PodRestartRequested", "PodRecoveredInPlace", "NodeSuspect"))
        probes = summary(entry["probes_only"]) if entry["probes_only"] else "n/a"
        lowest = min((r.get("lowest_ready", 0) for r in runs), default=0)
        operator = f"n/a: {entry['must_not']}" if entry.get("must_not") else summary(runs)
        lines.append(f"| {entry['id']} | {entry['what']} | {operator} | {probes} | {lowest} | "
                     f"{shown or '-'} | {load_and_drain(runs)} |")
    lines += ["", "Rows marked n/a are about what must not happen; their outcome is asserted "
              "in tests/e2e/test_failure_matrix.py and recorded in the JSON. \"never\": not "
              f"serving again within {out['limit_s']:g} s (a retry storm fails no probe)."]
    runs: dict[tuple, list[str]] = {}
    for entry in out["rows"]:
        if entry.get("run"):
            run = entry["run"]
            runs.setdefault((run["commit"], run["trials"], run["limit_s"], run["load_avg"]),
                            []).append(entry["id"])
    for (commit, trials, limit, load), ids in runs.items():
        lines.append(f"\n{', '.join(ids)}: measured in a run of their own at commit {commit}, "
                     f"{trials} trial(s), limit {limit:g} s, load average {load:.1f} at its end.")
    for row_id, rerun in (out.get("rerun") or {}).items():
        lines.append(f"\n{row_id} was rerun alone at commit {rerun['started_at_commit']} "
                     f"(load average {rerun['machine']['load_avg'][0]:.1f}): {rerun['why']}.")
    usage = [(entry["id"], mode, run) for entry in out["rows"]
             for mode in ("operator", "probes_only") for run in entry[mode]
             if run.get("peak_rss_mib") is not None]
    if usage:
        lines += ["", "The operator's own process during the rows that record it (from its "
                  "process metrics, sampled every 0.5 s; CPU in % of one core, the peak over "
                  "any 2 s):", "", "| row | mode | peak RSS | CPU mean | CPU peak | "
                  "requests to the redirects' target |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {row_id} | {mode.replace('_', ' ')} | {run['peak_rss_mib']:g} MiB | "
                  f"{run['cpu_percent']:g} % | {run['cpu_percent_peak']:g} % | "
                  f"{len(run.get('redirect_target_requests') or [])} |"
                  for row_id, mode, run in usage]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
