"""remediation/decide.py: thresholds, windows, guards, budget, back-off, minAvailable, replacement,
the steps of actions in flight, pod findings and reports."""

from __future__ import annotations

import pytest

from vlm_operator.desired import children
from vlm_operator.remediation.decide import (
    ABANDON,
    DELETE,
    DROP,
    FINISH,
    GIVE_UP,
    GUARDS,
    LET_GO,
    RESTART,
    SCALE_DOWN,
    SURGE,
    TAKE_OUT,
    UNSCHEDULABLE_S,
    WAIT,
    PodView,
    Rule,
    backoff_s,
    budget_report,
    decide,
    lowered_replicas,
    needs_replacement,
    node_drain_action,
    pod_findings,
    pod_view,
    policy_from_spec,
    remediating_report,
    replace_step,
    scale_down_replicas,
    scale_down_step,
    unpatched_report,
)
from vlm_operator.remediation.incidents import NODE_DRAIN, REPLACE, Incident, InFlight

NOW = 1_000_000.0


def policy(**health):
    return policy_from_spec({"health": health})


def pods(*spec):
    """'r' ready, 'n' not ready, 'd' deleting, 'x' engine dead, 'o' out of service,
    'f' an action in flight on it."""
    return [PodView(f"p{i}", ready="r" in s or "x" in s, deleting="d" in s,
                    in_service="o" not in s, engine_dead="x" in s, in_flight="f" in s)
            for i, s in enumerate(spec)]


def incident(pod="p0", signature="tokenizer_retry", count=5, last=NOW):
    key = {"engine_dead": "engineDead"}.get(signature, "tokenizerRetry")
    return Incident(f"uid-{pod}", pod, key, signature, last - 1, last, count)


