"""A real vLLM in a real container: vllm-cpu 0.32.0 in the project's vLLM image (built from
images/vllm/Dockerfile, unchanged, by buildah on a stand-in base holding the test bed's vllm-cpu
venv: realnode/imagebuild.py build_vllm_cpu_image), pulled by a real kubelet from the local
registry, its weights fetched from the local model hub (vlm_testbed/modelhub.py) into the
model cache claim (a hostPath PersistentVolume, made writable for the pod's user as an admin
prepares one), under the operator (a process of this checkout) with its default health policy
but minAvailable 0 (a Restart of the one pod is a restart, as in
tests/e2e/test_real_vllm.py) and a stall bound of 10 s (canary 4 s) so a hung engine is found
in seconds.

One VLMDeployment's life, each clock from the fault to the pod Ready and answering /health:
- cold: the VLMDeployment created -> its pod Ready: the image pulled (6 GB, uncompressed, from
  the local registry: the pull is its own column), the claim bound, vLLM's start with the
  weights downloaded into HF_HOME on the claim, the engine built, the startup probe;
- engine killed, in place: SIGKILL of the EngineCore -> the same pod Ready again and unfenced:
  vLLM's API server exits after engine death, the operator fences the pod on the log line, the
  kubelet restarts the container (no back-off before a first restart), vLLM starts with the
  weights on the claim;
- engine hung, in place: SIGSTOP of the EngineCore and its workers (the API server answers
  /health) -> the same pod Ready again: the operator's canary finds the stall, fences the pod
  and writes the restart request, the real kubelet's downwardAPI volume carries it into the
  container, the plugin in vLLM exits the server, the kubelet restarts it;
- engine killed, new pod (recovery NewPod): -> a new pod Ready: the operator deletes the pod on
  the log line, the ReplicaSet's new pod starts on the claim's node with the weights there.
Every start after the first fetches nothing (the hub counts the weight downloads).

Usage: sudo .venv/bin/python bench/real_vllm_container.py [--model qwen2-vl-1g]
  [--bytes-per-s 2.76e8]
Writes bench/results/real-vllm-container.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from kubernetes import client

from common import ROOT, machine
from vlm_operator.api import crd
from vlm_operator.api.names import FENCE
from vlm_testbed.controlplane import ControlPlane, build, ready_namespace
from vlm_testbed.failure_matrix.bed import healthy
from vlm_testbed.modelhub import ModelHub
from vlm_testbed.operator_process import OperatorProcess
from vlm_testbed.realnode import LocalRegistry, RealNode, build_images
from vlm_testbed.realnode.config import host_address
from vlm_testbed.realnode.imagebuild import build_vllm_cpu_image, vllm_image
from vlm_testbed.realnode.pods import container_status, is_ready, running_id, wait_for
from vlm_testbed.vllmsim.startup import StartCosts

sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from real_vllm import engine_core_pid, engine_pids, ensure_model, ensure_vllm_env

import real_vllm_load  # beside this script: the seeds' multimodal request body

RESULTS = ROOT / "bench" / "results"
ENV, VERSION, REPO = "vllm-cpu-0.32.0", "v0.32.0", "tiny/qwen2-vl"
CACHE_DIR = Path("/tmp/vlm-bench-model-cache")
START_S = 900  # a bound on each start here, never asserted
COLUMNS = (("cold_s", "cold: image pulled, weights downloaded"),
           ("killed_in_place_s", "engine killed -> in place (kubelet restart)"),
           ("hung_in_place_s", "engine hung -> in place (restart request)"),
           ("new_pod_warm_s", "engine killed -> new pod, warm (NewPod)"))


def vlmd(hub_url: str) -> dict:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "real"},
            "spec": {"model": REPO, "servedModelName": "tiny",
                     "image": vllm_image(f"{VERSION}-cpu"), "replicas": 1,
                     "modelCache": {"size": "4Gi"},
                     "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                     "vllm": {"maxModelLen": 1024, "dtype": "float32",
                              "extraArgs": ["--enforce-eager"],
                              "env": [{"name": "HF_ENDPOINT", "value": hub_url},
                                      {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}]},
                     "health": {"minAvailable": 0, "engineStalled": {
                         "stallSeconds": 10, "canaryTimeoutSeconds": 4}}}}


def model_cache_volume(v1: client.CoreV1Api) -> None:
    CACHE_DIR.mkdir(exist_ok=True)
    CACHE_DIR.chmod(0o1777)  # the kubelet applies no fsGroup to a hostPath
    v1.create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "bench-cache"},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"],
                 "hostPath": {"path": str(CACHE_DIR)},
                 "persistentVolumeReclaimPolicy": "Retain"}})


def serving(v1: client.CoreV1Api, ns: str, not_uid: str | None = None,
            restarts_above: int = -1) -> object | None:
    """A Ready, unfenced pod answering /health: another than not_uid, or the same restarted."""
    for p in v1.list_namespaced_pod(ns).items:
        st = container_status(p)
        if (is_ready(p) and FENCE not in (p.metadata.annotations or {})
                and p.metadata.uid != not_uid and st is not None
                and st.restart_count > restarts_above and healthy(p.status.pod_ip)):
            return p
    return None


def chat(pod: object) -> dict:
    request = urllib.request.Request(
        f"http://{pod.status.pod_ip}:8000/v1/chat/completions",
        headers={"Content-Type": "application/json"},
        data=json.dumps(real_vllm_load.request_body("mm", 0, 4)).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def server_pid(node: RealNode, pod: object) -> int:
    return wait_for("the server's process", lambda: node.task_pid(running_id(pod) or ""), 60)


def last_remediation(custom: client.CustomObjectsApi, ns: str) -> dict:
    body = custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, "real")
    return (body.get("status") or {}).get("lastRemediation") or {}


def in_place(v1, custom, ns: str, pod, fault) -> tuple[float, dict, object]:
    """Apply `fault` to the pod's engine; the seconds until the same pod serves again."""
    restarts = container_status(pod).restart_count
    t0 = time.monotonic()
    fault()
    again = wait_for("the same pod serving again", lambda: serving(
        v1, ns, restarts_above=restarts), START_S, 0.5)
    took = time.monotonic() - t0
    assert again.metadata.uid == pod.metadata.uid, "a new pod, not an in-place recovery"
    return took, last_remediation(custom, ns), again


