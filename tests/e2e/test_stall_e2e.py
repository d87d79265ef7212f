"""Hung engines (issue 12) on the real control plane with the vLLM stand-in: a frozen engine
(/health, /v1/models and /metrics still 200, completions never finish, metrics frozen) is
restarted after stallSeconds; an API server that answers nothing is reported apart; a busy or
idle engine is never taken for a stalled one."""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest
from kube_helpers import SESSION_NS_PREFIX, metric

from vlm_testbed.failure_matrix import Bed, complete, instance

FAST = {"engineStalled": {"stallSeconds": 12, "canaryTimeoutSeconds": 4}}


@pytest.fixture
def bed(api, cluster, operator):
    with Bed.new(api, cluster.kubeconfig, f"{SESSION_NS_PREFIX}{uuid.uuid4().hex[:6]}") as b:
        b.nodes(gpus_per_node=3)
        yield b


def delta(before, after, name, **labels):
    """How much a counter of the session operator grew (other tests' counts cancel out)."""
    return metric(after, name, **labels) - metric(before, name, **labels)


def last(bed, name="st"):
    return (bed.get(name).get("status") or {}).get("lastRemediation") or {}


def send(ip, n, max_tokens=4):
    """n completions in the background (a frozen engine never answers them)."""
    for _ in range(n):
        threading.Thread(target=complete, args=(ip, max_tokens), daemon=True).start()


@pytest.mark.parametrize("in_flight", [0, 3], ids=["idle", "requests-in-flight"])
def test_a_frozen_engine_is_restarted(bed, operator, in_flight):
    bed.create("st", replicas=1, health=FAST)
    (pod,) = bed.wait_ready("st", 1)
    before = operator.metrics()
    start = time.time()
    bed.fault(pod, {"fault": "stall"})
    send(pod.status.pod_ip, in_flight)
    seen = bed.follow("st", 1, {instance(pod)}, start)
    assert seen.recovered_s is not None
    assert seen.events["PodRestarted"] == 1
    why = last(bed)
    assert (why["signature"], why["action"], why["pod"]) == (
        "engine_stalled", "Restart", pod.metadata.name)
    # describe says which counters stood still, for how long, and what the canary got
    assert "vllm:generation_tokens_total" in why["reason"] and "unchanged for" in why["reason"]
    assert "vlm-operator-canary-" in why["reason"] and "no answer in 4 s" in why["reason"]
    after = operator.metrics()
    assert delta(before, after, "vlm_operator_detections_total", signature="engine_stalled") == 1
    assert delta(before, after, "vlm_operator_canaries_total", result="timeout") >= 1


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
    assert delta(before, after, "vlm_operator_detections_total", signature="api_unresponsive") == 1
    assert delta(before, after, "vlm_operator_detections_total", signature="engine_stalled") == 0


def test_busy_and_idle_engines_are_never_stalled(bed, operator):
    """False positives are the enemy: a queue far above capacity with slow service and
    multimodal-length prefills on one pod, nothing at all on the other, for several stall
    periods: canaries only for the idle one, all answered, no detection, no restart."""
    bed.create("st", replicas=2, health=FAST)
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
        assert delta(before, after, "vlm_operator_detections_total", signature=signature) == 0
    assert seen.touched == [] and not seen.events["PodRestarted"]
    # the idle pod's canaries came back (a canary that reached the busy pod just before its
    # load may time out behind the queue: its counters moved meanwhile, so no verdict)
    assert delta(before, after, "vlm_operator_canaries_total", result="answered") >= 3
