"""Hung engines on the real control plane with the vLLM stand-in: a frozen engine (/health,
/v1/models and /metrics still 200, completions never finish, metrics frozen) is restarted after
stallSeconds, found by the plugin's engine heartbeat where the pod logs one and by the canary
where it does not; one long step within its bound is work, not a stall; a pod where no detector
can work (no heartbeat, an API key refusing the canary) says so; an API server that answers
nothing is reported apart; a busy or idle engine is never taken for a stalled one."""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest
from kube_helpers import SESSION_NS_PREFIX, metric

from vlm_testbed.failure_matrix import (
    API_KEY_ENV,
    LONG_PROMPT_TOKENS,
    Bed,
    complete,
    instance,
    prompt_done,
    prompt_tokens,
)

# NewPod: these tests see the restart of a hung engine as its pod's deletion (the default,
# in-place recovery with the restart request, is tested in test_recovery_e2e.py)
FAST = {"engineStalled": {"stallSeconds": 12, "canaryTimeoutSeconds": 4}, "recovery": "NewPod"}
NO_PLUGIN = [{"name": "VLM_SIM_PATCHED", "value": "0"}]  # an image without the plugin


@pytest.fixture
def bed(api, cluster, operator):
    with Bed.new(api, cluster.kubeconfig, f"{SESSION_NS_PREFIX}{uuid.uuid4().hex[:6]}") as b:
        b.watcher = operator
        b.nodes(gpus_per_node=3)
        yield b


def delta(ns, before, after, name, **labels):
    """How much a counter of the session operator grew for the VLMDeployments of namespace ns
    (other tests' series cancel out, or vanish when their VLMDeployments are deleted)."""
    return (metric(after, name, vlmdeployment_namespace=ns, **labels)
            - metric(before, name, vlmdeployment_namespace=ns, **labels))


def last(bed, name="st"):
    return (bed.get(name).get("status") or {}).get("lastRemediation") or {}


def send(ip, n, max_tokens=4):
    """n completions in the background (a frozen engine never answers them)."""
    for _ in range(n):
        threading.Thread(target=complete, args=(ip, max_tokens), daemon=True).start()


FROZEN = {  # detector, what the fault does, requests in flight, what describe says
    "canary-idle": ("canary", {"fault": "stall"}, 0, "unchanged for"),
    "canary-requests-in-flight": ("canary", {"fault": "stall"}, 3, "unchanged for"),
    # the engine wedged inside a step (a kernel, a collective): its heartbeat says so
    "heartbeat-wedged-step": ("heartbeat", {"fault": "stall"}, 3,
                              "tokens scheduled) has run for"),
    # the engine process stopped (SIGSTOP, the GIL held): its heartbeat stops
    "heartbeat-stopped": ("heartbeat", {"fault": "stall", "heartbeat": "stops"}, 0,
                          "the engine heartbeat of EngineCore stopped"),
}


@pytest.mark.parametrize("case", FROZEN)
def test_a_frozen_engine_is_restarted(bed, operator, case):
    how, fault, in_flight, said = FROZEN[case]
    bed.create("st", replicas=1, health=FAST, env=NO_PLUGIN if how == "canary" else None)
    (pod,) = bed.wait_ready("st", 1)
    if how == "heartbeat":
        bed.wait_heartbeat("st")
    before = operator.metrics()
    start = time.time()
    bed.fault(pod, fault)
    send(pod.status.pod_ip, in_flight)
    seen = bed.follow("st", 1, {instance(pod)}, start)
    assert seen.recovered_s is not None
    assert seen.events["PodRestarted"] == 1
    why = last(bed)
    assert (why["signature"], why["action"], why["pod"]) == (
        "engine_stalled", "Restart", pod.metadata.name)
    assert said in why["reason"], why["reason"]
    after = operator.metrics()
    assert delta(bed.ns, before, after,
                 "vlm_operator_detections_total", signature="engine_stalled") == 1
    if how == "canary":
        # describe says which counters stood still, for how long, and what the canary got
        assert "vllm:generation_tokens_total" in why["reason"]
        assert "vlm-operator-canary-" in why["reason"] and "no answer in 4 s" in why["reason"]
        assert delta(bed.ns, before, after, "vlm_operator_canaries_total", result="timeout") >= 1
    else:  # the heartbeat decided: no canary was needed
        assert delta(bed.ns, before, after, "vlm_operator_canaries_total") == 0


