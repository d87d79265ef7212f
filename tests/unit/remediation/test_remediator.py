"""remediation/remediator.py's glue, over the shared fake Kube (tests/unit/fakes.py): a
detection in, the right API calls out, in order."""

from __future__ import annotations

import dataclasses
import time

import pytest

from vlm_operator.api.actions import Action
from vlm_operator.desired import children, stopping
from vlm_operator.metrics import REMEDIATIONS, REMEDIATIONS_SKIPPED
from vlm_operator.podreads import reader
from vlm_operator.remediation import steps
from vlm_operator.remediation.decide import Reason
from vlm_operator.remediation.incidents import (
    HISTORY,
    IN_FLIGHT,
    Incident,
    InFlight,
    in_flight_value,
    parse_in_flight,
)
from vlm_operator.remediation.remediator import Remediator

from ..fakes import FakeKube

NS = "ml"


@pytest.fixture(autouse=True)
def no_pod_http(monkeypatch):
    """No pod is reached over HTTP: /health unknown, every drained pod idle."""
    monkeypatch.setattr(reader, "health", lambda ip, *a, **kw: None)
    monkeypatch.setattr(reader, "requests_in_flight", lambda ip, *a, **kw: 0.0)


def storm(uid: str, pod: str, count: int = 5) -> Incident:
    now = time.time()
    return Incident(uid, pod, "tokenizerRetry", "tokenizer_retry", now - 1, now, count)


def metric(counter, *labels) -> float:
    return counter.labels(*labels)._value.get()


def remediator(kube: FakeKube, published: list, **kw) -> Remediator:
    """Not started, and stopped: no thread runs; a test takes an action's steps itself."""
    rem = Remediator(kube, lambda ns, name: published.append(name), **kw)
    rem.stop()
    return rem


def stepper(rem: Remediator, name: str, uid: str):
    """One step of the action in flight on pod `uid`, as its thread takes it; True when done."""
    owner = rem.owner(NS, name)

    def step() -> bool:
        with owner.lock:
            return rem.in_flight.step(NS, name, owner, uid)
    return step


def test_a_restart_deletes_the_pod_once_per_incident():
    kube = FakeKube()
    kube.add_vlmd(NS, "restart", replicas=3)
    for name in ("a", "b", "c"):
        kube.add_pod(NS, name, owner="restart")
    published = []
    rem = remediator(kube, published)
    before = metric(REMEDIATIONS, NS, "restart", "Restart")
    incident = storm("uid-a", "a")
    rem.incident(NS, "restart", incident)
    rem.incident(NS, "restart", dataclasses.replace(incident, count=6))  # the same burst
    owner = rem.owner(NS, "restart")
    rem._decide(NS, "restart", owner, list(owner.open))  # as the reconsider loop does
    deletes = [c for c in kube.calls if c[0] == "delete"]
    assert deletes == [("delete", "Pod", NS, "a", None)]  # it served: its own grace period
    assert metric(REMEDIATIONS, NS, "restart", "Restart") == before + 1
    writes = kube.writes()
    assert [w[0] for w in writes] == ["patch_vlmd_annotations", "delete", "post_event",
                                      "post_event", "patch_vlmd_status"]
    assert HISTORY in writes[0][3]  # counted for the budget before the action
    assert [w[3] for w in writes if w[0] == "post_event"] == ["PodRestarted"] * 2
    assert writes[-1][3]["lastRemediation"]["action"] == "Restart"
    assert published == ["restart"]
    assert not owner.open


def test_a_pod_that_serves_nothing_is_restarted_with_a_short_grace():
    kube = FakeKube()
    kube.add_vlmd(NS, "dead", replicas=1)
    kube.add_pod(NS, "a", owner="dead", ready=False)
    rem = remediator(kube, [])
    rem.incident(NS, "dead", storm("uid-a", "a"))
    assert [c for c in kube.calls if c[0] == "delete"] == [
        ("delete", "Pod", NS, "a", stopping.QUICK_GRACE_S)]


