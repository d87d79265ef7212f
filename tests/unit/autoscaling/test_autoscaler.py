"""autoscaler.Autoscaler, the acting side, on a recording stand-in for Kube: a view of the
VLMDeployment older than the autoscaler's own last write is read afresh instead of acted on
again, and a running pod that is not Ready is never taken for an idle, loading one."""

import json

import pytest

from vlm_operator.api.names import FENCE
from vlm_operator.autoscaling import recommend as a
from vlm_operator.autoscaling.autoscaler import Autoscaler
from vlm_operator.autoscaling.budget import GpuBudget
from vlm_operator.autoscaling.pod_states import pod_state
from vlm_operator.k8s import gpu_plan
from vlm_operator.k8s import nodes as gpu_budget
from vlm_operator.k8s.pods import parse_time, rfc3339
from vlm_operator.podreads.reader import Scrape
from vlm_operator.remediation import incidents, ladder


class Kube:
    def __init__(self, body):
        self.body, self.calls, self.statuses = body, [], []

    def get_vlmd(self, namespace, name):
        self.calls.append(("get",))
        return self.body

    def scale_vlmd(self, namespace, name, replicas):
        self.calls.append(("scale", replicas))

    def delete(self, api_version, kind, namespace, name, uid=None, grace_s=None):
        self.calls.append(("delete", name))

    def patch_pod(self, namespace, name, labels=None, annotations=None):
        self.calls.append(("mark", name))

    def patch_vlmd_status(self, namespace, name, status):
        self.statuses.append(status)

    def post_event(self, involved, event):
        pass


class Cluster:
    def start_budget(self, unbound=False):
        pass


def vlmd(replicas, rv):
    return {"apiVersion": "serving.vlm-operator.dev/v1alpha1", "kind": "VLMDeployment",
            "metadata": {"namespace": "ns", "name": "m", "resourceVersion": rv},
            "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2", "replicas": replicas,
                     "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3,
                                     "scaleDownDelaySeconds": 0}}}


def pod(name, ready=True, started=True, draining_since=None):
    meta = {"name": name, "uid": f"uid-{name}", "labels": {}, "annotations": {},
            "creationTimestamp": "2026-01-01T00:00:00Z"}
    if draining_since is not None:
        meta["labels"]["serving.vlm-operator.dev/in-service"] = "false"
        meta["annotations"][a.DRAIN_SINCE] = f"{draining_since:.3f}"
    return {"metadata": meta, "spec": {"nodeName": "n"}, "status": {
        "podIP": "127.0.0.9",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "vllm", "started": started,
                               "state": {"running": {}} if started else {"waiting": {}}}]}}


