"""remediation/guards.py: where pods stand, capacity, minAvailable, node drains, the restart
budget."""

from __future__ import annotations

import pytest

from vlm_operator.api.actions import Action
from vlm_operator.desired import children
from vlm_operator.remediation.guards import (
    Standing,
    budget_report,
    needs_replacement,
    node_drain_action,
    standing,
)
from vlm_operator.remediation.steps import (
    Step,
)

from .builders import NOW, pod, pods, policy, run


def test_needs_replacement():
    pol = policy(minAvailable=2)
    assert needs_replacement(pods("r", "r"), "p0", pol)
    assert not needs_replacement(pods("r", "r", "r"), "p0", pol)
    assert not needs_replacement(pods("x", "r"), "p0", pol)  # serves nothing
    assert not needs_replacement(pods("r"), "gone", pol)
    # a stalled engine or a mute API server is ready by its probes but serves nothing
    for signature in ("engine_stalled", "api_unresponsive"):
        assert not needs_replacement(pods("r", "r"), "p0", pol, signature)
        assert run(signature=signature, count=1, standings=pods("r")).action == Action.RESTART


def test_budget_report():
    pol = policy(maxRestartsPerHour=2)
    assert budget_report([NOW - 5], NOW, pol) is None
    r = budget_report([NOW - 5, NOW - 100], NOW, pol)
    assert (r.type, r.status, r.reason) == ("Degraded", "True", "RestartBudgetExhausted")
    assert budget_report([NOW - 5, NOW - 4000], NOW, pol) is None
    assert policy(maxRestartsPerHour=0) and run(policy(maxRestartsPerHour=0)).reason == \
        "budget_exhausted"


def one(name, ready=True, in_service=True, deleting=False, engine_dead=False, in_flight=False):
    return Standing(name, ready, deleting, in_service, engine_dead, in_flight)


def test_a_pod_another_action_removes_is_no_capacity_for_a_second_removal():
    """Two sick pods, minAvailable 2, one replacement ready for the first: the second may not
    take that replacement for spare capacity and go too."""
    pods_ = [one("a", in_flight=True), one("b"), one("replacement-of-a")]
    assert needs_replacement(pods_, "b", policy(minAvailable=2))
    assert not needs_replacement([*pods_, one("spare")], "b", policy(minAvailable=2))


@pytest.mark.parametrize("target,others,min_available,always_allow,action", [
    # the only replica serves: its eviction breaks minAvailable: replaced first
    (one("a"), [], 1, False, Action.REPLACE),
    (one("a"), [one("b")], 1, False, None),  # the budget lets its eviction through
    (one("a"), [one("b")], 2, False, Action.REPLACE),
    (one("a"), [one("b", ready=False)], 1, False, Action.REPLACE),
    (one("a", deleting=True), [], 1, False, None),  # going already
    (one("a", in_service=False), [], 1, False, None),  # another action drains it
    # it serves nothing: deleted when the budget would refuse its eviction (not ready, too
    # few others ready) and the apiserver has no unhealthyPodEvictionPolicy to let it through
    (one("a", ready=False), [], 1, False, Step.DELETE),
    (one("a", ready=False), [], 1, True, None),
    (one("a", ready=False), [one("b")], 1, False, None),
    (one("a", ready=False), [], 0, False, None),
])
def test_node_drain_action(target, others, min_available, always_allow, action):
    assert node_drain_action(target, [target, *others], policy(minAvailable=min_available),
                             always_allow) == action


def test_standing():
    assert standing(pod()) == Standing("p0", True)
    assert not standing(pod(deleting=True)).capacity
    out = standing(pod(labels={children.IN_SERVICE_LABEL: "false"}))
    assert not out.capacity and out.serves  # drained, not dead: its requests still finish
    assert not standing(pod(), engine_dead=True).capacity
    assert not standing(pod(ready=False)).capacity
