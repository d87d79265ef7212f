"""The operator when the control plane fails it:
- the real kube-apiserver stopped for 30 s, then frozen with SIGSTOP for 30 s (its connections
  stay open and nothing answers: the half-open case), each while a replacement of a sick pod is
  in flight and Builtin autoscaling is scaling. The operator must recover by itself, lose no
  incident, act once per incident, and stay up;
- kube-controller-manager lagging (frozen) while a replacement's sick pod is deleted: the
  replicas drop only once its ReplicaSet has seen the pod go, so it never removes the
  replacement in the sick pod's place.

A control plane of its own: stopping the session's apiserver would pull it from under every
other test. Recovery times are printed (bench material), never asserted.
"""

from __future__ import annotations

import time
import uuid

import pytest
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from vlm_operator.api import crd
from vlm_operator.desired import children
from vlm_testbed.controlplane import ControlPlane, api_client_from_kubeconfig, build
from vlm_testbed.failure_matrix import Bed, healthy, instance, is_ready

OUTAGE_S = 30
# How long the surge must outlast the sick pod while the ReplicaSet cannot have seen it go (an
# operator that does not wait lowers the replicas within a step, about a second).
HELD_S = 8
LOADING = [{"name": "VLM_SIM_STARTUP_SECONDS", "value": "8"}]  # a replacement loads a while
SCALING = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "target": 5,
           "scaleDownDelaySeconds": 0}


@pytest.fixture(scope="module")
def plane():
    build()
    with ControlPlane(crd.get_all_crds()) as cp:
        yield cp


def metric(text: str, name: str, **labels) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def stalled(bed: Bed, name: str) -> dict:
    return bed.condition(name, "OperatorStalled")


def in_bed(plane: ControlPlane, prefix: str, scenario) -> None:
    """scenario(bed, plane, op) in a namespace of its own with an operator of its own, whose
    log is printed when it fails."""
    api = api_client_from_kubeconfig(plane.kubeconfig)
    with Bed.new(api, plane.kubeconfig, f"{prefix}-{uuid.uuid4().hex[:6]}") as bed:
        op = bed.operator()
        try:
            scenario(bed, plane, op)
        except BaseException:
            print(op.log()[-6000:])
            raise
        print("operator log, last lines:", op.log()[-2000:], sep="\n")


def test_apiserver_stopped_then_frozen(plane):
    in_bed(plane, "faults", run)


def run(bed: Bed, plane: ControlPlane, op) -> None:
    bed.nodes(gpus_per_node=6)
    bed.create("inc", replicas=1, env=LOADING)
    bed.create("scale", replicas=1, autoscaling=SCALING)
    (sick,) = bed.wait_ready("inc", 1)
    (first,) = bed.wait_ready("scale", 1)
    times = {}

    # -- 1. stopped for 30 s: a replacement in flight, a scale-up under way
    bed.fault(sick, {"fault": "tokenizer_retry", "rate": 20})
    bed.fault(first, {"fault": "load", "waiting": 12})  # needs 2.4 replicas
    bed.wait("a replacement in flight", lambda: bed.events("inc")["PodReplacing"] == 1)
    bed.wait("the scale-up written", lambda: bed.get("scale")["spec"]["replicas"] == 3)
    plane.stop_apiserver()
    time.sleep(OUTAGE_S)
    plane.start_apiserver()
    back = time.monotonic()
    assert op.proc.poll() is None, "the operator exited while the apiserver was down"
    replaced = bed.wait("the sick pod replaced", lambda: bed.events("inc")["PodReplaced"] == 1
                        and replacement(bed, "inc", {instance(sick)}), timeout=240)
    times["stop: replacement done"] = time.monotonic() - back
    bed.wait("3 replicas serving", lambda: len(serving(bed, "scale", 3, set())) >= 3,
             timeout=240)
    times["stop: scale-up done"] = time.monotonic() - back
    events = bed.events("inc")
    assert (events["PodReplacing"], events["PodReplaced"], events["PodRestarted"]) == (1, 1, 0)
    assert bed.get("scale")["spec"]["replicas"] == 3

    # -- 2. frozen for 30 s: another replacement in flight, a scale-down about to drain
    sick2 = replaced[0]
    bed.fault(sick2, {"fault": "tokenizer_retry", "rate": 20})
    bed.wait("a second replacement in flight", lambda: bed.events("inc")["PodReplacing"] == 2)
    bed.fault(first, {"fault": "clear"})
    unanswered = metric(op.metrics(), "vlm_operator_api_requests_total", code="none")
    plane.freeze()
    try:
        time.sleep(OUTAGE_S)
        # calls into the frozen apiserver ended at their deadline rather than hanging
        frozen = metric(op.metrics(), "vlm_operator_api_requests_total", code="none")
    finally:
        plane.thaw()
    back = time.monotonic()
    assert frozen > unanswered, "no call gave up on the frozen apiserver"
    assert op.proc.poll() is None, "the operator exited while the apiserver was frozen"
    # the operator's log, not the Event, says the pod was deleted: an Event posted while the
    # apiserver is still catching up after SIGCONT may be lost (Events are best-effort)
    bed.wait("the second sick pod replaced", lambda: deletions(op, sick2) == 1
             and all(p.metadata.uid != sick2.metadata.uid for p in bed.pods("inc"))
             and serving(bed, "inc", 1, {instance(sick), instance(sick2)}), timeout=240)
    times["freeze: replacement done"] = time.monotonic() - back
    bed.wait("scaled down to 1", lambda: bed.get("scale")["spec"]["replicas"] == 1
             and len(bed.pods("scale")) == 1, timeout=240)
    times["freeze: scale-down done"] = time.monotonic() - back
    time.sleep(3)  # a late second action would show now
    events = bed.events("inc")
    assert (events["PodReplacing"], events["PodRestarted"]) == (2, 0)
    assert events["PodReplaced"] <= 2
    assert (deletions(op, sick), deletions(op, sick2)) == (1, 1), "a pod deleted twice"
    (left,) = bed.pods("scale")
    assert left.metadata.uid == first.metadata.uid  # the newest went, drained, once each
    assert left.metadata.labels[children.IN_SERVICE_LABEL] == "true"
    assert bed.get("scale")["spec"]["replicas"] == 1

    # -- it recovered by itself: every loop runs, every condition says so
    for name in ("inc", "scale"):
        bed.wait(f"OperatorStalled=False on {name}",
                 lambda n=name: stalled(bed, n).get("status") == "False", timeout=60)
    assert metric(op.metrics(), "vlm_operator_loop_stalled") == 0
    assert op.proc.poll() is None
    print("recovery after the apiserver answered again (s):",
          {k: round(v, 1) for k, v in times.items()})


