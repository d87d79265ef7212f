"""remediation/recovery.py's glue with spec.health.recovery InPlace, over the shared fake Kube: a
pod that serves nothing is fenced in one patch, recovered in place by the rungs the rounds
take from its annotation and status, and counted once."""

from __future__ import annotations

import time

import pytest

from vlm_operator.api.names import (
    ACTED_UNTIL,
    FENCE,
    IN_SERVICE_LABEL,
    RECOVERED_IN_PLACE,
    RESTART_REQUEST,
)
from vlm_operator.k8s.pods import rfc3339
from vlm_operator.podreads import reader
from vlm_operator.remediation import ladder
from vlm_operator.remediation.incidents import HISTORY, Incident, parse_history
from vlm_operator.remediation.remediator import Remediator
from vlm_operator.remediation.suspect import GpuFault

from ..fakes import FakeKube

NS = "ml"
IN_PLACE = {"health": {"recovery": "InPlace"}}


@pytest.fixture(autouse=True)
def no_pod_http(monkeypatch):
    monkeypatch.setattr(reader, "health", lambda ip, *a, **kw: None)


def remediator(kube: FakeKube, *, plugin: bool = True, gpu_error=lambda uid: None
               ) -> Remediator:
    rem = Remediator(kube, lambda ns, name: None, plugin_loaded=lambda uid: plugin,
                     gpu_error=gpu_error)
    rem.stop()
    return rem


