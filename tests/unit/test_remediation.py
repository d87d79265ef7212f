"""remediation.py: thresholds, windows, guards, budget, back-off, minAvailable, pod findings."""

from __future__ import annotations

import pytest

from vlm_operator import builders
from vlm_operator.remediation import (
    GUARDS,
    RESTART,
    SCALE_DOWN,
    PodView,
    Rule,
    Windows,
    backoff_s,
    budget_report,
    decide,
    pod_findings,
    pod_view,
    policy_from_spec,
    scale_down_replicas,
    unpatched_report,
)

NOW = 1_000_000.0


def policy(**health):
    return policy_from_spec({"health": health})


def pods(*spec):
    """'r' ready, 'n' not ready, 'd' deleting, 'x' engine dead, 'o' out of service."""
    return [PodView(f"p{i}", ready="r" in s or "x" in s, deleting="d" in s,
                    in_service="o" not in s, engine_dead="x" in s) for i, s in enumerate(spec)]


def run(pol=None, signature="tokenizer_retry", count=5, pod="p0", views=None, history=(),
        **kw):
    pol = pol or policy()
    _, rule = pol.rule_for(signature)
    return decide(pod=pod, signature=signature, rule=rule, count=count, incident_time=NOW,
                  now=NOW, pods=views if views is not None else pods("r", "r", "r"),
                  history=history, policy=pol, **kw)


def test_policy_defaults_and_mapping():
    pol = policy()
    assert pol.rule_for("tokenizer_retry") == ("tokenizerRetry", Rule(5, 60.0, RESTART))
    assert pol.rule_for("tokenizer_borrow_error")[0] == "tokenizerRetry"
    assert pol.rule_for("engine_dead") == ("engineDead", Rule(1, 60.0, RESTART))
    assert pol.rule_for("plugin_active") is None
    assert (pol.max_restarts_per_hour, pol.min_available) == (6, 1)
    custom = policy(engineDead={"threshold": 2, "windowSeconds": 30, "action": "ScaleDown"},
                    maxRestartsPerHour=1, minAvailable=0)
    assert custom.rule_for("engine_dead")[1] == Rule(2, 30.0, SCALE_DOWN)
    extra = policy_from_spec({"health": {"extraSignatures": [
        {"name": "cuda_oom", "regex": "CUDA out of memory", "action": "ScaleDown",
         "threshold": 2}]}})
    assert extra.rule_for("cuda_oom") == ("extra:cuda_oom", Rule(2, 60.0, SCALE_DOWN))
    assert extra.rule_for("engine_dead")[0] == "engineDead"


def test_window_slides_and_is_per_pod_and_key():
    w = Windows()
    assert [w.add("a", "k", t, 10) for t in (0, 1, 2)] == [1, 2, 3]
    assert w.add("b", "k", 2, 10) == 1
    assert w.add("a", "other", 2, 10) == 1
    assert w.add("a", "k", 10.5, 10) == 3  # 0 fell out ((0.5, 10.5])
    assert w.count("a", "k", 30, 10) == 0
    w.forget("a")
    assert w.add("a", "k", 31, 10) == 1


@pytest.mark.parametrize("count,threshold,reason", [
    (4, 5, "below_threshold"), (5, 5, "act"), (9, 5, "act"), (0, 1, "below_threshold")])
def test_threshold(count, threshold, reason):
    pol = policy(tokenizerRetry={"threshold": threshold})
    assert run(pol, count=count).reason == reason


@pytest.mark.parametrize("kw,views,history,reason", [
    ({}, pods("r", "r"), (), "act"),
    ({"acted_until": NOW}, pods("r", "r"), (), "already_acted"),
    ({"acted_until": NOW - 1}, pods("r", "r"), (), "act"),
    ({}, pods("rd", "r"), (), "in_progress"),
    ({}, pods("ro", "r"), (), "in_progress"),
    ({"backoff_until": NOW + 5}, pods("r", "r"), (), "backoff"),
    ({"backoff_until": NOW}, pods("r", "r"), (), "act"),
    ({}, pods("r", "r"), [NOW - 10 * i for i in range(6)], "budget_exhausted"),
    ({}, pods("r", "r"), [NOW - 3601 - i for i in range(6)], "act"),  # older than an hour
    ({}, pods("r"), (), "min_available"),  # the only ready pod
    ({}, pods("r", "n"), (), "min_available"),
    ({}, pods("r", "x"), (), "min_available"),  # a dead engine is no capacity
    ({}, pods("n", "r"), (), "act"),  # the target is not capacity: removing it costs nothing
    ({}, pods("x", "r"), (), "act"),
])
def test_guards(kw, views, history, reason):
    d = run(views=views, history=history, **kw)
    assert d.reason == reason
    assert d.act == (reason == "act")
    assert reason == "act" or reason in GUARDS


