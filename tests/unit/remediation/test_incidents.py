"""remediation/incidents.py: windows in any order and counted once, incident ages, the restart
history as memory and annotation agree on it, and the in-flight records a fresh operator reads
back."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from vlm_operator.api.actions import Action
from vlm_operator.api.names import HISTORY, IN_FLIGHT
from vlm_operator.remediation.incidents import (
    MAX_HISTORY,
    MAX_IN_FLIGHT,
    InFlight,
    InFlightRead,
    Windows,
    acted_until,
    expired,
    history_value,
    in_flight_value,
    merged_history,
    note,
    parse_history,
    parse_in_flight,
    pending_claims,
    read_in_flight,
    replacements,
    restarts_in_hour,
    surge,
)

NOW = 1_700_000_000.123456


def test_window_slides_and_is_per_pod_and_key():
    w = Windows()
    assert [w.add("a", "k", t, 10) for t in (0, 1, 2)] == [1, 2, 3]
    assert w.add("b", "k", 2, 10) == 1
    assert w.add("a", "other", 2, 10) == 1
    assert w.add("a", "k", 10.5, 10) == 3  # 0 fell out ((0.5, 10.5])
    assert w.count("a", "k", 30, 10) == 0
    w.forget("a")
    assert w.add("a", "k", 31, 10) == 1


def test_window_counts_each_time_once_in_any_order():
    """A replayed log re-feeds lines already counted, and a previous container's log can
    arrive after the new one's: neither may push a count over its threshold early."""
    w = Windows()
    assert [w.add("a", "k", t, 60) for t in (10, 12, 11)] == [1, 2, 2]  # at 11: 10 and 11
    assert w.count("a", "k", 12, 60) == 3
    assert [w.add("a", "k", t, 60) for t in (10, 11, 12)] == [1, 2, 3]  # replay: no change
    assert w.count("a", "k", 12, 60) == 3


@given(st.lists(st.integers(0, 200), max_size=60), st.randoms())
def test_window_count_is_independent_of_arrival_order(times, rnd):
    shuffled = list(times)
    rnd.shuffle(shuffled)
    a, b = Windows(), Windows()
    for t in times:
        a.add("p", "k", float(t), 1000)
    for t in shuffled + shuffled:  # and twice over
        b.add("p", "k", float(t), 1000)
    assert a.count("p", "k", 200, 1000) == b.count("p", "k", 200, 1000) == len(set(times))


def test_incident_note_and_age():
    inc = note(None, uid="u", pod="p", key="k", signature="s", t=100.0, count=1)
    assert (inc.first, inc.last, inc.count) == (100.0, 100.0, 1)
    later = note(inc, uid="u", pod="p", key="k", signature="s", t=105.0, count=3)
    assert (later.first, later.last, later.count) == (100.0, 105.0, 3)
    assert note(later, uid="u", pod="p", key="k", signature="s", t=90.0, count=4) == later
    assert not expired(later, 164.9, 60) and expired(later, 165.0, 60)


def test_history_counts_each_restart_once():
    """Defect: the annotation kept round(t, 3) while memory kept t, and the union counted each
    restart twice (3 restarts spent a budget of 6)."""
    memory = merged_history([], [NOW, NOW + 10.000_4, NOW + 20.9], now=NOW + 30)
    annotation = history_value(memory)
    stored = parse_history(annotation)
    merged = merged_history(stored, memory, now=NOW + 30)
    assert len(merged) == 3 and restarts_in_hour(merged, NOW + 30) == 3
    assert merged_history(stored, memory, [NOW], now=NOW + 30) == merged


def test_history_drops_the_old_and_survives_bad_content():
    assert merged_history([NOW - 4000, NOW - 10], now=NOW) == [round(NOW - 10, 3)]
    assert parse_history("not json") == [] and parse_history('{"a": 1}') == []
    assert parse_history(None) == [] and parse_history('["x"]') == []


def rec(action=Action.SCALE_DOWN, uid="u1", pod="p1"):
    return InFlight(action, pod, uid, "tokenizer_retry", NOW - 3, NOW, 3)


def test_in_flight_round_trip_and_surge():
    records = {"u1": rec(), "u2": rec(Action.REPLACE, "u2", "p2"),
               "u3": rec(Action.REPLACE, "u3", "p3")}
    value = in_flight_value(records)
    assert parse_in_flight({IN_FLIGHT: value}) == records
    assert surge({IN_FLIGHT: value}) == 2
    assert in_flight_value({}) is None and parse_in_flight({}) == {} and surge(None) == 0


def test_in_flight_keeps_what_a_fresh_operator_needs():
    full = InFlight(Action.REPLACE, "p1", "u1", "node_drain", NOW, NOW, 2, surge=True,
                    before=("u1", "u2"), replacement="u9", tried=True, drain_since=NOW + 1,
                    node="n1", node_since=NOW - 5)
    waiting = InFlight(Action.REPLACE, "p2", "u2", "node_drain", NOW, NOW, 2, surge=False,
                       node="n1", node_since=NOW)
    records = {"u1": full, "u2": waiting}
    assert parse_in_flight({IN_FLIGHT: in_flight_value(records)}) == records
    assert surge({IN_FLIGHT: in_flight_value(records)}) == 1  # no surge while it waits
    # fields at their defaults are left out; records written before they existed read back
    # as a Replace with a surge and nothing else known
    old = json.dumps({"u3": {"action": Action.REPLACE, "pod": "p3", "incident": 1, "since": 2,
                             "replicas": 1, "signature": "tokenizer_retry"}})
    assert parse_in_flight({IN_FLIGHT: old}) == {
        "u3": InFlight(Action.REPLACE, "p3", "u3", "tokenizer_retry", 1.0, 2.0, 1)}
    assert "before" not in json.loads(in_flight_value({"u1": rec()}))["u1"]