def setup(*, replicas=1, keep_alive=False, **spec) -> tuple[FakeKube, dict]:
    kube = FakeKube()
    kube.add_vlmd(NS, "vl", replicas=replicas, **{**IN_PLACE, **spec})
    pod = kube.add_pod(NS, "a", owner="vl")
    env = [{"name": "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "value": "1"}] if keep_alive else []
    pod["spec"] = {"containers": [{"name": "vllm", "env": env}],
                   "volumes": [{"name": "control", "downwardAPI": {"items": []}}]}
    return kube, pod


def death(signature="engine_dead", key="engineDead") -> Incident:
    now = time.time()
    return Incident("uid-a", "a", key, signature, now - 1, now, 1)


def rung_events(kube: FakeKube) -> list[str]:
    return [c[3] for c in kube.calls if c[0] == "post_event" and c[1] == "Pod"]


def last(kube: FakeKube) -> dict:
    return [c for c in kube.calls if c[0] == "patch_vlmd_status"][-1][3]["lastRemediation"]


def round_(rem: Remediator, kube: FakeKube) -> None:
    rem.round(kube.vlmds[(NS, "vl")], kube.pods[NS])


def restarted(pod: dict, ready: bool) -> None:
    cs = pod["status"]["containerStatuses"][0]
    cs["restartCount"] += 1
    cs["ready"] = ready
    pod["status"]["conditions"][0]["status"] = "True" if ready else "False"


def test_an_engine_death_is_fenced_and_recovered_in_place_counted_once():
    kube, pod = setup()
    rem = remediator(kube)
    rem.incident(NS, "vl", death())
    # one patch: out of the Service, with the fence; no deletion
    assert [c for c in kube.calls if c[0] in ("patch_pod", "delete")] == [
        ("patch_pod", NS, "a", {IN_SERVICE_LABEL: "false"})]
    fence = ladder.parse_fence(pod["metadata"]["annotations"])
    assert fence.rung == "await-exit" and fence.restarts == 0
    assert RESTART_REQUEST not in pod["metadata"]["annotations"]
    assert last(kube)["rung"] == "await-exit" and last(kube)["action"] == "Restart"
    assert rung_events(kube) == ["PodFenced"]

    round_(rem, kube)  # nothing changed yet: nothing done
    assert len([c for c in kube.calls if c[0] == "patch_pod"]) == 1
    restarted(pod, ready=False)  # vLLM exited, the kubelet restarted it: loading
    round_(rem, kube)
    assert pod["metadata"]["labels"][IN_SERVICE_LABEL] == "false"
    restarted(pod, ready=True)
    pod["status"]["containerStatuses"][0]["restartCount"] = 1
    round_(rem, kube)
    assert pod["metadata"]["labels"][IN_SERVICE_LABEL] == "true"
    assert FENCE not in pod["metadata"]["annotations"]
    assert float(pod["metadata"]["annotations"][ACTED_UNTIL]) >= fence.incident
    assert rung_events(kube) == ["PodFenced", "PodRecoveredInPlace"]
    assert last(kube)["rung"] == "unfenced"
    history = parse_history(kube.vlmds[(NS, "vl")]["metadata"]["annotations"][HISTORY])
    assert len(history) == 1  # the kubelet's restart and the operator's fence: one incident
    assert not [c for c in kube.calls if c[0] == "delete"]


def test_detections_of_the_recovered_incident_are_not_acted_on_again():
    kube, pod = setup()
    rem = remediator(kube)
    now = time.time()
    first = Incident("uid-a", "a", "engineDead", "engine_dead", now - 3, now - 2, 1)
    rem.incident(NS, "vl", first)
    owner = rem.owner(NS, "vl")
    later = Incident("uid-a", "a", "engineDead", "engine_dead", now - 3, now - 1, 2)
    rem.incident(NS, "vl", later)  # the same dying container logs on: the fence covers it
    rem._decide(NS, "vl", owner, list(owner.open))
    assert len([c for c in kube.calls if c[0] == "patch_pod"]) == 1
    restarted(pod, ready=True)
    round_(rem, kube)
    rem._decide(NS, "vl", owner, list(owner.open))  # decided again after the unfence
    assert not owner.open
    assert len([c for c in kube.calls if c[0] == "patch_pod"]) == 2  # fence, unfence
    assert not [c for c in kube.calls if c[0] == "delete"]


def test_a_hung_engine_gets_a_restart_request_then_a_new_pod_when_it_fails(monkeypatch):
    kube, pod = setup()
    rem = remediator(kube)
    rem.incident(NS, "vl", death("engine_stalled", "engineStalled"))
    fence = ladder.parse_fence(pod["metadata"]["annotations"])
    assert fence.rung == "restart-request"
    request = pod["metadata"]["annotations"][RESTART_REQUEST]
    assert request == f"engine_stalled@{fence.incident:.3f}"
    assert rung_events(kube) == ["PodRestartRequested"]
    clock = fence.deadline + 1
    monkeypatch.setattr(time, "time", lambda: clock)  # the request's deadline passed
    round_(rem, kube)
    assert [c for c in kube.calls if c[0] == "delete"] == [("delete", "Pod", NS, "a", 10)]
    assert rung_events(kube) == ["PodRestartRequested", "PodRestarted"]
    assert last(kube)["rung"] == "delete"


def test_a_dead_engine_kept_alive_without_the_plugin_is_deleted_at_once():
    kube, _ = setup(keep_alive=True)
    rem = remediator(kube, plugin=False)
    rem.incident(NS, "vl", death())
    assert [c[0] for c in kube.calls if c[0] in ("patch_pod", "delete")] == ["patch_pod",
                                                                             "delete"]
    assert last(kube)["rung"] == "delete"


def test_a_fresh_operator_climbs_from_the_pods_annotation_alone(monkeypatch):
    kube, pod = setup()
    remediator(kube).incident(NS, "vl", death())
    fence = ladder.parse_fence(pod["metadata"]["annotations"])
    fresh = remediator(kube)  # nothing in memory
    monkeypatch.setattr(time, "time", lambda: fence.deadline + 1)
    round_(fresh, kube)  # it never exited: the next rung
    assert ladder.parse_fence(pod["metadata"]["annotations"]).rung == "restart-request"
    assert RESTART_REQUEST in pod["metadata"]["annotations"]
    history = parse_history(kube.vlmds[(NS, "vl")]["metadata"]["annotations"][HISTORY])
    assert len(history) == 1


@pytest.mark.parametrize(("spec", "acts"), [
    ({}, ["patch_pod"]),  # the default is InPlace: the fence, the kubelet restarts in place
    ({"health": {"recovery": "NewPod"}}, ["delete"]),  # the explicit choice: a new pod
])
def test_the_default_recovers_in_place_and_new_pod_deletes(spec, acts):
    kube = FakeKube()
    kube.add_vlmd(NS, "vl", replicas=1, **spec)
    kube.add_pod(NS, "a", owner="vl")
    remediator(kube).incident(NS, "vl", death())
    assert [c[0] for c in kube.calls if c[0] in ("patch_pod", "delete")] == acts


def in_place_restart_after(pod: dict, t: float, *, ready: bool) -> None:
    """The kubelet restarted the vllm container in place at t (the previous one ran 60 s)."""
    cs = pod["status"]["containerStatuses"][0]
    cs["restartCount"] += 1
    cs["state"] = {"running": {"startedAt": rfc3339(t)}}
    cs["lastState"] = {"terminated": {"startedAt": rfc3339(t - 60), "finishedAt": rfc3339(t)}}
    cs["ready"] = ready
    pod["status"]["conditions"][0]["status"] = "True" if ready else "False"


@pytest.mark.parametrize("spec", [IN_PLACE, {}])
def test_a_late_engine_death_line_from_the_previous_container_does_nothing(spec):
    """The line was logged at t; the kubelet restarted the container in place 6 s later, and
    the line is only now decided on (read late, an API back-off): the fresh container is
    neither fenced nor deleted (InPlace), nor its pod deleted (NewPod), nor the budget spent."""
    kube = FakeKube()
    kube.add_vlmd(NS, "vl", replicas=1, **spec)
    pod = kube.add_pod(NS, "a", owner="vl")
    now = time.time()
    logged = now - 12
    in_place_restart_after(pod, logged + 6, ready=False)
    rem = remediator(kube)
    rem.incident(NS, "vl", Incident("uid-a", "a", "engineDead", "engine_dead", logged,
                                    logged, 1))
    assert not [c for c in kube.calls if c[0] in ("patch_pod", "delete", "post_event")]
    assert FENCE not in pod["metadata"].get("annotations", {})
    assert HISTORY not in kube.vlmds[(NS, "vl")]["metadata"].get("annotations", {})
    assert not rem.owner(NS, "vl").open
    # a death the current container logs is acted on as ever
    rem.incident(NS, "vl", Incident("uid-a", "a", "engineDead", "engine_dead", now, now, 1))
    owner = rem.owner(NS, "vl")
    rem._decide(NS, "vl", owner, list(owner.open))  # decided at once, not RECONSIDER_S later
    assert [c for c in kube.calls if c[0] in ("patch_pod", "delete")]


def test_a_pod_with_old_restarts_is_still_recovered_in_place():
    """5 restarts long ago; the container has run for days: the kubelet forgot its back-off
    and restarts it at once, so the first rung is in place, not a new pod."""
    kube, pod = setup()
    now = time.time()
    cs = pod["status"]["containerStatuses"][0]
    cs["restartCount"] = 5
    cs["state"] = {"running": {"startedAt": rfc3339(now - 3 * 86400)}}
    cs["lastState"] = {"terminated": {"startedAt": rfc3339(now - 3 * 86400 - 30),
                                      "finishedAt": rfc3339(now - 3 * 86400 - 1)}}
    rem = remediator(kube)
    rem.incident(NS, "vl", death())
    fence = ladder.parse_fence(pod["metadata"]["annotations"])
    assert fence.rung == "await-exit" and fence.deadline - fence.at == ladder.EXIT_WAIT_S
    assert not deletions(kube)


ILLEGAL = "CUDA error: an illegal memory access was encountered"


def deletions(kube: FakeKube) -> list:
    return [c for c in kube.calls if c[0] == "delete"]


def test_an_engine_death_after_a_gpu_error_is_a_new_pod_at_once_and_the_node_is_named():
    kube, pod = setup()
    pod["spec"]["nodeName"] = "gpu-7"
    rem = remediator(kube, gpu_error=lambda uid: GpuFault(time.time() - 1, ILLEGAL))
    rem.incident(NS, "vl", death())
    # fenced and deleted, not left for the kubelet to restart on the same GPU
    assert [c[0] for c in kube.calls if c[0] in ("patch_pod", "delete")] == ["patch_pod",
                                                                             "delete"]
    assert ladder.parse_fence(pod["metadata"]["annotations"]).rung == "delete"
    assert rung_events(kube) == ["PodRestarted", "NodeSuspect"]
    assert last(kube)["rung"] == "delete"
    assert f"GPU error on node gpu-7: {ILLEGAL}; a new pod" in last(kube)["reason"]
    assert not [c for c in kube.calls if c[0] == "patch_node"]  # the Node is never written


def test_a_gpu_error_read_after_the_fence_deletes_instead_of_waiting():
    """The engine core logs its death first and the CUDA fault in the traceback after it: the
    fence's first rung waits for the exit; the next round, knowing the GPU error, deletes."""
    kube, pod = setup()
    pod["spec"]["nodeName"] = "gpu-7"
    seen: list[GpuFault] = []
    rem = remediator(kube, gpu_error=lambda uid: seen[-1] if seen else None)
    rem.incident(NS, "vl", death())
    assert ladder.parse_fence(pod["metadata"]["annotations"]).rung == "await-exit"
    seen.append(GpuFault(time.time(), ILLEGAL))
    restarted(pod, ready=False)  # the kubelet already restarted it in place: still replaced
    round_(rem, kube)
    assert deletions(kube) == [("delete", "Pod", NS, "a", 10)]
    assert rung_events(kube) == ["PodFenced", "PodRestarted", "NodeSuspect"]
    assert "GPU error on node gpu-7" in last(kube)["reason"]
    history = parse_history(kube.vlmds[(NS, "vl")]["metadata"]["annotations"][HISTORY])
    assert len(history) == 1  # one incident, one count


def test_a_gpu_error_incident_by_itself_fences_and_replaces_the_pod():
    kube, _ = setup()
    rem = remediator(kube, gpu_error=lambda uid: GpuFault(time.time(), ILLEGAL))
    rem.incident(NS, "vl", death("gpu_error", "gpuError"))
    assert deletions(kube) == [("delete", "Pod", NS, "a", 10)]
    assert rung_events(kube) == ["PodRestarted", "NodeSuspect"]


def test_in_place_recoveries_are_counted_on_the_pod_and_the_third_failure_is_a_new_pod():
    kube, pod = setup()
    pod["spec"]["nodeName"] = "gpu-7"
    for i in (1, 2):
        rem = remediator(kube)  # a fresh operator each time: the count is on the pod
        now = time.time() + i
        rem.incident(NS, "vl", Incident("uid-a", "a", "engineDead", "engine_dead", now, now, 1))
        assert ladder.parse_fence(pod["metadata"]["annotations"]).rung == "await-exit"
        restarted(pod, ready=True)
        round_(rem, kube)
        assert len(pod["metadata"]["annotations"][RECOVERED_IN_PLACE].split(",")) == i
    assert not deletions(kube)
    now = time.time() + 3
    remediator(kube).incident(NS, "vl", Incident("uid-a", "a", "engineDead", "engine_dead",
                                                 now, now, 1))
    assert deletions(kube) == [("delete", "Pod", NS, "a", 10)]
    assert rung_events(kube)[-2:] == ["PodRestarted", "NodeSuspect"]
    assert "already recovered in place 2 times on node gpu-7" in last(kube)["reason"]