def test_a_held_action_records_its_reason_and_makes_no_call():
    kube = FakeKube()
    kube.add_vlmd(NS, "held", replicas=1)  # minAvailable 1, no GPU for a replacement
    kube.add_pod(NS, "a", owner="held")
    published = []
    rem = remediator(kube, published)
    before = metric(REMEDIATIONS_SKIPPED, NS, "held", "min_available")
    rem.incident(NS, "held", storm("uid-a", "a"))
    owner = rem.owner(NS, "held")
    (plan,) = owner.held.values()
    assert plan.reason == Reason.MIN_AVAILABLE and not plan.act
    assert ("uid-a", "tokenizerRetry") in owner.open  # decided again later
    writes = kube.writes()
    assert not [w for w in writes if w[0] in ("delete", "patch_pod", "scale_vlmd",
                                              "patch_vlmd_annotations")]
    assert [w[3] for w in writes if w[0] == "post_event"] == ["RemediationSkipped"] * 2
    assert [w[3]["lastRemediation"]["action"] for w in writes
            if w[0] == "patch_vlmd_status"] == ["Skipped"]
    assert metric(REMEDIATIONS_SKIPPED, NS, "held", "min_available") == before + 1
    (report,) = [r for r in rem.reports(NS, "held") if r.type == "Remediating"]
    assert (report.status, report.reason) == ("True", "WaitingForCapacity")
    rem._decide(NS, "held", owner, list(owner.open))  # held again: told once
    assert len(kube.writes()) == len(writes)


def test_a_replace_takes_its_steps_in_order():
    kube = FakeKube()
    kube.add_vlmd(NS, "rep", replicas=1)
    kube.add_pod(NS, "sick", owner="rep")
    published = []
    rem = remediator(kube, published, replica_fits=lambda vlmd, pending: True)
    rem.incident(NS, "rep", storm("uid-sick", "sick"))
    record = parse_in_flight(kube.vlmds[(NS, "rep")]["metadata"]["annotations"])["uid-sick"]
    assert (record.action, record.surge) == (Action.REPLACE, True)
    assert not [c for c in kube.calls if c[0] == "delete"]  # a replacement comes first
    step = stepper(rem, "rep", "uid-sick")

    written = len(kube.writes())
    assert not step()  # no replacement yet: waits
    assert len(kube.writes()) == written
    kube.add_pod(NS, "new", owner="rep")
    assert not step()  # the replacement serves: the sick pod is taken out to drain
    assert not step()  # the drain's first seconds always pass
    annotations = kube.vlmds[(NS, "rep")]["metadata"]["annotations"]
    drained = parse_in_flight(annotations)["uid-sick"]
    assert drained.replacement == "uid-new" and drained.drain_since is not None
    annotations[IN_FLIGHT] = in_flight_value({"uid-sick": dataclasses.replace(
        drained, drain_since=drained.drain_since - steps.DRAIN_MIN_S - 1)})
    assert not step()  # idle: deleted
    assert step()  # gone: the action ends
    assert parse_in_flight(kube.vlmds[(NS, "rep")]["metadata"]["annotations"]) == {}
    acts = [(c[0], c[3] if c[0] != "delete" else c[4]) for c in kube.writes()
            if c[0] in ("delete", "patch_pod") or (c[0] == "post_event" and c[1] == "Pod")]
    assert acts == [
        ("post_event", "PodReplacing"),
        ("patch_pod", {children.IN_SERVICE_LABEL: "false"}),
        ("delete", stopping.QUICK_GRACE_S),
        ("post_event", "PodReplaced"),
    ]
    assert [c[3] for c in kube.calls if c[0] == "delete"] == ["sick"]
    assert [p["metadata"]["name"] for p in kube.pods[NS]] == ["new"]
    assert [c[3] for c in kube.writes() if c[0] == "post_event" and c[1] == "VLMDeployment"
            and c[3] == "PodReplaced"] == ["PodReplaced"]  # said once, at the delete


def test_a_replace_whose_pod_another_hand_evicts_ends_with_one_pod_replaced_saying_so():
    """kubectl drain's eviction goes through once the replacement serves (the
    PodDisruptionBudget lets it), while the operator still drains the pod: the Replace ends
    without its delete, and its Event says how the pod left."""
    kube = FakeKube()
    kube.add_vlmd(NS, "rep", replicas=1)
    kube.add_pod(NS, "sick", owner="rep")
    rem = remediator(kube, [], replica_fits=lambda vlmd, pending: True)
    rem.incident(NS, "rep", storm("uid-sick", "sick"))
    step = stepper(rem, "rep", "uid-sick")
    kube.add_pod(NS, "new", owner="rep")
    assert not step()  # the replacement serves: the sick pod is taken out to drain
    kube.pods[NS] = [p for p in kube.pods[NS] if p["metadata"]["name"] != "sick"]  # evicted
    assert step()
    assert not [c for c in kube.calls if c[0] == "delete"]
    (said,) = [(kind, text) for kind, reason, text in kube.messages if reason == "PodReplaced"]
    assert said == ("VLMDeployment", "sick left without the operator deleting it (evicted, as "
                    "by its node's drain, or deleted by another hand), once its replacement "
                    "served")


