"""peering.may_act: kopf's pause rule, read from the peering object's status."""

import datetime as dt

from kopf._core.engines.peering import Peer  # the writer of the status format we read

from vlm_operator.k8s.peering import get_identity, may_act

NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)


def status(**peers):
    """{identity: kopf's own serialization of a peer} for (priority, seconds since seen)."""
    out = {}
    for identity, (priority, age) in peers.items():
        peer = Peer(identity=identity, priority=priority, lifetime=60,
                    lastseen=(NOW - dt.timedelta(seconds=age)).isoformat())
        out[identity] = peer.as_dict()
    return out


def test_alone_or_highest_acts():
    assert may_act({}, "me", 0, NOW)
    assert may_act(status(me=(5, 0)), "me", 5, NOW)
    assert may_act(status(me=(10, 0), other=(5, 1)), "me", 10, NOW)


def test_a_live_peer_of_higher_or_same_priority_pauses_us():
    assert not may_act(status(me=(5, 0), other=(10, 1)), "me", 5, NOW)
    assert not may_act(status(me=(5, 0), other=(5, 1)), "me", 5, NOW)  # kopf pauses both


def test_a_dead_peer_does_not_count():
    assert may_act(status(me=(5, 0), other=(10, 61)), "me", 5, NOW)
    assert not may_act(status(me=(5, 0), other=(10, 59)), "me", 5, NOW)


def test_an_unreadable_entry_means_do_not_act():
    assert not may_act({"other": {"priority": 10}}, "me", 5, NOW)
    assert not may_act({"other": {"lastseen": "yesterday"}}, "me", 5, NOW)
    assert not may_act({"other": "junk"}, "me", 5, NOW)


def test_identities_are_unique_per_start(monkeypatch):
    monkeypatch.setenv("POD_NAME", "vlm-operator-abc")
    a, b = get_identity(), get_identity()
    assert a.startswith("vlm-operator-abc/") and a != b