IDLE = Scrape(values={"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0})


def test_a_stale_view_is_read_afresh_not_acted_on_again():
    stale = vlmd(2, "10")
    kube = Kube(stale)
    scaler = Autoscaler(kube, clock=lambda: 1000.0, budget=GpuBudget(Cluster()))
    pods = [pod("a"), pod("b", draining_since=990.0)]  # b drained: it goes, replicas 2 -> 1
    scaler.tick(stale, pods, {"a": IDLE, "b": IDLE})
    assert kube.calls == [("delete", "b"), ("scale", 1)]
    # kopf has not delivered the new replica count: the same view comes back with a fresh
    # replacement pod the ReplicaSet made meanwhile; acting on it would drain and delete again
    kube.calls.clear()
    kube.body = vlmd(1, "11")
    scaler.tick(stale, [pod("a"), pod("c", ready=False, started=False)], {"a": IDLE})
    assert ("get",) in kube.calls
    assert not [c for c in kube.calls if c[0] in ("delete", "scale", "mark")], kube.calls


def test_a_running_pod_that_is_not_ready_is_read_not_loading():
    assert pod_state(pod("loading", ready=False, started=False)) == a.LOADING
    assert pod_state(pod("unready", ready=False, started=True)) == a.READY
    # so an unreadable one is UNKNOWN, never drained at once or picked to go
    kube = Kube(vlmd(2, "1"))
    scaler = Autoscaler(kube, clock=lambda: 1000.0, budget=GpuBudget(Cluster()))
    scaler.tick(kube.body, [pod("a"), pod("busy", ready=False, draining_since=900.0)],
                {"a": IDLE, "busy": Scrape(error="timeout")})
    assert ("delete", "busy") not in kube.calls


@pytest.mark.parametrize("error", ["unreachable", "timeout", "too_large", "redirect",
                                   "bad_answer", "http_error", "busy"])
def test_a_draining_pod_that_cannot_be_read_is_never_drained(error):
    """Whatever kept its /metrics from being read (a refused or dropped connection, an answer
    outside the operator's limits, no worker free this round), its load is unknown, not 0."""
    kube = Kube(vlmd(2, "1"))
    scaler = Autoscaler(kube, clock=lambda: 1000.0, budget=GpuBudget(Cluster()))
    scaler.tick(kube.body, [pod("a"), pod("b", draining_since=990.0)],
                {"a": IDLE, "b": Scrape(error=error)})
    assert ("delete", "b") not in kube.calls


def test_failing_pods_are_asked_once_a_round_and_picked_first():
    """The log watcher's failing pods (remove first) are asked once per round, not once per
    pod: the question walks the watcher's state, every second per Builtin VLMDeployment."""
    kube = Kube(vlmd(3, "1"))
    scaler = Autoscaler(kube, clock=lambda: 1000.0, budget=GpuBudget(Cluster()))
    asked = []
    scaler.failing_pods = lambda namespace, name: asked.append(name) or {"b"}
    pods = [pod("a"), pod("b"), pod("c")]
    scaler.tick(kube.body, pods, {p["metadata"]["name"]: IDLE for p in pods})
    assert asked == ["m"]
    assert ("mark", "b") in kube.calls  # idle at 3 replicas: the failing one is drained first


class Budget(Cluster):
    """One node with 2 GPUs, `free` of them free."""

    def __init__(self, free):
        self.free = free

    def budget(self):
        return ([gpu_budget.Node("n", {}, (), {"nvidia.com/gpu": 2})],
                {"n": {"nvidia.com/gpu": self.free}})


def surging(body, sick="a", before=("uid-a", "uid-b")):
    """A Replace of `sick` in flight, its surge begun when the pods `before` were there."""
    record = {"action": "Replace", "pod": sick, "signature": "tokenizer_retry", "incident": 1.0,
              "since": 1.0, "replicas": 2, "before": list(before)}
    body["metadata"]["annotations"] = {incidents.IN_FLIGHT: json.dumps({f"uid-{sick}": record})}
    return body


def test_a_surge_replacement_is_not_counted_as_a_granted_replica():
    """The replacement's GPU stands in for its sick pod's: counting it as one of the bound
    replicas granted a third replica with no GPU free."""
    body = surging(vlmd(2, "1"))
    kube = Kube(body)
    clock = iter(range(1000, 1010))
    scaler = Autoscaler(kube, clock=lambda: float(next(clock)),
                        budget=GpuBudget(Budget(free=0)))
    busy = Scrape(values={"vllm:num_requests_running": 4.0, "vllm:num_requests_waiting": 40.0})
    pods = [pod("a"), pod("b"), pod("x", ready=False, started=False)]  # x: the replacement
    for _ in range(3):
        decision = scaler.tick(body, pods, {"a": busy, "b": busy})
    assert ("scale", 3) not in kube.calls
    assert decision.desired == 2 and decision.reason == "ScalingLimited"


def test_status_says_when_each_replica_still_starting_should_serve():
    kube = Kube(vlmd(2, "1"))
    scaler = Autoscaler(kube, clock=lambda: 1000.0, budget=GpuBudget(Cluster()))
    done = pod("a")
    done["status"]["conditions"][0]["lastTransitionTime"] = "2026-01-01T00:01:50Z"  # 110 s
    starting = pod("b", ready=False, started=False)
    starting["metadata"]["creationTimestamp"] = "2026-01-01T00:10:00Z"
    scaler.tick(kube.body, [pod("a", ready=False, started=False), starting], {})  # a starts
    kube.statuses.clear()
    scaler.tick(kube.body, [done, starting], {"a": IDLE})
    (status,) = kube.statuses
    assert status["autoscaling"]["pendingReplicas"] == [{
        "pod": "b", "since": "2026-01-01T00:10:00Z", "expectedReadyTime": "2026-01-01T00:11:50Z",
        "expected": "median start 110 s of the last 1 seen"}]
    scaler.tick(kube.body, [done, starting], {"a": IDLE})  # nothing new: not written again
    assert len(kube.statuses) == 1


def fenced(name):
    """A pod remediation fenced (InPlace recovery): out of the Service, its engine restarting."""
    p = pod(name, ready=False)
    p["metadata"]["labels"]["serving.vlm-operator.dev/in-service"] = "false"
    p["metadata"]["annotations"][FENCE] = ladder.fence_value(ladder.Fence(
        "engine_dead", 990.0, 991.0, "await-exit", 1021.0, 0, "engine died"))
    return p


def test_a_fenced_pod_is_capacity_and_goes_first_never_the_only_healthy_one():
    """2 replicas, one fenced and recovering in place, load low, minReplicas 1: the fenced pod
    is the one removed (at once: it serves nothing), never the healthy one drained."""
    kube = Kube(vlmd(2, "1"))
    clock = iter(range(1000, 1010))
    scaler = Autoscaler(kube, clock=lambda: float(next(clock)), budget=GpuBudget(Cluster()))
    pods = [pod("a"), fenced("b")]
    for _ in range(3):
        scaler.tick(kube.body, pods, {"a": IDLE})
    assert ("mark", "a") not in kube.calls and ("delete", "a") not in kube.calls
    assert kube.calls[:2] == [("delete", "b"), ("scale", 1)]
    assert ("mark", "b") not in kube.calls  # never marked draining: nothing puts it back


def test_a_fenced_pod_counts_as_capacity_on_its_way_back():
    """Load for 2 on 2 replicas, one fenced: no scale-up for its missing capacity, no
    scale-down either."""
    kube = Kube(vlmd(2, "1"))
    clock = iter(range(1000, 1010))
    scaler = Autoscaler(kube, clock=lambda: float(next(clock)), budget=GpuBudget(Cluster()))
    busy = Scrape(values={"vllm:num_requests_running": 4.0, "vllm:num_requests_waiting": 8.0})
    for _ in range(3):  # 8 waiting at target 5: 1.6 replicas, within target for 2
        decision = scaler.tick(kube.body, [pod("a"), fenced("b")], {"a": busy})
    assert decision.desired == 2
    assert not [c for c in kube.calls if c[0] in ("delete", "scale", "mark")], kube.calls


def test_a_fresh_autoscaler_never_takes_a_pods_age_for_its_start():
    """After an operator restart, a pod Ready since a flap 3 days after its creation is no
    3-day start: the replica still starting has no expectation rather than one 3 days away."""
    kube = Kube(vlmd(2, "1"))
    scaler = Autoscaler(kube, clock=lambda: 1000.0, budget=GpuBudget(Cluster()))
    flapped = pod("a")
    flapped["status"]["conditions"][0]["lastTransitionTime"] = "2026-01-04T00:00:00Z"
    starting = pod("b", ready=False, started=False)
    starting["metadata"]["creationTimestamp"] = "2026-01-05T00:00:00Z"
    scaler.tick(kube.body, [flapped, starting], {"a": IDLE})
    (entry,) = kube.statuses[-1]["autoscaling"]["pendingReplicas"]
    assert "expectedReadyTime" not in entry and entry["expected"].startswith("unknown")


class FullNode(Budget):
    """One node with no GPU free, no pod of another VLMDeployment Pending."""

    def __init__(self):
        super().__init__(free=0)

    def unbound_uses(self):
        return []


def test_a_scale_up_waits_for_a_node_and_is_given_back_past_the_provisioning_timeout():
    now = parse_time("2026-01-01T01:00:00Z")
    body = vlmd(2, "1")
    kube = Kube(body)
    growth = gpu_plan.Growth(per_deployment=4, total=4, timeout_s=300.0)
    published = []  # what kube had been asked when the condition was published
    scaler = Autoscaler(kube, lambda ns, name: published.append(list(kube.calls)),
                        clock=lambda: now, budget=GpuBudget(FullNode(), growth))
    busy = Scrape(values={"vllm:num_requests_running": 4.0, "vllm:num_requests_waiting": 40.0})
    pods = [pod("a"), pod("b")]
    for _ in range(3):
        decision = scaler.tick(body, pods, {"a": busy, "b": busy})
    assert ("scale", 3) in kube.calls and decision.desired == 3
    # the WaitingForNode condition is published once the scale it describes is written
    assert published and ("scale", 3) in published[0]
    (report,) = scaler.reports("ns", "m")
    assert (report.status, report.reason) == ("False", "WaitingForNode")
    assert "wait for a node the node autoscaler adds" in report.message
    # the ReplicaSet made c; no node came for it in the provisioning timeout
    body = vlmd(3, "2")
    waiting = pod("c", ready=False, started=False)
    waiting["spec"] = {}
    waiting["status"] = {"conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "lastTransitionTime": rfc3339(now - 300)}]}
    kube.calls.clear()
    decision = scaler.tick(body, [*pods, waiting], {"a": busy, "b": busy})
    assert decision.desired == 2 and decision.reason == "ScalingLimited"
    assert ("mark", "c") in kube.calls  # the Pending replica leaves first
    assert scaler.reports("ns", "m")[0].reason == "NoNodeAdded"
    # gone: no new wait for a node for one more timeout
    kube.calls.clear()
    decision = scaler.tick(vlmd(2, "3"), pods, {"a": busy, "b": busy})
    assert ("scale", 3) not in kube.calls and decision.desired == 2