def run(pol=None, signature="tokenizer_retry", count=5, pod="p0", views=None, history=(),
        last=NOW, **kw):
    pol = pol or policy()
    _, rule = pol.rule_for(signature)
    return decide(incident=incident(pod, signature, count, last), rule=rule, now=NOW,
                  pods=views if views is not None else pods("r", "r", "r"),
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
    # a stall or an unresponsive API server is one verdict: threshold 1
    assert pol.rule_for("engine_stalled") == ("engineStalled", Rule(1, 60.0, RESTART))
    assert pol.rule_for("api_unresponsive") == ("apiUnresponsive", Rule(1, 60.0, RESTART))
    slow = policy(engineStalled={"stallSeconds": 120, "action": "ScaleDown"})
    assert slow.rule_for("engine_stalled")[1] == Rule(1, 240.0, SCALE_DOWN)


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
def test_guards(kw, views, history, reason):
    d = run(views=views, history=history, **kw)
    assert d.reason == reason
    assert d.act == (reason == "act")
    assert reason == "act" or reason in GUARDS


def test_every_replica_dead_at_once_restarts_each_with_the_default_spec():
    """The worst outage: no capacity anywhere, so minAvailable (default 1) holds nothing."""
    views = pods("x", "x", "x")
    acted = []
    for p in [v.name for v in views]:
        d = run(signature="engine_dead", count=1, pod=p, views=views)
        assert d.action == RESTART, d.message
        acted.append(p)
        views = [PodView(v.name, v.ready, v.name == p or v.deleting, engine_dead=True)
                 for v in views]
    assert acted == ["p0", "p1", "p2"]


def test_last_serving_replica_is_replaced_when_a_gpu_is_free():
    d = run(views=pods("r"), spare_gpus=True)
    assert d.action == REPLACE and "replacement comes up first" in d.message
    held = run(views=pods("r"), spare_gpus=False)
    assert held.reason == "min_available" and "no GPU is free" in held.message
    assert held.holds
    unknown = run(views=pods("r"), spare_gpus=None)
    assert unknown.reason == "min_available" and "could not be read" in unknown.message
    # ScaleDown on the last serving replica is replaced too: capacity must not drop
    assert run(policy(tokenizerRetry={"action": "ScaleDown"}), views=pods("r"),
               spare_gpus=True).action == REPLACE


def test_needs_replacement():
    pol = policy(minAvailable=2)
    assert needs_replacement(pods("r", "r"), "p0", pol)
    assert not needs_replacement(pods("r", "r", "r"), "p0", pol)
    assert not needs_replacement(pods("x", "r"), "p0", pol)  # serves nothing
    assert not needs_replacement(pods("r"), "gone", pol)
    # a stalled engine or a mute API server is ready by its probes but serves nothing
    for signature in ("engine_stalled", "api_unresponsive"):
        assert not needs_replacement(pods("r", "r"), "p0", pol, signature)
        assert run(signature=signature, count=1, views=pods("r")).action == RESTART


def test_incident_older_than_its_window_is_not_acted_on():
    """A standby taking over hours later replays the log: old lines must not act."""
    d = run(last=NOW - 3 * 3600)
    assert d.reason == "expired" and not d.act and not d.holds
    assert run(last=NOW - 59).act
    assert run(last=NOW - 60).reason == "expired"


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
        d = run(pol, pod=p, views=views, spare_gpus=False)
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


def record(action=SCALE_DOWN, replicas=3, since=NOW):
    return InFlight(action, "p0", "uid-p0", "tokenizer_retry", NOW - 5, since, replicas)


@pytest.mark.parametrize("kw,step", [
    ({"present": False, "serving": False, "running": None}, FINISH),
    ({"present": True, "serving": True, "running": 0, "now": NOW + 1}, WAIT),  # endpoints lag
    ({"present": True, "serving": True, "running": 0}, DELETE),
    ({"present": True, "serving": True, "running": 2}, WAIT),
    # unknown is not zero: an unreadable /metrics is waited out like a busy pod
    ({"present": True, "serving": True, "running": None}, WAIT),
    ({"present": True, "serving": True, "running": None, "now": NOW + 60}, DELETE),
    ({"present": True, "serving": True, "running": 2, "now": NOW + 60}, DELETE),
    ({"present": True, "serving": False, "running": None}, DELETE),  # container not running
])
def test_scale_down_step(kw, step):
    kw = {"since": NOW, "now": NOW + 5, **kw}
    assert scale_down_step(timeout_s=60, min_drain_s=2, **kw) == step


def replacing(**kw):
    return InFlight(REPLACE, "p0", "uid-p0", "tokenizer_retry", NOW - 5, NOW, 2, **kw)


def drain_record(**kw):
    return InFlight(REPLACE, "p0", "uid-p0", NODE_DRAIN, NOW, NOW, 1,
                    **{"surge": False, "node": "n1", "node_since": NOW, **kw})


@pytest.mark.parametrize("kw,step", [
    ({"present": False}, FINISH),
    ({}, WAIT),  # the replacement is not ready yet
    ({"others_ready": 1}, TAKE_OUT),  # it drains before it goes
    ({"serves": False}, DELETE),  # it serves nothing: nothing to wait for
    ({"now": NOW + 100}, GIVE_UP),
    ({"min_available": 2, "others_ready": 1}, WAIT),
    ({"min_available": 2, "others_ready": 2}, TAKE_OUT),
    # the scheduler refuses its own replacement: given up after UNSCHEDULABLE_S
    ({"unschedulable_s": UNSCHEDULABLE_S - 1}, WAIT),
    ({"unschedulable_s": UNSCHEDULABLE_S}, GIVE_UP),
    # another writer lowered spec.replicas: the ReplicaSet removes the replacement, so the
    # surge is abandoned at once (not waited on until the timeout)
    ({"replicas": 1}, ABANDON),
    ({"replicas": 3}, WAIT),  # raised: the surge survives
    ({"replicas": 1, "others_ready": 1}, TAKE_OUT),
    # out of the Service: requests finish first (the drain), never cut short
    ({"record": replacing(drain_since=NOW + 4), "running": 0}, WAIT),  # endpoints lag
    ({"record": replacing(drain_since=NOW), "running": 0}, DELETE),
    ({"record": replacing(drain_since=NOW), "running": 2}, WAIT),
    ({"record": replacing(drain_since=NOW), "running": None}, WAIT),  # unknown is not 0
    ({"record": replacing(drain_since=NOW), "running": 2, "now": NOW + 60}, DELETE),
    ({"record": replacing(drain_since=NOW), "serves": False}, DELETE),
    # a node drain: no surge while no GPU is free, let go after the wait whatever happened
    ({"record": drain_record(), "leaving": True, "spare_gpus": False}, WAIT),
    ({"record": drain_record(), "leaving": True, "spare_gpus": None}, WAIT),
    ({"record": drain_record(), "leaving": True, "spare_gpus": True}, SURGE),
    ({"record": drain_record(tried=True), "leaving": True, "spare_gpus": True}, WAIT),
    ({"record": drain_record(), "leaving": False, "spare_gpus": True}, DROP),
    ({"record": drain_record(), "leaving": True, "others_ready": 1}, DROP),
    ({"record": drain_record(), "leaving": True, "now": NOW + 30}, LET_GO),
    ({"record": replacing(node="n1", node_since=NOW - 30), "leaving": True}, LET_GO),
    ({"record": drain_record(), "leaving": True, "now": NOW + 30, "serves": False}, DELETE),
])
def test_replace_step(kw, step):
    kw = {"record": replacing(), "present": True, "serves": True, "running": None,
          "others_ready": 0, "min_available": 1, "replacement_ready": False,
          "unschedulable_s": 0.0, "replicas": 2, "leaving": False, "spare_gpus": None,
          "now": NOW + 5, **kw}
    assert replace_step(timeout_s=100, drain_timeout_s=60, node_drain_wait_s=30,
                        min_drain_s=2, **kw) == step


def view(name, ready=True, in_service=True, deleting=False, engine_dead=False,
         in_flight=False):
    return PodView(name, ready, deleting, in_service, engine_dead, in_flight)


def test_a_pod_another_action_removes_is_no_capacity_for_a_second_removal():
    """Two sick pods, minAvailable 2, one replacement ready for the first: the second may not
    take that replacement for spare capacity and go too."""
    pods_ = [view("a", in_flight=True), view("b"), view("replacement-of-a")]
    assert needs_replacement(pods_, "b", policy(minAvailable=2))
    assert not needs_replacement([*pods_, view("spare")], "b", policy(minAvailable=2))


@pytest.mark.parametrize("target,others,min_available,always_allow,action", [
    # the only replica serves: its eviction breaks minAvailable: replaced first
    (view("a"), [], 1, False, REPLACE),
    (view("a"), [view("b")], 1, False, None),  # the budget lets its eviction through
    (view("a"), [view("b")], 2, False, REPLACE),
    (view("a"), [view("b", ready=False)], 1, False, REPLACE),
    (view("a", deleting=True), [], 1, False, None),  # going already
    (view("a", in_service=False), [], 1, False, None),  # another action drains it
    # it serves nothing: deleted when the budget would refuse its eviction (not ready, too
    # few others ready) and the apiserver has no unhealthyPodEvictionPolicy to let it through
    (view("a", ready=False), [], 1, False, DELETE),
    (view("a", ready=False), [], 1, True, None),
    (view("a", ready=False), [view("b")], 1, False, None),
    (view("a", ready=False), [], 0, False, None),
])
def test_node_drain_action(target, others, min_available, always_allow, action):
    assert node_drain_action(target, [target, *others], policy(minAvailable=min_available),
                             always_allow) == action


def test_lowered_replicas_only_from_the_count_the_drain_began_with():
    assert lowered_replicas(3, record(replicas=3), 1) == 2
    assert lowered_replicas(2, record(replicas=3), 1) is None  # already lowered (a restart)
    assert lowered_replicas(5, record(replicas=3), 1) is None  # the user scaled meanwhile
    assert lowered_replicas(1, record(replicas=1), 1) is None  # minAvailable


def test_remediating_report():
    idle = remediating_report({}, [])
    assert (idle.type, idle.status, idle.reason) == ("Remediating", "False", "NoOpenIncidents")
    r = remediating_report({"u": record(REPLACE)}, [])
    assert (r.status, r.reason) == ("True", "ReplacingPod") and "replacing p0" in r.message
    held = run(views=pods("r"), spare_gpus=False)
    r = remediating_report({}, [(incident(), held)])
    assert (r.status, r.reason) == ("True", "WaitingForCapacity")
    assert "no GPU is free" in r.message
    budget = run(history=[NOW - i for i in range(6)])
    assert remediating_report({}, [(incident(), budget)]).reason == "RestartBudgetExhausted"


def test_remediating_report_says_what_a_node_drain_waits_for():
    r = remediating_report({"u": drain_record()}, [], NOW + 10, node_drain_wait_s=30)
    assert (r.status, r.reason) == ("True", "WaitingForCapacity")
    assert "leaving node n1" in r.message and "let go in 20 s" in r.message
    r = remediating_report({"u": drain_record(surge=True)}, [], NOW)
    assert r.reason == "ReplacingPod" and "its node n1 is being drained" in r.message
    r = remediating_report({"u": drain_record(drain_since=NOW)}, [], NOW)
    assert r.reason == "DrainingPod" and "draining p0" in r.message


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
    out = pod_view(pod(labels={children.IN_SERVICE_LABEL: "false"}))
    assert not out.capacity and out.serves  # drained, not dead: its requests still finish
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


@pytest.mark.parametrize("age,plugin,log_off,log_unread,kind", [
    # a log with vLLM's header and no startup line: the plugin is missing
    (61, None, None, None, "Unpatched"),
    # no line in vLLM's format by then: the log cannot be read, which says nothing of the plugin
    (61, None, None, "no line in vLLM's log format was seen", "LogDetectionOff"),
    (59, None, None, "no line in vLLM's log format was seen", None),  # within the grace
    # a prefix that cannot be known: off at once
    (1, None, "its VLLM_LOGGING_PREFIX comes from valueFrom", None, "LogDetectionOff"),
    # an inactive line was read, so the log can be read: the plugin failed
    (1, "inactive: HfRenderer not found", None, None, "Unpatched"),
])
def test_an_unreadable_log_is_log_detection_off_never_unpatched(age, plugin, log_off,
                                                                log_unread, kind):
    from vlm_operator.remediation.decide import log_detection_report

    found = pod_findings(pod(), now=T0 + age, engine_dead_at=None, plugin=plugin,
                         log_off=log_off, log_unread=log_unread)
    assert [f.kind for f in found] == ([kind] if kind else [])
    report = log_detection_report({"p0": found})
    assert report.status == ("True" if kind == "LogDetectionOff" else "False")
    if kind == "LogDetectionOff":
        assert report.reason == "LogUnreadable" and "p0: log detection off: " in report.message
        assert found[0].key == "p0/logoff/0"
    assert log_detection_report({}) is None


def test_the_startup_line_grace_counts_from_when_the_log_began_to_be_read():
    """A fresh operator process sees pods ready for hours before its followers have read a
    line: it reported them Unpatched (an Event each) at once, then took it back."""
    assert pod_findings(pod(), now=T0 + 3600, engine_dead_at=None, plugin=None,
                        reading_since=None) == []
    assert pod_findings(pod(), now=T0 + 3600, engine_dead_at=None, plugin=None,
                        reading_since=T0 + 3590) == []
    (f,) = pod_findings(pod(), now=T0 + 3600, engine_dead_at=None, plugin=None,
                        reading_since=T0 + 3500)
    assert f.kind == "Unpatched"


def test_an_action_ends_only_once_its_pod_has_left():
    """The replica count drops only once the deleted pod is gone (or long past its deadline):
    a ReplicaSet that has not seen the deletion would otherwise remove a pod that serves."""
    from vlm_operator.k8s.pods import parse_time
    from vlm_operator.remediation.decide import SETTLE_S, settled

    deadline = "2026-01-01T00:00:10Z"
    at = parse_time(deadline)
    terminating = {"metadata": {"name": "p", "deletionTimestamp": deadline}}
    assert settled(None, at)
    assert not settled(terminating, at - 5)
    assert not settled(terminating, at + SETTLE_S - 1)
    assert settled(terminating, at + SETTLE_S)
    assert not settled({"metadata": {"name": "p"}}, at + 3600)  # not deleted at all
