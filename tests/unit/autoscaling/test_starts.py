"""autoscaling/starts.py: how long replicas took to start, and when those still starting are
expected to serve."""

from __future__ import annotations

from vlm_operator.autoscaling import starts
from vlm_operator.k8s.pods import parse_time, rfc3339

T = parse_time("2027-01-15T08:00:00Z")


def pod(uid, created, ready_at=None, deleting=False):
    meta = {"name": f"p-{uid}", "uid": uid, "creationTimestamp": rfc3339(T + created)}
    if deleting:
        meta["deletionTimestamp"] = rfc3339(T + created + 1)
    cond = ({"type": "Ready", "status": "True", "lastTransitionTime": rfc3339(T + ready_at)}
            if ready_at is not None else {"type": "Ready", "status": "False"})
    return {"metadata": meta, "status": {"conditions": [cond]}}


def test_each_ready_pod_adds_its_start_once_and_only_the_last_are_kept():
    kept = starts.seen_starts((), [pod("a", 0, 110), pod("b", 10, None)])
    assert kept == (("a", 110.0),)
    assert starts.seen_starts(kept, [pod("a", 0, 110)]) == kept  # seen once
    many = kept
    for i in range(20):
        many = starts.seen_starts(many, [pod(f"x{i}", 0, 50 + i)])
    assert len(many) == starts.STARTS_KEPT and many[-1] == ("x19", 69.0)


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
