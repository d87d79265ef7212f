"""remediation/steps.py: the next step of a ScaleDown or a Replace, and when a deleted pod has
left."""

from __future__ import annotations

import dataclasses

import pytest

from vlm_operator.api.actions import Action
from vlm_operator.remediation.incidents import InFlight
from vlm_operator.remediation.steps import (
    UNSCHEDULABLE_S,
    Step,
    lowered_replicas,
    replace_step,
    scale_down_replicas,
    scale_down_step,
)

from .builders import NOW, drain_record, record


@pytest.mark.parametrize("current,min_available,expected", [
    (3, 1, 2), (2, 1, 1), (1, 1, None), (1, 0, 0), (0, 0, None)])
def test_scale_down_replicas(current, min_available, expected):
    assert scale_down_replicas(current, min_available) == expected


@pytest.mark.parametrize("kw,step", [
    ({"present": False, "serving": False, "running": None}, Step.FINISH),
    ({"present": True, "serving": True, "running": 0, "now": NOW + 1}, Step.WAIT),  # endpoints lag
    ({"present": True, "serving": True, "running": 0}, Step.DELETE),
    ({"present": True, "serving": True, "running": 2}, Step.WAIT),
    # unknown is not zero: an unreadable /metrics is waited out like a busy pod
    ({"present": True, "serving": True, "running": None}, Step.WAIT),
    ({"present": True, "serving": True, "running": None, "now": NOW + 60}, Step.DELETE),
    ({"present": True, "serving": True, "running": 2, "now": NOW + 60}, Step.DELETE),
    ({"present": True, "serving": False, "running": None}, Step.DELETE),  # container not running
])
def test_scale_down_step(kw, step):
    kw = {"since": NOW, "now": NOW + 5, **kw}
    assert scale_down_step(timeout_s=60, min_drain_s=2, **kw) == step


def replacing(**kw):
    return InFlight(Action.REPLACE, "p0", "uid-p0", "tokenizer_retry", NOW - 5, NOW, 2, **kw)


@pytest.mark.parametrize("kw,step", [
    ({"present": False}, Step.FINISH),
    ({}, Step.WAIT),  # the replacement is not ready yet
    ({"others_ready": 1}, Step.TAKE_OUT),  # it drains before it goes
    ({"serves": False}, Step.DELETE),  # it serves nothing: nothing to wait for
    ({"now": NOW + 100}, Step.GIVE_UP),
    ({"min_available": 2, "others_ready": 1}, Step.WAIT),
    ({"min_available": 2, "others_ready": 2}, Step.TAKE_OUT),
    # the scheduler refuses its own replacement: given up after UNSCHEDULABLE_S
    ({"unschedulable_s": UNSCHEDULABLE_S - 1}, Step.WAIT),
    ({"unschedulable_s": UNSCHEDULABLE_S}, Step.GIVE_UP),
    # another writer lowered spec.replicas: the ReplicaSet removes the replacement, so the
    # surge is abandoned at once (not waited on until the timeout)
    ({"replicas": 1}, Step.ABANDON),
    ({"replicas": 3}, Step.WAIT),  # raised: the surge survives
    ({"replicas": 1, "others_ready": 1}, Step.TAKE_OUT),
    # out of the Service: requests finish first (the drain), never cut short
    ({"record": replacing(drain_since=NOW + 4), "running": 0}, Step.WAIT),  # endpoints lag
    ({"record": replacing(drain_since=NOW), "running": 0}, Step.DELETE),
    ({"record": replacing(drain_since=NOW), "running": 2}, Step.WAIT),
    ({"record": replacing(drain_since=NOW), "running": None}, Step.WAIT),  # unknown is not 0
    ({"record": replacing(drain_since=NOW), "running": 2, "now": NOW + 60}, Step.DELETE),
    ({"record": replacing(drain_since=NOW), "serves": False}, Step.DELETE),
    # a node drain: no surge while no GPU is free, let go after the wait when no replacement
    # is on its way
    ({"record": drain_record(), "spare_gpus": False}, Step.WAIT),
    ({"record": drain_record(), "spare_gpus": None}, Step.WAIT),
    ({"record": drain_record(), "spare_gpus": True}, Step.SURGE),
    ({"record": drain_record(tried=True), "spare_gpus": True}, Step.WAIT),
    ({"record": drain_record(), "leaving": False, "spare_gpus": True}, Step.DROP),
    ({"record": drain_record(), "others_ready": 1}, Step.DROP),
    ({"record": drain_record(), "now": NOW + 30}, Step.LET_GO),
    ({"record": drain_record(tried=True), "now": NOW + 30}, Step.LET_GO),  # its surge failed
    ({"record": replacing(node="n1", node_since=NOW - 30, surge=False)}, Step.LET_GO),
    ({"record": drain_record(), "now": NOW + 30, "serves": False}, Step.DELETE),
])
def test_replace_step(kw, step):
    assert step_of(**kw) == step


def step_of(**kw):
    """replace_step on p0 serving alone on n1 (minAvailable 1), its node showing a drain;
    timeout_s 100 (the startup budget), node_drain_wait_s 30."""
    kw = {"record": replacing(), "present": True, "serves": True, "running": None,
          "others_ready": 0, "min_available": 1, "replacement_ready": False,
          "unschedulable_s": 0.0, "replicas": 2, "leaving": True, "draining": True,
          "spare_gpus": None, "now": NOW + 5, **kw}
    return replace_step(timeout_s=100, drain_timeout_s=60, node_drain_wait_s=30,
                        min_drain_s=2, **kw)


