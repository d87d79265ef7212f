"""periodic.Periodic: a round and a resync for every object, gated by peering; a slow round
never holds the others."""

import threading
import time

import pytest

from vlm_operator.runtime.periodic import Periodic

from ..waiting import wait_until


def body(name, mode=None, ns="team"):
    spec = {"model": "m"}
    if mode:
        spec["autoscaling"] = {"enabled": True, "mode": mode}
    return {"metadata": {"namespace": ns, "name": name}, "spec": spec}


class Calls:
    def __init__(self):
        self.lock = threading.Lock()
        self.ticks, self.resyncs, self.forgotten = [], [], []

    def tick(self, b):
        with self.lock:
            self.ticks.append(b["metadata"]["name"])
        if b["metadata"]["name"] == "boom":
            raise RuntimeError("a failing round")

    def resync(self, ns, name):
        with self.lock:
            self.resyncs.append(name)

    def forget(self, ns, name):
        self.forgotten.append(name)



@pytest.fixture
def calls():
    return Calls()


def start(calls, **kw):
    return Periodic(tick=calls.tick, resync=calls.resync, forget=calls.forget,
                    round_s=0.02, resync_s=0.05, **kw).start()


def test_rounds_and_resyncs_for_all(calls):
    p = start(calls)
    try:
        for b in (body("auto", "Builtin"), body("hpa", "HPA"), body("plain"),
                  body("boom", "Builtin")):
            p.track(b)
        wait_until(lambda: all(calls.ticks.count(n) >= 3 for n in ("auto", "hpa", "plain"))
                   and calls.resyncs.count("plain") >= 2)
        assert "boom" in calls.ticks  # a failing round does not stop the loop
        assert {"auto", "hpa", "plain", "boom"} <= set(calls.resyncs)
        p.untrack("team", "auto")
        assert calls.forgotten == ["auto"]
        seen = calls.ticks.count("auto")
        wait_until(lambda: calls.ticks.count("boom") >= seen + 3)
        assert calls.ticks.count("auto") <= seen + 1  # at most a round already under way
    finally:
        p.stop()


def test_the_latest_body_counts():
    bodies = []
    p = Periodic(tick=bodies.append, resync=lambda ns, name: None,
                 forget=lambda ns, name: None, round_s=0.02, resync_s=60).start()
    try:
        p.track(body("x", "Builtin"))
        wait_until(lambda: bodies)
        p.track(body("x", "HPA"))  # autoscaling moved to an HPA
        wait_until(lambda: bodies[-1]["spec"]["autoscaling"]["mode"] == "HPA")
    finally:
        p.stop()


def test_a_slow_round_never_holds_the_others():
    """Every API call and scrape has a deadline, but a round may still be slow: the others go
    on every period, and the slow one is skipped (not queued) until it is done."""
    release = threading.Event()
    ticks = []

    def tick(b):
        ticks.append(b["metadata"]["name"])
        if b["metadata"]["name"] == "slow":
            release.wait(5)

    p = Periodic(tick=tick, resync=lambda ns, name: None, forget=lambda ns, name: None,
                 round_s=0.02, resync_s=60).start()
    try:
        p.track(body("slow"))
        p.track(body("fast"))
        wait_until(lambda: ticks.count("fast") >= 20)
        assert ticks.count("slow") == 1
        release.set()
        wait_until(lambda: ticks.count("slow") >= 2)
    finally:
        release.set()
        p.stop()


def test_a_paused_replica_neither_scales_nor_resyncs(calls):
    active = {"team": False}
    p = start(calls, may_act=lambda ns: active[ns])
    try:
        p.track(body("x", "Builtin"))
        time.sleep(0.3)
        assert calls.ticks == [] and calls.resyncs == []
        active["team"] = True
        wait_until(lambda: "x" in calls.ticks and "x" in calls.resyncs)
    finally:
        p.stop()


def test_series_of_untracked_vlmdeployments_are_dropped_each_resync(calls):
    """The operator's per-VLMDeployment series go with their object: at once when it is
    deleted (handlers.py), and at every resync for any a late round wrote afterwards."""
    from vlm_operator import metrics

    metrics.DETECTIONS.labels("team", "kept", "engine_dead").inc()
    metrics.AUTOSCALER_READY.labels("team", "gone", "ready").set(2)
    metrics.REMEDIATIONS.labels("team", "gone", "Restart").inc()
    periodic = start(calls, sweep=metrics.keep_only)
    try:
        periodic.track(body("kept"))
        wait_until(lambda: ("team", "gone") not in metrics.vlmds_with_series())
        assert ("team", "kept") in metrics.vlmds_with_series()
        metrics.forget_vlmd("team", "kept")
        assert not {("team", "kept"), ("team", "gone")} & metrics.vlmds_with_series()
    finally:
        periodic.stop()


