"""remediation/decide.py: thresholds, windows, guards, budget, back-off, minAvailable and
replacement in the one plan, and the Remediating report."""

from __future__ import annotations

import pytest

from vlm_operator.api.actions import Action
from vlm_operator.remediation.decide import (
    GUARDS,
    remediating_report,
)
from vlm_operator.remediation.guards import (
    Standing,
)

from .builders import NOW, drain_record, incident, pods, policy, record, run


@pytest.mark.parametrize("count,threshold,reason", [
    (4, 5, "below_threshold"), (5, 5, "act"), (9, 5, "act"), (0, 1, "below_threshold")])
def test_threshold(count, threshold, reason):
    pol = policy(tokenizerRetry={"threshold": threshold})
    assert run(pol, count=count).reason == reason


@pytest.mark.parametrize("kw,standings,history,reason", [
    ({}, pods("r", "r"), (), "act"),
    ({"acted_until": NOW}, pods("r", "r"), (), "already_acted"),
    ({"acted_until": NOW - 1}, pods("r", "r"), (), "act"),
    # logged before the current container started: the kubelet restarted it since; startedAt
    # has whole seconds, so a line in the second it names is the previous container's too
    ({"container_since": NOW + 1}, pods("r", "r"), (), "recovered_in_place"),
    ({"container_since": NOW}, pods("r", "r"), (), "recovered_in_place"),
    ({"container_since": NOW - 0.5}, pods("r", "r"), (), "recovered_in_place"),
    ({"container_since": NOW - 1}, pods("r", "r"), (), "act"),
    ({}, pods("rd", "r"), (), "in_progress"),
    ({}, pods("ro", "r"), (), "in_progress"),
    ({}, pods("rf", "r"), (), "in_progress"),  # being replaced or drained already
    ({"backoff_until": NOW + 5}, pods("r", "r"), (), "backoff"),
    ({"backoff_until": NOW}, pods("r", "r"), (), "act"),
    ({}, pods("r", "r"), [NOW - 10 * i for i in range(6)], "budget_exhausted"),
    ({}, pods("r", "r"), [NOW - 3601 - i for i in range(6)], "act"),  # older than an hour
    ({}, pods("r"), (), "min_available"),  # the only ready pod, no GPU known to be free
    ({"spare_gpus": False}, pods("r", "n"), (), "min_available"),
    ({}, pods("r", "x"), (), "min_available"),  # a dead engine is no capacity
    ({}, pods("n", "r"), (), "act"),  # the target is not capacity: removing it costs nothing
    ({}, pods("x", "r"), (), "act"),
    ({}, pods("x"), (), "act"),  # the single replica is dead: restart it (default spec)
    ({}, pods("n"), (), "act"),
])
def test_guards(kw, standings, history, reason):
    d = run(standings=standings, history=history, **kw)
    assert d.reason == reason
    assert d.act == (reason == "act")
    assert reason == "act" or reason in GUARDS


def test_every_replica_dead_at_once_restarts_each_with_the_default_spec():
    """The worst outage: no capacity anywhere, so minAvailable (default 1) holds nothing."""
    standings = pods("x", "x", "x")
    acted = []
    for p in [v.name for v in standings]:
        d = run(signature="engine_dead", count=1, pod=p, standings=standings)
        assert d.action == Action.RESTART, d.message
        acted.append(p)
        standings = [Standing(v.name, v.ready, v.name == p or v.deleting, engine_dead=True)
                 for v in standings]
    assert acted == ["p0", "p1", "p2"]


def test_last_serving_replica_is_replaced_when_a_gpu_is_free():
    d = run(standings=pods("r"), spare_gpus=True)
    assert d.action == Action.REPLACE and "replacement comes up first" in d.message
    held = run(standings=pods("r"), spare_gpus=False)
    assert held.reason == "min_available" and "no GPU is free" in held.message
    assert held.holds
    unknown = run(standings=pods("r"), spare_gpus=None)
    assert unknown.reason == "min_available" and "could not be read" in unknown.message
    # ScaleDown on the last serving replica is replaced too: capacity must not drop
    assert run(policy(tokenizerRetry={"action": "ScaleDown"}), standings=pods("r"),
               spare_gpus=True).action == Action.REPLACE


