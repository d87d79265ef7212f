"""remediation/drains.py and a node drain's Replace steps (remediation/in_flight.py), over the
shared fake Kube (tests/unit/fakes.py): what the operator does to the only serving replica of a
VLMDeployment (minAvailable 1) on a node that is cordoned, drained or uncordoned."""

from __future__ import annotations

import time

import pytest

from vlm_operator.api.actions import Action
from vlm_operator.k8s.informer import Stale
from vlm_operator.k8s.nodes import Leaving
from vlm_operator.podreads import reader
from vlm_operator.remediation import steps
from vlm_operator.remediation.incidents import (
    IN_FLIGHT,
    NODE_DRAIN,
    InFlight,
    in_flight_value,
    parse_in_flight,
)
from vlm_operator.remediation.remediator import Remediator

from ..fakes import FakeKube

NS = "ml"
CORDON = Leaving("cordoned (spec.unschedulable), no drain marker", False)
DRAIN = Leaving("drain marker example.com/maintenance, cordoned", True)


@pytest.fixture(autouse=True)
def no_pod_http(monkeypatch):
    """No pod is reached over HTTP: every drained pod idle."""
    monkeypatch.setattr(reader, "health", lambda ip, *a, **kw: None)
    monkeypatch.setattr(reader, "requests_in_flight", lambda ip, *a, **kw: 0.0)


class Bed:
    """One VLMDeployment "m" (1 replica, minAvailable 1), its pod "a" on node n1; `nodes`: what
    the node cache says is leaving (None: it cannot be read); `fits`: a GPU free elsewhere."""

    def __init__(self, nodes: dict | None, *, fits: bool = False, ready: bool = True,
                 wait_s: float = 30.0) -> None:
        self.kube = FakeKube()
        self.kube.add_vlmd(NS, "m", replicas=1)
        self.kube.add_pod(NS, "a", owner="m", node="n1", ready=ready)
        self.nodes, self.fits = nodes, fits
        self.rem = Remediator(self.kube, lambda ns, name: None,
                              replica_fits=lambda vlmd, pending: self.fits,
                              leaving_nodes=self.leaving, node_drain_wait_s=wait_s)
        self.rem.stop()  # no thread: the test takes the steps

    def leaving(self) -> dict:
        if self.nodes is None:
            raise Stale("nodes: no watch for 60 s")
        return self.nodes

    def round(self) -> None:
        self.rem.round(self.kube.vlmds[(NS, "m")], list(self.kube.pods[NS]))

    def step(self) -> bool:
        owner = self.rem.owner(NS, "m")
        with owner.lock:
            return self.rem.in_flight.step(NS, "m", owner, "uid-a")

    @property
    def records(self) -> dict[str, InFlight]:
        return parse_in_flight(self.kube.vlmds[(NS, "m")]["metadata"]["annotations"])

    def record(self, since: float | None = None, **kw) -> None:
        """a's node drain Replace, as a previous round wrote it (its surge began at since)."""
        now = time.time()
        record = InFlight(Action.REPLACE, "a", "uid-a", NODE_DRAIN, now, since or now, 1, node="n1",
                          **kw)
        self.kube.vlmds[(NS, "m")]["metadata"]["annotations"][IN_FLIGHT] = in_flight_value(
            {"uid-a": record})

    def acted(self) -> list[tuple]:
        """Writes to pod a: taken out of the Service, deleted."""
        return [c for c in self.kube.writes() if c[0] in ("patch_pod", "delete")
                and "a" in c]

    def events(self) -> list[str]:
        return [c[3] for c in self.kube.writes() if c[0] == "post_event" and c[1] == "Pod"]


def test_a_cordon_alone_never_lets_the_last_serving_replica_go():
    bed = Bed({"n1": CORDON}, wait_s=0.0)
    bed.round()
    (record,) = bed.records.values()
    assert (record.node, record.node_since, record.surge) == ("n1", None, False)
    assert bed.events() == ["NodeDrainHeld"]
    for _ in range(3):
        assert not bed.step()
    assert bed.acted() == [], "the only serving pod was taken out for a cordon alone"
    (report,) = [r for r in bed.rem.reports(NS, "m") if r.type == "Remediating"]
    assert report.reason == "WaitingForCapacity" and "cordon alone" in report.message

    # the drain's marker appears: its wait starts then, and ends with the pod let go
    bed.nodes = {"n1": DRAIN}
    bed.round()
    assert bed.records["uid-a"].node_since is not None
    time.sleep(0.002)  # node_since is kept rounded to the millisecond: maybe just ahead of now
    assert not bed.step()
    assert [c[0] for c in bed.acted()] == ["patch_pod"]  # out of the Service to drain
    assert "NodeDrainWaitExpired" in bed.events()


def test_a_pod_loading_on_a_cordoned_node_is_deleted_for_a_drain_only():
    bed = Bed({"n1": CORDON}, ready=False)
    bed.round()
    assert bed.acted() == [] and bed.records == {}
    bed.nodes = {"n1": DRAIN}
    bed.round()
    assert [c[0] for c in bed.acted()] == ["delete"] and bed.events() == ["NodeDrainReleased"]


def test_a_started_replacement_is_waited_for_past_the_drain_wait():
    """Capacity came late: the surge started 10 s ago, the drain wait (30 s) ended meanwhile;
    the replacement still loads. Letting the pod go now would leave nothing ready."""
    bed = Bed({"n1": DRAIN})
    now = time.time()
    bed.record(since=now - 10, surge=True, before=("uid-a",), node_since=now - 40)
    bed.kube.add_pod(NS, "new", owner="m", node="n2", ready=False)
    for _ in range(3):
        assert not bed.step()
    assert bed.acted() == [], "the only serving pod was let go while its replacement loads"
    assert bed.records["uid-a"].replacement == "uid-new"
    bed.kube.pods[NS][1]["status"]["conditions"][0]["status"] = "True"
    bed.kube.pods[NS][1]["status"]["containerStatuses"][0]["ready"] = True
    assert not bed.step()  # the replacement serves: now it goes, drained first
    assert [c[0] for c in bed.acted()] == ["patch_pod"]
    assert "NodeDrainWaitExpired" not in bed.events()


def test_a_replacement_that_never_serves_is_given_up_and_the_drain_finishes():
    bed = Bed({"n1": DRAIN})
    since = time.time() - steps.REPLACE_TIMEOUT_S - 1  # the startup budget is spent
    bed.record(since=since, surge=True, before=("uid-a",), node_since=since)
    assert not bed.step()  # given up: no surge any more, the drain wait is over
    assert bed.records["uid-a"].tried and not bed.records["uid-a"].surge
    assert not bed.step()
    assert [c[0] for c in bed.acted()] == ["patch_pod"]
    assert bed.events() == ["ReplaceFailed", "NodeDrainWaitExpired"]


def test_an_uncordon_cancels_a_node_drain_and_its_surge():
    bed = Bed({})  # uncordoned
    bed.record(surge=True, before=("uid-a",), node_since=time.time() - 40)
    bed.kube.add_pod(NS, "new", owner="m", node="n2", ready=False)
    assert bed.step()  # done: the record, and with it the surge, is gone
    assert bed.records == {} and bed.acted() == []
    assert bed.events() == ["NodeDrainCancelled"]


@pytest.mark.parametrize("surge", [False, True])
def test_an_unreadable_node_cache_is_not_an_uncordon(surge):
    bed = Bed(None)
    bed.record(surge=surge, before=("uid-a",) if surge else (), node_since=time.time() - 40)
    assert not bed.step() and not bed.step()
    assert "uid-a" in bed.records and bed.acted() == [] and bed.events() == []