def test_a_scale_down_lowers_the_replicas_only_once_the_deployment_counts_its_pod_out(
        monkeypatch):
    """The pod is gone but the Deployment still counts it (the ReplicaSet's cache has not seen
    it go): lowering spec.replicas now would make the ReplicaSet remove a pod that serves. The
    replicas drop once the count agrees, and after steps.COUNTED_WAIT_S at the latest."""
    kube = FakeKube()
    kube.add_vlmd(NS, "down", replicas=3)
    for name in ("a", "b"):  # "c", drained and deleted, has left
        kube.add_pod(NS, name, owner="down")
    record = InFlight(Action.SCALE_DOWN, "c", "uid-c", "load", time.time() - 30,
                      time.time() - 30, 3)
    kube.vlmds[(NS, "down")]["metadata"]["annotations"][IN_FLIGHT] = in_flight_value(
        {"uid-c": record})
    published = []
    step = stepper(remediator(kube, published), "down", "uid-c")

    kube.counted[(NS, "down")] = 3
    assert not step() and not step()
    assert not [w for w in kube.writes() if w[0] in ("scale_vlmd", "patch_vlmd_annotations")]
    assert "uid-c" in parse_in_flight(kube.vlmds[(NS, "down")]["metadata"]["annotations"])
    kube.counted[(NS, "down")] = 2  # the ReplicaSet saw it go
    assert step()
    assert [w for w in kube.writes() if w[0] == "scale_vlmd"] == [
        ("scale_vlmd", NS, "down", 2)]
    assert parse_in_flight(kube.vlmds[(NS, "down")]["metadata"]["annotations"]) == {}
    assert published == ["down"]

    # a count that never agrees (kube-controller-manager down) holds the action only so long
    kube.vlmds[(NS, "down")]["metadata"]["annotations"][IN_FLIGHT] = in_flight_value(
        {"uid-c": dataclasses.replace(record, replicas=2)})
    kube.counted[(NS, "down")] = 3
    monkeypatch.setattr(steps, "COUNTED_WAIT_S", 0.0)
    assert step()
    assert [w[3] for w in kube.writes() if w[0] == "scale_vlmd"] == [2, 1]


def test_a_replace_keeps_its_surge_until_the_deployment_counts_the_sick_pod_out():
    kube = FakeKube()
    kube.add_vlmd(NS, "rep", replicas=1)
    kube.add_pod(NS, "new", owner="rep")  # the replacement; the sick pod was deleted
    record = InFlight(Action.REPLACE, "sick", "uid-sick", "tokenizer_retry", time.time() - 60,
                      time.time() - 60, 1, before=("uid-sick",), replacement="uid-new",
                      drain_since=time.time() - 20)
    annotations = kube.vlmds[(NS, "rep")]["metadata"]["annotations"]
    annotations[IN_FLIGHT] = in_flight_value({"uid-sick": record})
    published = []
    step = stepper(remediator(kube, published), "rep", "uid-sick")

    kube.counted[(NS, "rep")] = 2  # the sick pod and the replacement, as before the deletion
    assert not step()
    assert "uid-sick" in parse_in_flight(annotations) and not published  # the surge stays
    del kube.counted[(NS, "rep")]
    assert step()
    assert parse_in_flight(annotations) == {} and published == ["rep"]  # the surge ends


def test_the_remediator_is_what_each_part_takes_it_for():
    """The other parts see the Remediator only through narrow Protocols (context.py, and log
    watching's own): every member each names is there, so a rename on one side fails here,
    not in a cluster."""
    from vlm_operator.logs.watcher import Remediation
    from vlm_operator.remediation.context import ActionContext, Driver, Reporter, RoundTaker

    rem = remediator(FakeKube(), [])

    def members(protocol) -> set[str]:
        names = set()
        for cls in protocol.__mro__:
            if cls is object or cls.__name__ in ("Protocol", "Generic"):
                continue
            names |= set(getattr(cls, "__annotations__", {}))
            names |= {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
        return names

    assert members(ActionContext) >= {"kube", "owner", "write_in_flight", "drain_timeout_s"}
    assert members(Remediation) >= {"report", "post_event", "known", "stop"}
    for protocol in (ActionContext, Reporter, RoundTaker, Remediation):
        assert [m for m in sorted(members(protocol)) if not hasattr(rem, m)] == [], protocol
    assert [m for m in members(Driver) if not hasattr(rem.in_flight, m)] == []
