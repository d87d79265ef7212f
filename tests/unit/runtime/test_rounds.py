"""runtime/rounds.Rounds: one round per VLMDeployment lists its pods once (the watch-fed cache),
reads each running pod's /metrics once, and hands that one view to reachability, stall
detection, the Builtin autoscaler and the remediator; a VLMDeployment without pods has no round.
The cache and the scraper are in-memory fakes, the parts recording fakes (../fakes.py)."""

import pytest

from vlm_operator.api.actions import Action
from vlm_operator.podreads.reachability import PodReads
from vlm_operator.remediation import incidents
from vlm_operator.runtime.periodic import Periodic
from vlm_operator.runtime.rounds import Rounds
from vlm_operator.stalls.verdicts import PROGRESS_METRICS

from ..fakes import (
    NAMESPACE,
    FakeClusterCache,
    FakeScraper,
    RecordingAutoscaler,
    RecordingRemediator,
    RecordingStallWatch,
    counters,
    pod,
    vlmd_body,
)
from ..waiting import wait_until

BUILTIN = {"enabled": True, "minReplicas": 1, "maxReplicas": 4}


class Parts:
    """A Rounds wired to fakes, and the fakes to look at."""

    def __init__(self, pods=(), readings=None):
        self.cluster = FakeClusterCache(pods)
        self.scraper = FakeScraper(readings if readings is not None else (
            lambda name: counters(1)))
        self.stall_watch = RecordingStallWatch()
        self.autoscaler = RecordingAutoscaler()
        self.reads = PodReads()
        self.remediator = RecordingRemediator()
        self.rounds = Rounds(self.cluster, self.scraper, self.stall_watch, self.autoscaler,
                             self.reads, self.remediator)

    def work(self):
        """Everything a round did beyond asking the cache whether there are pods."""
        return ([c for c in self.cluster.calls if c[0] != "has_pods"] + self.scraper.calls
                + self.stall_watch.calls + self.autoscaler.calls + self.remediator.calls)


def deleting(p):
    p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return p


def test_one_round_hands_the_vlmds_own_pods_and_readings_to_each_part():
    pods = [pod("vl-0"), pod("vl-1"), pod("vl-2", running=False, ip=None),
            deleting(pod("vl-3")), pod("other-0", owner="other")]
    parts = Parts(pods)
    body = vlmd_body("vl", autoscaling=BUILTIN)
    parts.rounds.tick(body)
    # listed once, by the VLMDeployment's selector
    assert [c[0] for c in parts.cluster.calls] == ["list_pods"]
    # read once: its running pods only, for stall detection's counters and the scaling metric
    (scrape,) = parts.scraper.calls
    _, owner, scraped, names = scrape
    assert owner == (NAMESPACE, "vl") and scraped == ("vl-0", "vl-1")
    assert set(PROGRESS_METRICS) <= names and "vllm:num_requests_waiting" in names
    # the same view for stall detection and the autoscaler: pods not being deleted
    assert parts.stall_watch.calls == [("observe", "vl", ("vl-0", "vl-1", "vl-2"),
                                        ("vl-0", "vl-1"))]
    assert parts.autoscaler.calls == [("tick", "vl", ("vl-0", "vl-1", "vl-2"),
                                       ("vl-0", "vl-1"))]
    # the remediator sees every listed pod, the leaving one too (node drains, replacements)
    assert parts.remediator.calls == [("round", "vl", ("vl-0", "vl-1", "vl-2", "vl-3"))]
    assert parts.reads.tracks(NAMESPACE, "vl")


def test_without_builtin_autoscaling_the_autoscaler_forgets_instead_of_ticking():
    parts = Parts([pod("vl-0")])
    for autoscaling in (None, {**BUILTIN, "mode": "HPA"}, {**BUILTIN, "enabled": False}):
        spec = {"autoscaling": autoscaling} if autoscaling else {}
        parts.rounds.tick(vlmd_body("vl", **spec))
    assert parts.autoscaler.calls == [("forget", NAMESPACE, "vl")] * 3
    assert [c[0] for c in parts.stall_watch.calls] == ["observe"] * 3
    # nothing read for a metric no one scales on
    assert all("vllm:num_requests_waiting" not in c[3] for c in parts.scraper.calls)