def test_engine_dead_confirmed_by_health():
    assert run(signature="engine_dead", count=1, health="ok").reason == "health_ok"
    for health in ("failing", "unreachable", None):
        assert run(signature="engine_dead", count=1, health=health).action == RESTART
    # health only vetoes engine death, never the tokenizer policy
    assert run(health="ok").action == RESTART


def test_ignore_and_scale_down_actions():
    assert run(policy(tokenizerRetry={"action": "Ignore"})).reason == "ignored"
    assert run(policy(tokenizerRetry={"action": "ScaleDown"})).action == SCALE_DOWN


def test_min_available_zero_allows_the_last_pod():
    assert run(policy(minAvailable=0), views=pods("r")).action == RESTART
    assert run(policy(minAvailable=3), views=pods("r", "r", "r")).reason == "min_available"


def test_storm_on_all_pods_never_goes_below_min_available():
    """Sequential decisions over a storm on every pod: each action removes capacity at once."""
    pol = policy(minAvailable=2, maxRestartsPerHour=100)
    views = pods("r", "r", "r", "r")
    acted = []
    for p in [v.name for v in views]:
        d = run(pol, pod=p, views=views)
        if d.act:
            acted.append(p)
            views = [PodView(v.name, v.ready, v.name == p or v.deleting) for v in views]
        assert sum(v.capacity for v in views) >= 2
    assert acted == ["p0", "p1"]


def test_budget_report():
    pol = policy(maxRestartsPerHour=2)
    assert budget_report([NOW - 5], NOW, pol) is None
    r = budget_report([NOW - 5, NOW - 100], NOW, pol)
    assert (r.type, r.status, r.reason) == ("Degraded", "True", "RestartBudgetExhausted")
    assert budget_report([NOW - 5, NOW - 4000], NOW, pol) is None
    assert policy(maxRestartsPerHour=0) and run(policy(maxRestartsPerHour=0)).reason == \
        "budget_exhausted"


def test_backoff_doubles_and_caps():
    assert [backoff_s(n) for n in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert backoff_s(30) == 600


@pytest.mark.parametrize("current,min_available,expected", [
    (3, 1, 2), (2, 1, 1), (1, 1, None), (1, 0, 0), (0, 0, None)])
def test_scale_down_replicas(current, min_available, expected):
    assert scale_down_replicas(current, min_available) == expected


def pod(name="p0", ready=True, since="2026-01-01T00:00:00Z", restarts=0, last=None,
        waiting=None, labels=None, deleting=False):
    cs = {"name": "vllm", "restartCount": restarts, "state": {"running": {}}}
    if last:
        cs["lastState"] = {"terminated": last}
    if waiting:
        cs["state"] = {"waiting": {"reason": waiting}}
    meta = {"name": name, "labels": labels or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                        "lastTransitionTime": since}],
        "containerStatuses": [cs]}}


T0 = 1767225600.0  # 2026-01-01T00:00:00Z


def test_pod_view():
    assert pod_view(pod()) == PodView("p0", True)
    assert not pod_view(pod(deleting=True)).capacity
    assert not pod_view(pod(labels={builders.IN_SERVICE_LABEL: "false"})).capacity
    assert not pod_view(pod(), engine_dead=True).capacity
    assert not pod_view(pod(ready=False)).capacity


def test_exit_zero_after_engine_death_is_a_finding():
    last = {"exitCode": 0, "finishedAt": "2026-01-01T00:00:10Z"}
    (f,) = pod_findings(pod(last=last, restarts=1), now=T0 + 20, engine_dead_at=T0 + 5,
                        plugin="active")
    assert f.kind == "ExitedAfterEngineDeath" and "code 0" in f.message
    # an exit before the death line, or with no death seen, is not this finding
    assert pod_findings(pod(last=last), now=T0 + 20, engine_dead_at=T0 + 11,
                        plugin="active") == []
    assert pod_findings(pod(last=last), now=T0 + 20, engine_dead_at=None, plugin="active") == []


def test_crashloop_finding():
    (f,) = pod_findings(pod(ready=False, waiting="CrashLoopBackOff", restarts=4), now=T0,
                        engine_dead_at=None, plugin=None)
    assert f.kind == "CrashLoopBackOff" and f.key == "p0/crashloop"


@pytest.mark.parametrize("ready,age,plugin,unpatched", [
    (True, 61, None, True),
    (True, 59, None, False),  # within the grace period
    (False, 600, None, False),  # not ready yet: the line may still come
    (True, 600, "active", False),
    (True, 1, "inactive: reason=HfRenderer not found", True),
])
def test_unpatched(ready, age, plugin, unpatched):
    found = pod_findings(pod(ready=ready), now=T0 + age, engine_dead_at=None, plugin=plugin)
    assert any(f.kind == "Unpatched" for f in found) == unpatched
    report = unpatched_report({"p0": found})
    assert report.type == "Unpatched" and report.status == ("True" if unpatched else "False")


def test_unpatched_report_needs_pods():
    assert unpatched_report({}) is None
