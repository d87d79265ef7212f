"""What pods that do not run cost the apiserver through the operator: its request rate
(vlm_operator_api_requests_total, by verb) with 100 Pending pods, for two operator trees side
by side in one run (by default: the `main` branch, whose log followers GET a pod that does not
run twice a second, and this checkout, whose followers wait for the pod's watch events).

A real kube-apiserver v1.20.2 with its controllers and no node: one VLMDeployment with
--pods replicas (its pods stay Pending: Unschedulable). Each tree's operator runs alone, as its
own process, on the same pods: after it has seen them and --settle seconds passed, its counter
is read over --window seconds. The trees take turns (--rounds times) so a drift of the machine
shows in both. kopf's own requests (its watches) are not in the counter; they are the same for
both trees.

Usage: .venv/bin/python bench/pending_pods.py [--before main] [--pods 100] [--window 60]
       [--settle 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from common import ROOT, machine
from vlm_operator.api import crd
from vlm_operator.desired import children
from vlm_testbed.controlplane import (
    K8S_VERSION,
    ControlPlane,
    api_client_from_kubeconfig,
    ready_namespace,
)
from vlm_testbed.operator_process import OperatorProcess

RESULTS = Path(__file__).resolve().parent / "results"
NAMESPACE = "bench-pending"
METRIC = "vlm_operator_api_requests_total"


def tree_of(ref: str, into: Path) -> Path:
    """The operator package of git ref `ref`, extracted under `into`."""
    archive = subprocess.run(["git", "archive", ref, "operator"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "operator"


def requests_by_verb(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == METRIC:
                verb = sample.labels["verb"]
                out[verb] = out.get(verb, 0.0) + sample.value
    return out


def cached_pods(text: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "vlm_operator_cache_objects"
               and sample.labels.get("cache", "").startswith("managed-pods"))


def measure(kubeconfig: Path, operator_dir: Path, pods: int, settle: float,
            window: float) -> dict:
    """One operator process of this tree on the Pending pods: requests/s over the window."""
    env = {"PYTHONPATH": str(operator_dir)}
    with OperatorProcess(kubeconfig, "--standalone", "-n", NAMESPACE, env=env) as op:
        deadline = time.monotonic() + 120
        while cached_pods(op.metrics()) < pods and time.monotonic() < deadline:
            time.sleep(1)  # the operator's watches have delivered the pods
        time.sleep(settle)  # kopf's pod events (the followers start on them) and their status
        before, start = requests_by_verb(op.metrics()), time.monotonic()
        time.sleep(window)
        after, elapsed = requests_by_verb(op.metrics()), time.monotonic() - start
    per_s = {verb: round((after[verb] - before.get(verb, 0.0)) / elapsed, 2) for verb in after}
    return {"requests_per_s": round(sum(per_s.values()), 2), "by_verb": per_s,
            "window_s": round(elapsed, 1), "pods": pods}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="main", help="git ref of the tree to compare with")
    ap.add_argument("--pods", type=int, default=100)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--settle", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    before_commit = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT,
                                   capture_output=True, text=True, check=True).stdout.strip()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp, \
            ControlPlane([crd.get_crd(), *crd.get_peering_crds()]) as cp:
        trees = {"before": tree_of(args.before, Path(tmp)), "after": ROOT / "operator"}
        api = api_client_from_kubeconfig(cp.kubeconfig)
        ready_namespace(api, NAMESPACE)
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, {
                "apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "pending"},
                "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", "replicas": args.pods,
                         "image": "vllm/vllm-openai:v0.20.2"}})
        core = client.CoreV1Api(api)
        for _ in range(args.rounds):
            for name in ("before", "after"):
                runs[name].append(measure(cp.kubeconfig, trees[name], args.pods, args.settle,
                                          args.window))
                pending = core.list_namespaced_pod(
                    NAMESPACE, label_selector=children.get_selector("pending")).items
                assert len(pending) == args.pods and all(
                    p.status.phase == "Pending" for p in pending), "the pods did not stay Pending"
                print(name, json.dumps(runs[name][-1]), flush=True)
    out = {"bench": "pending_pods", "pods": args.pods, "window_s": args.window,
           "settle_s": args.settle, "rounds": args.rounds,
           "before": {"ref": args.before, "commit": before_commit, "runs": runs["before"]},
           "after": {"ref": "this checkout", "runs": runs["after"]},
           "machine": machine(control_plane=f"{K8S_VERSION} (local build)")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pending-pods.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "pending-pods.md").write_text(markdown(out))
    print(markdown(out))


def markdown(out: dict) -> str:
    m = out["machine"]

    def cell(run: dict) -> str:
        verbs = ", ".join(f"{v} {n:g}" for v, n in sorted(run["by_verb"].items()) if n)
        return f"{run['requests_per_s']:g}/s ({verbs or 'none'})"

    lines = [
        f"# Operator API requests with {out['pods']} Pending pods",
        "",
        f"One VLMDeployment with {out['pods']} replicas and no node to run them (every pod "
        "Pending, Unschedulable), on a real kube-apiserver "
        f"{m['control_plane']}; each tree's operator runs alone on the same pods and its "
        f"`vlm_operator_api_requests_total` is read over {out['window_s']:g} s, "
        f"{out['settle_s']:g} s after it saw them (kopf's own watches not included; the same "
        f"for both). Trees take turns, {out['rounds']} rounds. Before: "
        f"`{out['before']['ref']}` at {out['before']['commit']}; after: this checkout at "
        f"{m['commit']}. Machine: {m['cpu']}, {m['cores']} cores shared with other work, "
        f"Python {m['python']}, kopf {m.get('kopf')}, kubernetes client {m.get('kubernetes')}, "
        f"{m['time']}.",
        "",
        "| round | before (requests/s, by verb) | after (requests/s, by verb) |",
        "| --- | --- | --- |",
    ]
    for i, (a, b) in enumerate(zip(out["before"]["runs"], out["after"]["runs"], strict=True)):
        lines.append(f"| {i + 1} | {cell(a)} | {cell(b)} |")
    lines += ["", "Before, each Pending pod's log follower GETs the pod twice a second; after, "
              "it waits for the pod's watch events (one GET only after 10 minutes without any)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