def pod(uid, created="2026-01-01T00:00:00Z", node="n1", deleting=False, name=None):
    meta = {"uid": uid, "name": name or f"pod-{uid}", "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = created
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}}


def replacing(uid, since=NOW, before=("a", "b"), **kw):
    return InFlight(Action.REPLACE, f"pod-{uid}", uid, "tokenizer_retry", since, since, 2,
                    before=before, **kw)


def test_a_replacement_is_the_first_new_pod_no_other_surge_claimed():
    pods = [pod("a"), pod("b"), pod("x", "2026-01-01T00:00:05Z"),
            pod("y", "2026-01-01T00:00:03Z")]
    records = {"a": replacing("a"), "b": replacing("b", since=NOW + 1)}
    # the older surge takes the earliest-created new pod, the next one the next
    assert replacements(records, pods) == {"a": "y", "b": "x"}
    # a claim on the record stands while its pod exists, whatever the order
    records["b"] = replacing("b", since=NOW + 1, replacement="y")
    assert replacements(records, pods) == {"b": "y", "a": "x"}
    # a claimed pod that is gone or going frees its surge to claim the next new pod
    records = {"a": replacing("a", replacement="gone")}
    assert replacements(records, pods) == {"a": "y"}
    assert replacements(records, [pod("a"), pod("b"), pod("y", deleting=True)]) == {}
    # pods there when the surge began, ScaleDowns and waiting node drains claim nothing
    assert replacements({"a": replacing("a", before=("a", "b", "x", "y"))}, pods) == {}
    assert replacements({"a": rec(uid="a")}, pods) == {}
    assert replacements({"a": replacing("a", surge=False)}, pods) == {}


def test_pending_claims_are_unbound_pods_and_surges_not_made_yet():
    bound = [pod("a"), pod("b")]
    assert pending_claims({}, bound) == 0
    assert pending_claims({}, [*bound, pod("p", node=None)]) == 1
    assert pending_claims({}, [*bound, pod("p", node=None, deleting=True)]) == 0
    surging = {"a": replacing("a")}
    assert pending_claims(surging, bound) == 1  # the ReplicaSet has not made it yet
    assert pending_claims(surging, [*bound, pod("x", node=None)]) == 1  # made, not bound
    assert pending_claims(surging, [*bound, pod("x")]) == 0  # bound: it holds its GPU
    assert pending_claims({"a": replacing("a", surge=False)}, bound) == 0


def test_in_flight_ignores_what_it_cannot_read():
    assert parse_in_flight({IN_FLIGHT: "{"}) == {}
    bad = json.dumps({"u1": {"action": "Explode", "pod": "p", "incident": 1, "since": 1,
                             "replicas": 1},
                      "u2": {"pod": "p"},
                      "u3": {"action": Action.SCALE_DOWN, "pod": "p", "incident": 1, "since": 1,
                             "replicas": 2}})
    assert list(parse_in_flight({IN_FLIGHT: bad})) == ["u3"]


def test_acted_until_comes_from_the_action_in_flight():
    annotations = {IN_FLIGHT: in_flight_value({"u1": rec()}), HISTORY: "[]"}
    assert acted_until("u1", annotations) == NOW - 3
    assert acted_until("u2", annotations) is None
    assert acted_until("u1", None) is None


NESTED = ["[" * 200_000, "[" * 4096, "{" * 4096, '{"u1":' * 4096 + "1" + "}" * 4096]


def test_a_nested_annotation_reads_as_nothing_and_never_raises():
    """Python's parser recursed once per `[`: 200 KB of them raised RecursionError out of
    every reader of the annotation (a reconcile, the resync round)."""
    for raw in NESTED:
        assert parse_history(raw) == []
        assert parse_in_flight({IN_FLIGHT: raw}) == {}
        assert read_in_flight({IN_FLIGHT: raw}).unreadable
        assert surge({IN_FLIGHT: raw}) == 0 and acted_until("u1", {IN_FLIGHT: raw}) is None


def test_a_history_keeps_only_finite_times_and_at_most_its_cap():
    assert parse_history('[1.5, "x", null, "NaN", 1e999, [], 2]') == [1.5, 2.0]
    assert len(parse_history(json.dumps(list(range(5000))))) == MAX_HISTORY


def test_forged_in_flight_records_are_capped():
    """2,800 forged records (209 KB) made a thread and API calls each, every round."""
    forged = {f"uid-{i:05d}": {"action": Action.SCALE_DOWN, "pod": f"p{i}", "incident": 1,
                               "since": 1, "replicas": 1} for i in range(2800)}
    read = read_in_flight({IN_FLIGHT: json.dumps(forged, separators=(",", ":"))})
    assert len(read.records) == MAX_IN_FLIGHT and read.dropped == 2800 - MAX_IN_FLIGHT
    assert not read.unreadable
    assert list(read.records) == sorted(forged)[:MAX_IN_FLIGHT]
    assert read_in_flight({IN_FLIGHT: json.dumps([1])}).unreadable
    odd = {"u": {"action": "ScaleDown", "pod": "p", "incident": 1, "since": "NaN", "replicas": 1},
           "v": {"action": "ScaleDown", "pod": "p", "incident": 1, "since": 1, "replicas": 1e999},
           "w": {"action": "ScaleDown", "pod": "p", "incident": 1, "since": 1, "replicas": 1,
                 "before": "abc"}}
    assert read_in_flight({IN_FLIGHT: json.dumps(odd)}) == InFlightRead({}, dropped=3)
    fine = read_in_flight({IN_FLIGHT: in_flight_value({"u1": rec()})})
    assert fine == InFlightRead({"u1": rec()})
