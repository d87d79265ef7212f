"""Recovery on a real node: the time from an engine death to the pod serving again, with the
real kubelet doing the restart, the real downwardAPI volume carrying the operator's restart
request, and the project's vLLM image (built from images/vllm/Dockerfile by buildah, pulled from
the local registry) running the vLLM stand-in at the published start figures (cold 110 s, 52 s
with the weights, 48 s with the compile cache too; vlm_testbed/vllmsim/startup.py).

For spec.health.recovery InPlace and NewPod, one VLMDeployment each (default spec otherwise:
1 replica, minAvailable 1, caches on emptyDirs as without spec.modelCache), the engine dies
twice in a row:
- exit0: EngineDeadError in the log, the process exits 5 s later with code 0 (vLLM's API
  server);
- alive: EngineDeadError, the process stays up (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH): in place the
  operator asks the plugin to exit through the downwardAPI file.
Clock: from the fault's request to a Ready pod of the VLMDeployment answering /health (the same
pod restarted in place, or a new one); the fence is the FENCE annotation on the pod.

Usage: sudo .venv/bin/python bench/real_node_recovery.py [--trials 1]
Writes bench/results/real-node-recovery.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path

from kubernetes import client

from common import machine
from vlm_operator.api import crd
from vlm_operator.api.names import FENCE
from vlm_testbed.controlplane import ControlPlane, build, ready_namespace
from vlm_testbed.failure_matrix.bed import healthy, post
from vlm_testbed.operator_process import OperatorProcess
from vlm_testbed.realnode import LocalRegistry, RealNode, build_images
from vlm_testbed.realnode.pods import container_status, is_ready, wait_for

RESULTS = Path(__file__).parent / "results"
MODES = ("InPlace", "NewPod")
FAULTS = {"exit0": {"fault": "engine_dead", "exit_code": 0, "exit_delay": 5},
          "alive": {"fault": "engine_dead"}}
KEEP_ALIVE = {"exit0": False, "alive": True}


def serving(v1, ns: str):
    for p in v1.list_namespaced_pod(ns).items:
        if is_ready(p) and FENCE not in (p.metadata.annotations or {}) \
                and healthy(p.status.pod_ip):
            return p
    return None


def trial(v1, ns: str, fault: str) -> dict:
    pod = wait_for("a serving pod", lambda: serving(v1, ns), 600, 0.5)
    restarts = container_status(pod).restart_count
    t0 = time.monotonic()
    post(pod.status.pod_ip, "/sim/fault", FAULTS[fault])
    fenced = None
    while True:
        p = next((q for q in v1.list_namespaced_pod(ns).items
                  if q.metadata.uid == pod.metadata.uid), None)
        if fenced is None and p is not None and FENCE in (p.metadata.annotations or {}):
            fenced = time.monotonic() - t0
        again = serving(v1, ns)
        if again is not None and (again.metadata.uid != pod.metadata.uid
                                  or container_status(again).restart_count > restarts):
            break
        if time.monotonic() - t0 > 600:
            raise TimeoutError(f"{ns}: not serving again 600 s after {fault}")
        time.sleep(0.25)
    return {"fault": fault, "serving_again_s": round(time.monotonic() - t0, 1),
            "fenced_s": None if fenced is None else round(fenced, 1),
            "in_place": again.metadata.uid == pod.metadata.uid,
            "restarts": container_status(again).restart_count - restarts}


def measure(trials: int) -> list[dict]:
    build(node=True)
    out = []
    with LocalRegistry() as registry:
        build_images(registry)
        with ControlPlane([crd.get_crd()]) as cp, \
                RealNode(cp, registry=registry.address, gpus=2) as _node, \
                OperatorProcess(cp.kubeconfig, "--standalone", "-n", "bench-rn-*"), \
                cp.api_client() as api:
            v1 = client.CoreV1Api(api)
            for mode in MODES:
                for fault in FAULTS:
                    ns = ready_namespace(api, f"bench-rn-{uuid.uuid4().hex[:6]}")
                    env = [{"name": "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "value": "1"}] \
                        if KEEP_ALIVE[fault] else []
                    client.CustomObjectsApi(api).create_namespaced_custom_object(
                        crd.GROUP, crd.VERSION, ns, crd.PLURAL, {
                            "apiVersion": crd.API_VERSION, "kind": crd.KIND,
                            "metadata": {"name": "m"},
                            "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct",
                                     "health": {"recovery": mode},
                                     "resources": {"requests": {"cpu": "100m",
                                                                "memory": "256Mi"}},
                                     "vllm": {"env": env}}})
                    for i in range(trials):
                        r = {"mode": mode, "trial": i + 1, **trial(v1, ns, fault)}
                        print(r, flush=True)
                        out.append(r)
                    v1.delete_namespace(ns)
    return out


def markdown(runs: list[dict], info: dict) -> str:
    m = info["machine"]
    rows = []
    for mode in MODES:
        for fault in FAULTS:
            rs = [r for r in runs if r["mode"] == mode and r["fault"] == fault]
            med = statistics.median(r["serving_again_s"] for r in rs)
            fences = [r["fenced_s"] for r in rs if r["fenced_s"] is not None]
            rows.append(f"| {mode} | {fault} | {med:.1f} s ({len(rs)} trials: "
                        f"{', '.join(str(r['serving_again_s']) for r in rs)}) | "
                        f"{f'{statistics.median(fences):.1f} s' if fences else '-'} | "
                        f"{'same pod' if all(r['in_place'] for r in rs) else 'new pod'}, "
                        f"restarts {', '.join(str(r['restarts']) for r in rs)} |")
    return "\n".join([
        "# Recovery on a real node", "",
        f"Kubernetes v1.20.2 (kubelet and control plane from Debian's source), containerd and "
        f"runc from Debian bookworm, the operator as its own process. Machine: {m['cpu']}, "
        f"{m['cores']} cores, load {m['load_avg'][0]:.1f} at the end, {m['platform']}, commit "
        f"{m['commit']}, {m['time']}; the run took {info['took_s']} s. Produced by "
        "`bench/real_node_recovery.py` (what the clock holds: its docstring); raw figures in "
        "real-node-recovery.json.", "",
        "| recovery | engine death | fault -> serving again (median) | fault -> fenced | "
        "how |", "| --- | --- | --- | --- | --- |", *rows, ""])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=1)
    args = ap.parse_args()
    t0 = time.monotonic()
    runs = measure(args.trials)
    info = {"machine": machine(), "took_s": round(time.monotonic() - t0)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "real-node-recovery.json").write_text(json.dumps(
        {"info": info, "runs": runs}, indent=1) + "\n")
    (RESULTS / "real-node-recovery.md").write_text(markdown(runs, info))
    print(markdown(runs, info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