def test_replicas_drop_only_once_the_replicaset_saw_the_sick_pod_go(plane):
    in_bed(plane, "counted", lagging_controller_manager)


def lagging_controller_manager(bed: Bed, plane: ControlPlane, op) -> None:
    bed.nodes(gpus_per_node=3)
    bed.create("rep", replicas=1, env=LOADING)  # the replacement loads a while
    (sick,) = bed.wait_ready("rep", 1)
    bed.fault(sick, {"fault": "tokenizer_retry", "rate": 20})
    # frozen once its ReplicaSet counts the replacement too, long before the sick pod can go
    bed.wait("the surge counted", lambda: deployment(bed, "rep").status.replicas == 2)
    plane.freeze("kube-controller-manager")  # its ReplicaSet keeps counting the sick pod
    try:
        (new,) = bed.wait("the replacement serving", lambda: serving(
            bed, "rep", 1, {instance(sick)}))
        bed.wait("the sick pod drained, deleted and gone", lambda: all(
            p.metadata.uid != sick.metadata.uid for p in bed.pods("rep")))
        dropped = bed.holds(lambda: deployment(bed, "rep").spec.replicas < 2, HELD_S)
    finally:
        plane.thaw("kube-controller-manager")
    assert not dropped, "the replicas dropped while the ReplicaSet still counted the sick pod"
    bed.wait("the surge ended, the replacement kept", lambda: deployment(
        bed, "rep").spec.replicas == 1 and [p.metadata.uid for p in bed.pods("rep")
                                            if not p.metadata.deletion_timestamp] == [
            new.metadata.uid])
    assert healthy(new.status.pod_ip)
    assert f"{sick.metadata.name} has left, but Deployment rep still counts 2" in op.log()


def deployment(bed: Bed, name: str) -> client.V1Deployment:
    return client.AppsV1Api(bed.api).read_namespaced_deployment(name, bed.ns)


def deletions(op, pod) -> int:
    """Times the operator logged deleting this pod for a replacement (remediation/in_flight.py)."""
    return op.log().count(f": deleted {pod.metadata.name}: ")


def serving(bed: Bed, name: str, n: int, faulted: set) -> list:
    """n ready pods answering /health, none of them a faulted container instance."""
    pods = [p for p in bed.pods(name) if is_ready(p) and instance(p) not in faulted
            and healthy(p.status.pod_ip)]
    return pods if len(pods) >= n else []


def replacement(bed: Bed, name: str, faulted: set) -> list:
    """The one pod of a one-replica VLMDeployment once its replacement is over: the surge
    ended (spec.replicas 1), one pod not being deleted, serving, not a faulted instance. Until
    then the ReplicaSet may hold a pod it made when the sick pod went and removes once the
    replicas drop: that one is no replacement."""
    if deployment(bed, name).spec.replicas != 1:
        return []
    if len([p for p in bed.pods(name) if not p.metadata.deletion_timestamp]) != 1:
        return []
    return serving(bed, name, 1, faulted)