def test_a_round_still_running_when_its_object_goes_is_forgotten_after_it():
    """What a round keeps or writes (state, series) after its VLMDeployment was untracked is
    dropped when that round ends, not left for ever."""
    started, release, forgotten = threading.Event(), threading.Event(), []

    def tick(b):
        started.set()
        release.wait(5)

    periodic = Periodic(tick=tick, resync=lambda ns, name: None,
                        forget=lambda ns, name: forgotten.append(name), round_s=0.02,
                        resync_s=60).start()
    try:
        periodic.track(body("late"))
        assert started.wait(5)
        periodic.untrack("team", "late")
        assert forgotten == ["late"]
        release.set()
        wait_until(lambda: forgotten == ["late", "late"])
    finally:
        periodic.stop()


def test_a_vlmdeployment_without_a_round_to_do_takes_no_round_worker(calls):
    """`due` says the round has nothing to do (no pods): no tick, no worker, and its round
    counts as done for the watchdog; pods appear and its rounds start."""
    has_pods = {"empty": False, "busy": True}
    p = start(calls, due=lambda b: has_pods[b["metadata"]["name"]])
    try:
        p.track(body("empty"))
        p.track(body("busy"))
        wait_until(lambda: calls.ticks.count("busy") >= 10)
        assert "empty" not in calls.ticks
        assert p.watchdog.check() == []  # nothing owed, nothing stalled
        has_pods["empty"] = True
        wait_until(lambda: "empty" in calls.ticks)
    finally:
        p.stop()


def test_one_namespaces_slow_rounds_leave_workers_to_the_others():
    """Eight VLMDeployments of one namespace whose rounds never end (their pods hold every
    read to its deadline, round after round) take that namespace's share of the round workers,
    not all of them: another namespace's rounds go on."""
    release = threading.Event()
    ticks = []

    def tick(b):
        ticks.append(b["metadata"]["name"])
        if b["metadata"]["namespace"] == "hostile":
            release.wait(30)

    p = Periodic(tick=tick, resync=lambda ns, name: None, forget=lambda ns, name: None,
                 round_s=0.02, resync_s=60).start()
    try:
        p.track(body("calm", ns="other"))
        for i in range(8):
            p.track(body(f"h{i}", ns="hostile"))
        wait_until(lambda: ticks.count("calm") >= 20)
    finally:
        release.set()
        p.stop()


def test_a_resync_that_raises_does_not_stop_the_others():
    """A VLMDeployment whose reconcile raises (a nested annotation raised RecursionError out
    of handlers.reconcile) must not keep the resync from the VLMDeployments after it: each is
    isolated, logged and counted."""
    from vlm_operator.metrics import RECONCILES

    resynced, lock = [], threading.Lock()

    def resync(ns, name):
        with lock:
            resynced.append(name)
        if name == "attacker":
            raise RecursionError("maximum recursion depth exceeded")

    errors = RECONCILES.labels(result="error")._value.get()
    p = Periodic(tick=lambda b: None, resync=resync, forget=lambda ns, name: None,
                 round_s=60, resync_s=0.05,
                 sweep=lambda tracked: (_ for _ in ()).throw(RuntimeError("sweep"))).start()
    try:
        for name in ("a", "attacker", "c", "d"):
            p.track(body(name, ns=name))
        wait_until(lambda: all(resynced.count(n) >= 2 for n in ("a", "attacker", "c", "d")))
        assert RECONCILES.labels(result="error")._value.get() >= errors + 2
    finally:
        p.stop()
        for thread in p._threads:  # no resync of it still counting into the next test
            thread.join(10)


def test_a_reconcile_the_watchdog_asks_for_that_raises_is_logged(caplog):
    """The watchdog's reconciles (OperatorStalled) run in a pool: what one raises would
    otherwise vanish in its future, unlogged and uncounted."""
    def resync(ns, name):
        raise RecursionError("maximum recursion depth exceeded")

    p = Periodic(tick=lambda b: None, resync=resync, forget=lambda ns, name: None,
                 round_s=60, resync_s=60)
    try:
        p.track(body("attacker"))
        p._publish_conditions(["rounds"])
        wait_until(lambda: "resync of team/attacker failed" in caplog.text)
    finally:
        p.stop()