def test_one_long_step_within_its_bound_is_not_restarted(bed, operator):
    """Chunked prefill off: one step computes a 40,960-token prompt for 2 x stallSeconds, no
    step completes and no counter moves, exactly like a wedged kernel from outside. Its
    heartbeat reports the step and its tokens: within 12 + 40960 / 50 s, it is work."""
    bed.create("st", replicas=1, health=FAST)
    (pod,) = bed.wait_ready("st", 1)
    bed.wait_heartbeat("st")
    ip, tokens_before = pod.status.pod_ip, prompt_tokens(pod.status.pod_ip)
    before = operator.metrics()
    start = time.time()
    bed.fault(pod, {"fault": "long_step", "seconds": 24, "tokens": LONG_PROMPT_TOKENS})
    seen = bed.follow("st", 1, set(), start, timeout=60, settle=3,
                      until=lambda: prompt_done(ip, tokens_before) is not False)
    assert not seen.events["PodRestarted"] and seen.touched == [], seen.events
    assert prompt_done(ip, tokens_before)  # it completed
    after = operator.metrics()
    assert delta(bed.ns, before, after,
                 "vlm_operator_detections_total", signature="engine_stalled") == 0
    assert delta(bed.ns, before, after, "vlm_operator_detections_total",
                 signature="engine_heartbeat") >= 4  # read all along
    assert delta(bed.ns, before, after, "vlm_operator_canaries_total") == 0


def test_no_heartbeat_behind_an_api_key_reports_the_detector_off(bed, operator):
    """An image without the plugin and VLLM_API_KEY from a Secret: the canary gets 401 and
    the operator (which reads no Secret) cannot tell a hung engine from an idle one. It says
    so, once, and stops sending canaries there."""
    bed.secret("api-key", {"key": "sk-test-secret"})
    before = operator.metrics()
    bed.create("st", replicas=1, health=FAST, env=[*NO_PLUGIN, *API_KEY_ENV])
    (pod,) = bed.wait_ready("st", 1)
    off = bed.wait("StallDetection=False", lambda: (
        c := bed.condition("st", "StallDetection")).get("status") == "False" and c, timeout=60)
    assert off["reason"] == "DetectorUnavailable"
    assert f"cannot be detected on {pod.metadata.name} (no engine heartbeat in its log, and " \
           "the canary was refused with HTTP 401/403" in off["message"]
    assert bed.wait("StallDetectionOff event", lambda: bed.events("st")["StallDetectionOff"])
    seen = bed.follow("st", 1, set(), time.time(), until=lambda: False, timeout=20, settle=0)
    assert seen.events["StallDetectionOff"] == 1 and not seen.events["PodRestarted"]
    after = operator.metrics()
    assert delta(bed.ns, before, after, "vlm_operator_canaries_total", result="unauthorized") == 1
    assert delta(bed.ns, before, after, "vlm_operator_canaries_total", result="timeout") == 0


def test_an_api_server_that_answers_nothing_is_reported_apart(bed, operator):
    bed.create("st", replicas=1, health=FAST)
    (pod,) = bed.wait_ready("st", 1)
    before = operator.metrics()
    start = time.time()
    bed.fault(pod, {"fault": "hang"})  # every HTTP call hangs, /health too
    seen = bed.follow("st", 1, {instance(pod)}, start)
    assert seen.recovered_s is not None and seen.events["PodRestarted"] == 1
    why = last(bed)
    assert why["signature"] == "api_unresponsive"
    # at least `timeouts` checks (3): acted on once the kubelet agreed (its probes fail too)
    checks = re.search(r"/metrics and /health both timed out in (\d+) checks", why["reason"])
    assert checks and int(checks.group(1)) >= 3, why["reason"]
    assert "the kubelet's readiness probe fails too (Ready=False)" in why["reason"]
    after = operator.metrics()
    assert delta(bed.ns, before, after,
                 "vlm_operator_detections_total", signature="api_unresponsive") == 1
    assert delta(bed.ns, before, after,
                 "vlm_operator_detections_total", signature="engine_stalled") == 0


def test_busy_and_idle_engines_are_never_stalled(bed, operator):
    """False positives are the enemy: a queue far above capacity with slow service and
    multimodal-length prefills on one pod, nothing at all on the other, for several stall
    periods: canaries only for the idle one, all answered, no detection, no restart."""
    bed.create("st", replicas=2, health=FAST, env=NO_PLUGIN)  # the canary's case
    busy, _idle = bed.wait_ready("st", 2)
    before = operator.metrics()
    bed.fault(busy, {"fault": "load", "max_running": 2, "service_seconds": 3,
                     "mm_seconds": 2})
    stop = time.time() + 40
    while time.time() < stop:
        send(busy.status.pod_ip, 2, max_tokens=50)
        time.sleep(1)
    seen = bed.follow("st", 2, set(), time.time(), until=lambda: False, timeout=5, settle=0)
    after = operator.metrics()
    for signature in ("engine_stalled", "api_unresponsive"):
        assert delta(bed.ns, before, after,
                     "vlm_operator_detections_total", signature=signature) == 0
    assert seen.touched == [] and not seen.events["PodRestarted"]
    # the idle pod's canaries came back (a canary that reached the busy pod just before its
    # load may time out behind the queue: its counters moved meanwhile, so no verdict)
    assert delta(bed.ns, before, after, "vlm_operator_canaries_total", result="answered") >= 3
