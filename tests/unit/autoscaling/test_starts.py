"""autoscaling/starts.py: how long replicas took to start, and when those still starting are
expected to serve."""

from __future__ import annotations

from vlm_operator.autoscaling import starts
from vlm_operator.k8s.pods import parse_time, rfc3339

T = parse_time("2027-01-15T08:00:00Z")


def pod(uid, created, ready_at=None, deleting=False, restarts=0, started=None):
    meta = {"name": f"p-{uid}", "uid": uid, "creationTimestamp": rfc3339(T + created)}
    if deleting:
        meta["deletionTimestamp"] = rfc3339(T + created + 1)
    cond = ({"type": "Ready", "status": "True", "lastTransitionTime": rfc3339(T + ready_at)}
            if ready_at is not None else {"type": "Ready", "status": "False"})
    container = {"name": "vllm", "restartCount": restarts,
                 "started": ready_at is not None if started is None else started}
    return {"metadata": meta, "status": {"conditions": [cond], "containerStatuses": [container]}}


def watched(*pods) -> starts.Starts:
    """The starts after a round that saw `pods` before their first Ready."""
    return starts.seen_starts(starts.Starts(), pods)


def test_each_start_watched_from_before_its_first_ready_is_counted_once():
    kept = starts.seen_starts(watched(pod("a", 0), pod("b", 10)),
                              [pod("a", 0, 110), pod("b", 10)])
    assert kept.seen == (("a", 110.0),) and kept.watching == {"b"}
    assert starts.seen_starts(kept, [pod("a", 0, 110)]).seen == kept.seen  # counted once
    many = kept
    for i in range(20):
        many = starts.seen_starts(starts.seen_starts(many, [pod(f"x{i}", 0)]),
                                  [pod(f"x{i}", 0, 50 + i)])
    assert len(many.seen) == starts.STARTS_KEPT and many.seen[-1] == ("x19", 69.0)
    assert not many.watching  # only the pods there are


def test_after_an_operator_restart_only_starts_it_can_date_count():
    """A fresh operator: 5 pods that flapped or restarted in place (their Ready transition days
    after their creation) are not starts; 3 real 2-minute starts it watched are. The expected
    ready time rests on those 3 only, not on the pods' ages."""
    day = 86400
    old = [pod(f"old{i}", 0, 3 * day + i, restarts=i % 2) for i in range(5)]
    new = [pod(f"new{i}", 3 * day + 10 * i) for i in range(3)]
    kept = starts.seen_starts(starts.Starts(), [*old, *new])  # the first round: nothing dated
    assert kept.seen == ()
    ready = [pod(f"new{i}", 3 * day + 10 * i, 3 * day + 10 * i + 120) for i in range(3)]
    kept = starts.seen_starts(kept, [*old, *ready])
    assert sorted(s for _, s in kept.seen) == [120.0, 120.0, 120.0]
    (entry,) = starts.pending_replicas([pod("n", 4 * day)], kept.seen)
    assert entry["expectedReadyTime"] == rfc3339(T + 4 * day + 120)
    # a watched pod that restarted in place before its first Ready: not a start either
    crashed = starts.seen_starts(watched(pod("c", 0)), [pod("c", 0, 300, restarts=1)])
    assert crashed.seen == ()
    # a container that started (startup probe passed) and is not Ready may have flapped
    assert not starts.before_first_ready(pod("f", 0, started=True))


def test_pending_replicas_are_expected_at_the_median_start_after_their_creation():
    kept = (("a", 100.0), ("b", 300.0), ("c", 110.0))  # median 110 s
    pending = starts.pending_replicas(
        [pod("n2", 60), pod("n1", 30), pod("ready", 0, 50), pod("gone", 5, deleting=True)], kept)
    assert [p["pod"] for p in pending] == ["p-n1", "p-n2"]  # oldest first
    assert pending[0]["since"] == rfc3339(T + 30)
    assert pending[0]["expectedReadyTime"] == rfc3339(T + 30 + 110)
    assert pending[0]["expected"] == "median start 110 s of the last 3 seen"


def test_no_start_seen_means_no_guess():
    (entry,) = starts.pending_replicas([pod("n", 0)], ())
    assert "expectedReadyTime" not in entry and entry["expected"].startswith("unknown")


def test_unreadable_times_are_no_start():
    bad = pod("a", 0, 10)
    bad["status"]["conditions"][0]["lastTransitionTime"] = "yesterday"
    assert starts.start_seconds(bad) is None
    earlier = pod("b", 100, 10)  # Ready before it was created: a clock skew, not a start
    assert starts.start_seconds(earlier) is None