def measure(kind: str, bytes_per_s: float) -> dict:
    build(node=True)
    venv = ensure_vllm_env(ENV)
    model = ensure_model(venv, kind)
    out: dict = {"model": kind, "hub_bytes_per_s": bytes_per_s,
                 "weights_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors"))}
    with LocalRegistry() as registry:
        build_images(registry)
        out["image_build_s"] = {k: round(v, 1) for k, v in
                                build_vllm_cpu_image(registry, venv, VERSION).items()}
        address = host_address()
        with ModelHub({REPO: model}, host=address, bytes_per_s=bytes_per_s) as hub, \
                ControlPlane([crd.get_crd()], pod_address=address) as cp, \
                RealNode(cp, registry=registry.address, gpus=2) as node, \
                OperatorProcess(cp.kubeconfig, "--standalone", "-n", "bench-rv-*"), \
                cp.api_client() as api:
            v1, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
            model_cache_volume(v1)
            ns = ready_namespace(api, f"bench-rv-{uuid.uuid4().hex[:6]}")
            t0 = time.monotonic()
            custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL,
                                                   vlmd(hub.url))
            pod = wait_for("the pod serving", lambda: serving(v1, ns), START_S, 0.5)
            out["cold_s"] = time.monotonic() - t0
            pulled = [e.message for e in v1.list_namespaced_event(ns).items
                      if e.reason == "Pulled"]
            out["pulled"] = pulled
            answer = chat(pod)
            out["chat_prompt_tokens"] = answer["usage"]["prompt_tokens"]
            fetches = {"cold": hub.weight_fetches(REPO)}
            print(f"cold {out['cold_s']:.1f} s; {pulled}", flush=True)

            def kill() -> None:
                os.kill(wait_for("the EngineCore", lambda: engine_core_pid(
                    server_pid(node, pod)), 60), signal.SIGKILL)

            out["killed_in_place_s"], out["killed_remediation"], pod = in_place(
                v1, custom, ns, pod, kill)
            fetches["killed_in_place"] = hub.weight_fetches(REPO)
            chat(pod)
            print(f"killed, in place {out['killed_in_place_s']:.1f} s", flush=True)

            def hang() -> None:
                for pid in wait_for("the engine's processes", lambda: engine_pids(
                        server_pid(node, pod)), 60):
                    os.kill(pid, signal.SIGSTOP)

            out["hung_in_place_s"], out["hung_remediation"], pod = in_place(
                v1, custom, ns, pod, hang)
            fetches["hung_in_place"] = hub.weight_fetches(REPO)
            chat(pod)
            print(f"hung, in place {out['hung_in_place_s']:.1f} s", flush=True)

            custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL,
                                                  "real", {"spec": {"health": {
                                                      "recovery": "NewPod"}}})
            time.sleep(5)  # the operator reads the new policy (no clock runs yet)
            t0 = time.monotonic()
            kill()
            new = wait_for("a new pod serving", lambda: serving(v1, ns, pod.metadata.uid),
                           START_S, 0.5)
            out["new_pod_warm_s"] = time.monotonic() - t0
            out["new_pod_remediation"] = last_remediation(custom, ns)
            out["same_node"] = new.spec.node_name == pod.spec.node_name
            fetches["new_pod"] = hub.weight_fetches(REPO)
            chat(new)
            out["weight_fetches"] = fetches
    return out