def test_each_vlmds_round_concerns_its_own_pods():
    parts = Parts([pod("a-0", owner="a"), pod("b-0", owner="b"), pod("b-1", owner="b")])
    parts.rounds.tick(vlmd_body("a", autoscaling=BUILTIN))
    parts.rounds.tick(vlmd_body("b", autoscaling=BUILTIN))
    assert [c[1:3] for c in parts.stall_watch.calls] == [("a", ("a-0",)), ("b", ("b-0", "b-1"))]
    assert [c[1:3] for c in parts.autoscaler.calls] == [("a", ("a-0",)), ("b", ("b-0", "b-1"))]
    assert [c[1] for c in parts.scraper.calls] == [(NAMESPACE, "a"), (NAMESPACE, "b")]


def test_an_invalid_spec_has_no_round():
    parts = Parts([pod("vl-0")])
    parts.rounds.tick(vlmd_body("vl", replicas=-1))
    assert parts.work() == []


@pytest.mark.parametrize("spec", [{}, {"autoscaling": BUILTIN, "replicas": 1}])
def test_a_vlmd_without_pods_has_no_round(spec):
    parts = Parts([pod("other-0", owner="other")])
    assert not parts.rounds.due(vlmd_body("vl", **spec))
    assert parts.cluster.calls == [("has_pods", NAMESPACE, "vl")]  # one cache lookup, no list
    assert parts.work() == []
    assert parts.rounds.due(vlmd_body("other"))


def test_a_round_is_due_only_with_something_to_do():
    """Pods, or a cache that cannot say yet (the round then says what is wrong), or a Builtin
    VLMDeployment below minReplicas (it scales up), or an action in flight to drive, pods or
    not (a standby taking over); pods that went: test_pods_that_went_get_one_more_round...."""
    parts = Parts([pod("vl-0")])
    assert parts.rounds.due(vlmd_body("vl"))
    parts.cluster.unknown.add((NAMESPACE, "empty"))
    assert parts.rounds.due(vlmd_body("empty"))
    parts.cluster.unknown.clear()
    assert not parts.rounds.due(vlmd_body("empty", replicas=0))
    builtin = {"enabled": True, "minReplicas": 1, "maxReplicas": 3}
    assert parts.rounds.due(vlmd_body("empty", replicas=0, autoscaling=builtin))
    assert not parts.rounds.due(vlmd_body("empty", replicas=0,
                                          autoscaling={**builtin, "minReplicas": 0}))
    driven = vlmd_body("empty", replicas=0)
    record = incidents.InFlight(Action.SCALE_DOWN, "empty-1", "u1", "tokenizer_retry", 1.0,
                                1.0, 2)
    driven["metadata"]["annotations"] = {
        incidents.IN_FLIGHT: incidents.in_flight_value({"u1": record})}
    assert parts.rounds.due(driven)
    assert parts.work() == []  # deciding costs no list and no scrape


def test_periodic_runs_rounds_only_for_vlmds_with_pods():
    """Wired as runner.py wires them: the podless VLMDeployment takes no round worker, no
    list, no scrape, and the parts never hear of it."""
    parts = Parts([pod("busy-0", owner="busy")])
    periodic = Periodic(tick=parts.rounds.tick, due=parts.rounds.due,
                        resync=lambda ns, name: None, forget=parts.rounds.forget,
                        round_s=0.02, resync_s=60).start()
    try:
        periodic.track(vlmd_body("busy", autoscaling=BUILTIN))
        periodic.track(vlmd_body("empty", autoscaling=BUILTIN))
        wait_until(lambda: len(parts.autoscaler.calls) >= 3)
    finally:
        periodic.stop()
    assert {c[1] for c in parts.scraper.calls} == {(NAMESPACE, "busy")}
    assert {c[1] for c in parts.stall_watch.calls + parts.autoscaler.calls} == {"busy"}
    assert {c[1] for c in parts.remediator.calls} == {"busy"}
    assert not [c for c in parts.cluster.calls if c[0] == "list_pods" and "empty" in c[2]]


def test_pods_that_went_get_one_more_round_to_clear_their_state():
    parts = Parts([pod("vl-0")])
    body = vlmd_body("vl")
    parts.rounds.tick(body)
    assert parts.reads.tracks(NAMESPACE, "vl")
    parts.cluster.pods = []
    assert parts.rounds.due(body)  # what reachability holds must be cleared
    parts.rounds.tick(body)
    assert not parts.reads.tracks(NAMESPACE, "vl") and not parts.rounds.due(body)


def test_forget_reaches_every_part():
    parts = Parts()
    parts.rounds.forget(NAMESPACE, "vl")
    assert parts.stall_watch.calls == parts.autoscaler.calls == [("forget", NAMESPACE, "vl")]