# p0's node drain surged at NOW + 25, 5 s before its drain wait ends (capacity came late)
LATE = dataclasses.replace(drain_record(surge=True), since=NOW + 25)


@pytest.mark.parametrize("kw,step", [
    # a replacement on its way is waited for past the node drain wait: letting p0 go would
    # leave nothing ready
    ({"now": NOW + 40}, Step.WAIT),
    ({"now": NOW + 124}, Step.WAIT),
    ({"now": NOW + 40, "record": dataclasses.replace(LATE, since=NOW - 200)}, Step.GIVE_UP),
    # bounded by the startup budget (timeout_s from the surge), not the drain wait
    ({"now": NOW + 125}, Step.GIVE_UP),
    ({"now": NOW + 40, "unschedulable_s": UNSCHEDULABLE_S}, Step.GIVE_UP),
    ({"now": NOW + 40, "others_ready": 1, "replacement_ready": True}, Step.TAKE_OUT),
    # a sick pod's Replace on the draining node: its replacement is waited for the same way
    ({"now": NOW + 40, "record": replacing(node="n1", node_since=NOW)}, Step.WAIT),
])
def test_a_started_replacement_is_waited_for_past_the_node_drain_wait(kw, step):
    assert step_of(**{"record": LATE, **kw}) == step


@pytest.mark.parametrize("record", [drain_record(), LATE, drain_record(tried=True)])
def test_an_uncordon_cancels_a_node_drain(record):
    assert step_of(record=record, leaving=False, draining=False, now=NOW + 40) == Step.DROP
    # unknown is not "uncordoned": a node cache that cannot be read changes nothing
    assert step_of(record=record, leaving=None, draining=False, now=NOW + 40) == Step.WAIT


def test_an_uncordon_does_not_end_a_sick_pods_replace():
    record = replacing(node="n1", node_since=NOW)
    assert step_of(record=record, leaving=False, draining=False) == Step.WAIT
    assert step_of(record=record, leaving=False, draining=False, others_ready=1) == Step.TAKE_OUT


@pytest.mark.parametrize("record", [drain_record(), drain_record(node_since=None),
                                    drain_record(tried=True)])
def test_a_cordon_alone_never_lets_the_last_serving_replica_go(record):
    for now in (NOW + 30, NOW + 10_000):
        assert step_of(record=record, draining=False, spare_gpus=False, now=now) == Step.WAIT
    # a replacement that serves elsewhere still takes its place (no ready count lost)
    assert step_of(record=LATE, draining=False, others_ready=1, replacement_ready=True,
                   now=NOW + 10_000) == Step.TAKE_OUT
    # the drain's marker appears: its wait counts from then (node_since, noted by the glue)
    assert step_of(record=drain_record(node_since=NOW + 100), now=NOW + 110) == Step.WAIT


def test_lowered_replicas_only_from_the_count_the_drain_began_with():
    assert lowered_replicas(3, record(replicas=3), 1) == 2
    assert lowered_replicas(2, record(replicas=3), 1) is None  # already lowered (a restart)
    assert lowered_replicas(5, record(replicas=3), 1) is None  # the user scaled meanwhile
    assert lowered_replicas(1, record(replicas=1), 1) is None  # minAvailable


def test_an_action_ends_only_once_its_pod_has_left():
    """The replica count drops only once the deleted pod is gone (or long past its deadline):
    a ReplicaSet that has not seen the deletion would otherwise remove a pod that serves."""
    from vlm_operator.k8s.pods import parse_time
    from vlm_operator.remediation.steps import SETTLE_S, settled

    deadline = "2026-01-01T00:00:10Z"
    at = parse_time(deadline)
    terminating = {"metadata": {"name": "p", "deletionTimestamp": deadline}}
    assert settled(None, at)
    assert not settled(terminating, at - 5)
    assert not settled(terminating, at + SETTLE_S - 1)
    assert settled(terminating, at + SETTLE_S)
    assert not settled({"metadata": {"name": "p"}}, at + 3600)  # not deleted at all


def deployment(replicas: int, *, observed: int = 4, generation: int = 4) -> dict:
    return {"metadata": {"name": "vl", "generation": generation},
            "status": {"observedGeneration": observed, "replicas": replicas}}


@pytest.mark.parametrize("found, active, expected", [
    (deployment(2), 1, False),  # its controllers still count the pod that left
    (deployment(1), 1, True),  # they saw it go
    (deployment(2), 2, True),  # ... and the ReplicaSet already made a pod in its place
    (deployment(0), 1, True),
    (deployment(1, observed=3), 1, False),  # a status older than the spec says nothing
    ({"metadata": {"generation": 1}}, 1, False),  # no status yet
    (None, 1, True),  # no Deployment of ours: no ReplicaSet to remove the wrong pod
])
def test_replicas_drop_only_once_the_deployment_counts_the_pod_out(found, active, expected):
    from vlm_operator.remediation.steps import counted_out

    assert counted_out(found, active) is expected