def markdown(r: dict) -> str:
    m = r["machine"]
    pulled = "; ".join(r["pulled"]) or "-"
    rows = [f"| {label} | {r[key]:.1f} |" for key, label in COLUMNS]
    return "\n".join([
        "# A real vLLM in a real container on a real node", "",
        f"vllm-cpu 0.32.0 in the project's vLLM image (images/vllm/Dockerfile on a stand-in "
        f"base holding vllm-cpu: 6 GB), model {r['model']} ({r['weights_bytes'] / 1e6:.1f} MB "
        f"of weights, float32, eager) from the local model hub at "
        f"{r['hub_bytes_per_s'] / 1e6:.0f} MB/s into a hostPath model cache claim; the real "
        f"kubelet v1.20.2 on containerd and runc; the operator as a process. Machine: "
        f"{m['cores']} shared cores ({m['cpu']}), load average {m['load_avg'][0]:.1f} at the "
        f"end, commit {m['commit']}, {m['time']}; the run took {r['took_s']} s. What each "
        "clock holds: bench/real_vllm_container.py. One trial.", "",
        "| start | seconds |", "| --- | --- |", *rows, "",
        f"- The kubelet's pull (its Pulled Event): {pulled}.",
        f"- Weight downloads from the hub after each start: {r['weight_fetches']}.",
        f"- The image build: {r['image_build_s']} (s).",
        f"- Engine killed: {r['killed_remediation'].get('reason', '-')}",
        f"- Engine hung: {r['hung_remediation'].get('reason', '-')}",
        f"- New pod: {r['new_pod_remediation'].get('reason', '-')} (on the claim's node: "
        f"{r['same_node']})", ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2-vl")
    ap.add_argument("--bytes-per-s", type=float, default=StartCosts().hub_bytes_per_s)
    args = ap.parse_args()
    t0 = time.monotonic()
    result = measure(args.model, args.bytes_per_s)
    result |= {"machine": machine(vllm="vllm-cpu 0.32.0"),
               "took_s": round(time.monotonic() - t0)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "real-vllm-container.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "real-vllm-container.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
