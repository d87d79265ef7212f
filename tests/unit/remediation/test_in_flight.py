"""remediation/in_flight.py: the actions recorded on a VLMDeployment are the tenant's to edit;
forged records cost one worker and a bounded number of API calls, and never touch a pod the
operator does not own."""

from __future__ import annotations

import json
import threading

import pytest

from vlm_operator.api.actions import Action
from vlm_operator.api.names import IN_FLIGHT
from vlm_operator.podreads import reader
from vlm_operator.remediation.in_flight import GONE_PER_PASS
from vlm_operator.remediation.incidents import MAX_IN_FLIGHT, in_flight_value, parse_in_flight
from vlm_operator.remediation.remediator import Remediator

from ..fakes import FakeKube
from ..waiting import wait_until

NS = "ml"


def forged(n: int, action: str = Action.REPLACE) -> str:
    """n records as a tenant can write them, about 75 bytes each (2,800: 209 KB)."""
    return json.dumps({f"forged-{i:05d}": {"action": action, "pod": f"p{i}", "incident": 1,
                                           "since": 1, "replicas": 1} for i in range(n)},
                      separators=(",", ":"))


def workers(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"in-flight {NS}/{name}"]


def test_forged_records_get_one_worker_however_many_and_however_often():
    """2,800 forged records made 2,774 threads after one round (52 s of CPU in 60 s)."""
    kube = FakeKube()
    kube.add_vlmd(NS, "att")["metadata"]["annotations"][IN_FLIGHT] = forged(2800)
    kube.add_pod(NS, "att-0", owner="att")
    rem = Remediator(kube, lambda ns, name: None, may_act=lambda ns: False)  # workers idle
    try:
        for _ in range(3):
            rem.round(kube.get_vlmd(NS, "att"), kube.list_pods(NS, "x=y"))
        assert len(workers("att")) == 1
    finally:
        rem.stop()
    wait_until(lambda: not workers("att"))


def test_each_pass_over_forged_records_is_bounded_and_says_once_what_it_dropped(monkeypatch):
    monkeypatch.setattr(reader, "requests_in_flight", lambda ip, *a, **kw: 0.0)
    kube = FakeKube()
    kube.add_vlmd(NS, "att", replicas=2)["metadata"]["annotations"][IN_FLIGHT] = forged(
        2800, Action.SCALE_DOWN)
    kube.add_pod(NS, "att-0", owner="att")
    rem = Remediator(kube, lambda ns, name: None)
    rem.stop()  # no thread: the test takes the worker's passes itself
    owner = rem.owner(NS, "att")
    passes = 0
    while True:
        calls = len(kube.calls)
        with owner.lock:
            left = rem.in_flight.steps(NS, "att", owner)
        passes += 1
        # each forged record names no pod of the VLMDeployment: it is finished, a few a pass
        assert len(kube.calls) - calls <= 3 + 8 * GONE_PER_PASS, kube.calls[calls:]
        if not left:
            break
    assert passes == MAX_IN_FLIGHT // GONE_PER_PASS
    assert parse_in_flight(kube.vlmds[(NS, "att")]["metadata"]["annotations"]) == {}
    dropped = [c for c in kube.calls if c[0] == "post_event" and c[3] == "InFlightRecordsDropped"]
    assert len(dropped) == 1  # told once, not once per record or per pass
    assert not [c for c in kube.calls if c[0] in ("delete", "patch_pod")]