def test_incident_older_than_its_window_is_not_acted_on():
    """A standby taking over hours later replays the log: old lines must not act."""
    d = run(last=NOW - 3 * 3600)
    assert d.reason == "expired" and not d.act and not d.holds
    assert run(last=NOW - 59).act
    assert run(last=NOW - 60).reason == "expired"


def test_engine_dead_confirmed_by_health():
    assert run(signature="engine_dead", count=1, health="ok").reason == "health_ok"
    for health in ("failing", "unreachable", None):
        assert run(signature="engine_dead", count=1, health=health).action == Action.RESTART
    # health only vetoes engine death, never the tokenizer policy
    assert run(health="ok").action == Action.RESTART


def test_ignore_and_scale_down_actions():
    assert run(policy(tokenizerRetry={"action": "Ignore"})).reason == "ignored"
    assert run(policy(tokenizerRetry={"action": "ScaleDown"})).action == Action.SCALE_DOWN


def test_min_available_zero_allows_the_last_pod():
    assert run(policy(minAvailable=0), standings=pods("r")).action == Action.RESTART
    assert run(policy(minAvailable=3), standings=pods("r", "r", "r")).reason == "min_available"


def test_storm_on_all_pods_never_goes_below_min_available():
    """Sequential decisions over a storm on every pod: each action removes capacity at once."""
    pol = policy(minAvailable=2, maxRestartsPerHour=100)
    standings = pods("r", "r", "r", "r")
    acted = []
    for p in [v.name for v in standings]:
        d = run(pol, pod=p, standings=standings, spare_gpus=False)
        if d.act:
            acted.append(p)
            standings = [Standing(v.name, v.ready, v.name == p or v.deleting) for v in standings]
        assert sum(v.capacity for v in standings) >= 2
    assert acted == ["p0", "p1"]


def test_remediating_report():
    idle = remediating_report({}, [])
    assert (idle.type, idle.status, idle.reason) == ("Remediating", "False", "NoOpenIncidents")
    r = remediating_report({"u": record(Action.REPLACE)}, [])
    assert (r.status, r.reason) == ("True", "ReplacingPod") and "replacing p0" in r.message
    held = run(standings=pods("r"), spare_gpus=False)
    r = remediating_report({}, [(incident(), held)])
    assert (r.status, r.reason) == ("True", "WaitingForCapacity")
    assert "no GPU is free" in r.message
    budget = run(history=[NOW - i for i in range(6)])
    assert remediating_report({}, [(incident(), budget)]).reason == "RestartBudgetExhausted"


def test_a_surge_that_may_wait_for_a_new_node_says_so():
    plain = remediating_report({"u": record(Action.REPLACE)}, [])
    assert "node autoscaler" not in plain.message  # existing nodes only: 60 s, then given up
    r = remediating_report({"u": record(Action.REPLACE)}, [], unschedulable_limit_s=300.0)
    assert r.reason == "ReplacingPod"
    assert "up to 300 s for a node the node autoscaler adds" in r.message


def test_remediating_report_says_what_a_node_drain_waits_for():
    r = remediating_report({"u": drain_record()}, [], NOW + 10, node_drain_wait_s=30)
    assert (r.status, r.reason) == ("True", "WaitingForCapacity")
    assert "leaving node n1" in r.message and "let go in 20 s" in r.message
    r = remediating_report({"u": drain_record(surge=True)}, [], NOW)
    assert r.reason == "ReplacingPod" and "its node n1 is being drained" in r.message
    r = remediating_report({"u": drain_record(drain_since=NOW)}, [], NOW)
    assert r.reason == "DrainingPod" and "draining p0" in r.message
