"""Log following through the real kubelet's log rotation. The kubelet renames a container's log
file once it passes --container-log-max-size (5 MiB on the test bed's nodes, checked every 10 s)
and the runtime writes a new one. A follow stream that was behind when that happened (a flood of
lines, read within the operator's log budget) is left at the renamed file's end by the 1.20
kubelet: no byte more, no end, while the container logs on (kubectl logs -f, keeping up, carried
on). Unless the follower holds such a stream to what the pod's engine heartbeat promises
(logs/reconnect.py), an engine death logged after the rotation is read only once the kubelet's
liveness probe restarted the container a minute later, and then as the old container's: never
acted on. The node simulator serves logs from one file that never rotates.

The flood is far over the pod's log budget (logs/budget.py): lines over it are skipped unread,
an engine-death line among them too. So the engine death is logged only once the operator has
read a line logged after the flood (its resume mark, written every second by this test's own
operator, says how far it read): on a stream left at the renamed file that takes the re-open,
and the death is then read within the budget wherever the kubelet's rotation fell in the
flood (its check runs every 10 s: mid-flood, the new file starts with flood lines)."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from vlm_operator.api import crd
from vlm_operator.desired import children
from vlm_operator.logs import marks
from vlm_testbed.controlplane import ready_namespace
from vlm_testbed.operator_process import OperatorProcess
from vlm_testbed.realnode.pods import condition, is_ready, vlmd_status, wait_for

FLOOD_LINES_S, FLOOD_S = 40_000, 3  # some 120,000 lines of ~130 bytes: past 5 MiB at once


def metric(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def post_fault(ip: str, fault: dict) -> None:
    req = urllib.request.Request(f"http://{ip}:{children.PORT}/sim/fault",
                                 data=json.dumps(fault).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def read_up_to(pod: Any) -> float:
    """The log time of the last line of `pod` the operator handled (its resume mark; 0:
    none)."""
    mark = marks.parse_mark(pod.metadata.annotations)
    return mark.ns / 1e9 if mark else 0.0


@pytest.fixture
def own_operator(api, control_plane, node) -> Iterator[tuple[str, OperatorProcess]]:
    """A namespace with an operator of its own that writes its resume marks every second (the
    session operator's every 300 s)."""
    ns = ready_namespace(api, f"rn-solo-{uuid.uuid4().hex[:6]}")
    try:
        with OperatorProcess(control_plane.kubeconfig, "--standalone", "-n", ns,
                             "--log-mark-seconds", "1") as proc:
            yield ns, proc
    finally:
        client.CoreV1Api(api).delete_namespace(ns)


def test_an_engine_death_logged_after_the_kubelet_rotated_the_log_is_acted_on(api, node,
                                                                              own_operator):
    ns, operator = own_operator
    body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "rotated"},
            "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", "replicas": 1, "vllm": {"env": [
                {"name": "VLM_SIM_STARTUP_SECONDS", "value": "0"},
                # the engine dies, the process stays: only the log tells
                {"name": "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "value": "1"}]}}}
    custom, v1 = client.CustomObjectsApi(api), client.CoreV1Api(api)
    custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, body)
    pod = wait_for("the pod Ready", lambda: next(
        (p for p in v1.list_namespaced_pod(ns).items if is_ready(p)), None), 120, 0.2)
    wait_for("the operator reading the pod's engine heartbeat from its log", lambda: condition(
        custom, ns, "rotated", "StallDetection").get("reason") == "EngineHeartbeat", 90, 0.5)
    before = operator.metrics()

    post_fault(pod.status.pod_ip, {"fault": "log_flood", "rate": FLOOD_LINES_S,
                                   "seconds": FLOOD_S})
    flood_over = time.time() + FLOOD_S + 1  # the simulator's flood is at most a second behind
    logs = node.root / "fixed" / "pod-logs" / f"{ns}_{pod.metadata.name}_{pod.metadata.uid}"
    rotated = wait_for("the kubelet rotating the container's log", lambda: sorted(
        (logs / children.CONTAINER).glob("0.log.*")), 90, 0.5)
    rotated_at = time.time()
    wait_for("the operator reading a line logged after the flood", lambda: read_up_to(
        v1.read_namespaced_pod(pod.metadata.name, ns)) > max(flood_over, rotated_at), 90, 0.5)
    caught_up_s = time.time() - rotated_at

    post_fault(pod.status.pod_ip, {"fault": "engine_dead"})
    last = wait_for("the engine death acted on", lambda: (
        (r := vlmd_status(custom, ns, "rotated").get("lastRemediation"))
        and r.get("pod") == pod.metadata.name and r), 90, 0.5)
    acted_s = time.time() - rotated_at
    after = operator.metrics()
    read = (metric(after, "vlm_operator_log_lines_total")
            - metric(before, "vlm_operator_log_lines_total"))
    ended = (metric(after, "vlm_operator_log_streams_ended_total")
             - metric(before, "vlm_operator_log_streams_ended_total"))
    print(f"rotated into {[p.name for p in rotated]}; {read:.0f} lines read, {ended:.0f} "
          f"follow streams ended; read past the flood {caught_up_s:.1f} s and the engine death "
          f"acted on {acted_s:.1f} s after the rotation")
    assert last["signature"] == "engine_dead", last