def test_a_record_naming_a_pod_the_operator_does_not_own_never_touches_it(monkeypatch):
    """A pod labelled like the VLMDeployment's but whose owner chain does not lead to it (any
    tenant may create one): a record naming it is finished without a call on the pod."""
    monkeypatch.setattr(reader, "requests_in_flight", lambda ip, *a, **kw: 0.0)
    kube = FakeKube()
    body = kube.add_vlmd(NS, "vl", replicas=2)
    kube.add_pod(NS, "vl-0", owner="vl")
    other = kube.add_pod(NS, "impostor", owner="vl", owned=False)
    uid = other["metadata"]["uid"]
    body["metadata"]["annotations"][IN_FLIGHT] = json.dumps(
        {uid: {"action": Action.SCALE_DOWN, "pod": "impostor", "incident": 1, "since": 1,
               "replicas": 2}})
    rem = Remediator(kube, lambda ns, name: None)
    rem.stop()
    owner = rem.owner(NS, "vl")
    with owner.lock:
        assert not rem.in_flight.steps(NS, "vl", owner)
    assert not [c for c in kube.calls if c[0] in ("delete", "patch_pod")]
    assert other in kube.pods[NS]
    assert in_flight_value(parse_in_flight(body["metadata"]["annotations"])) is None


def test_an_unreadable_annotation_is_told_once_and_drives_nothing():
    kube = FakeKube()
    kube.add_vlmd(NS, "att")["metadata"]["annotations"][IN_FLIGHT] = "[" * 200_000
    rem = Remediator(kube, lambda ns, name: None)
    try:
        for _ in range(3):
            rem.round(kube.get_vlmd(NS, "att"), [])
        assert not workers("att")
        told = [c for c in kube.calls if c[0] == "post_event"]
        assert [c[3] for c in told] == ["InFlightRecordsDropped"]
    finally:
        rem.stop()


def test_a_record_of_an_action_this_operator_does_not_know_is_kept_told_once_and_not_driven():
    """A newer operator recorded an action this one lacks (a rollback): the record stays on the
    VLMDeployment through this operator's own writes, drives nothing, and is told once."""
    newer = {"action": "Migrate", "pod": "p1", "incident": 1, "since": 1, "replicas": 1,
             "target": "node-b"}
    kube = FakeKube()
    kube.add_vlmd(NS, "mix", replicas=2)["metadata"]["annotations"][IN_FLIGHT] = json.dumps(
        {"uid-p1": newer})
    kube.add_pod(NS, "p1", owner="mix")
    rem = Remediator(kube, lambda ns, name: None)
    rem.stop()
    try:
        for _ in range(3):
            rem.round(kube.get_vlmd(NS, "mix"), kube.list_pods(NS, "x=y"))
        assert not workers("mix")
        told = [c[3] for c in kube.calls if c[0] == "post_event"]
        assert told == ["InFlightActionUnknown"]
        (said,) = [m for _, reason, m in kube.messages if reason == "InFlightActionUnknown"]
        assert "(Migrate; it knows Replace, ScaleDown)" in said
        rem.write_in_flight(NS, "mix", rem.owner(NS, "mix"), add=next(iter(parse_in_flight(
            {IN_FLIGHT: forged(1, Action.SCALE_DOWN)}).values())))
        written = json.loads(kube.vlmds[(NS, "mix")]["metadata"]["annotations"][IN_FLIGHT])
        assert written["uid-p1"] == newer and set(written) == {"uid-p1", "forged-00000"}
    finally:
        rem.stop()


def test_a_recorded_action_the_driver_has_no_step_for_raises_instead_of_running_as_another(
        monkeypatch):
    """Were a new multi-step action recorded before its step existed, the driver says so; it
    never takes it for a Replace."""
    from vlm_operator.api import actions

    monkeypatch.setattr(actions, "MULTI_STEP", (*actions.MULTI_STEP, Action.RESTART))
    kube = FakeKube()
    kube.add_vlmd(NS, "new", replicas=2)["metadata"]["annotations"][IN_FLIGHT] = json.dumps(
        {"uid-p2": {"action": "Restart", "pod": "p2", "incident": 2, "since": 2,
                    "replicas": 2}})
    kube.add_pod(NS, "p2", owner="new")
    rem = Remediator(kube, lambda ns, name: None)
    rem.stop()
    owner = rem.owner(NS, "new")
    with owner.lock, pytest.raises(actions.UnknownAction, match="the in-flight record of p2"):
        rem.in_flight.step(NS, "new", owner, "uid-p2")
    assert not [c for c in kube.calls if c[0] in ("delete", "patch_pod", "scale_vlmd")]
