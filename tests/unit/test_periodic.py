"""periodic.Periodic: autoscaling rounds for Builtin objects, resyncs for all, gated by peering."""

import threading
import time

import pytest

from vlm_operator.periodic import Periodic


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


def wait_until(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.fixture
def calls():
    return Calls()


def start(calls, **kw):
    return Periodic(tick=calls.tick, resync=calls.resync, forget=calls.forget,
                    autoscale_s=0.02, resync_s=0.05, **kw).start()


def test_rounds_for_builtin_resyncs_for_all(calls):
    p = start(calls)
    try:
        for b in (body("auto", "Builtin"), body("hpa", "HPA"), body("plain"),
                  body("boom", "Builtin")):
            p.track(b)
        wait_until(lambda: calls.ticks.count("auto") >= 3 and calls.resyncs.count("plain") >= 2)
        assert set(calls.ticks) == {"auto", "boom"}  # a failing tick does not stop the loop
        assert {"auto", "hpa", "plain", "boom"} <= set(calls.resyncs)
        p.untrack("team", "auto")
        assert calls.forgotten == ["auto"]
        seen = calls.ticks.count("auto")
        wait_until(lambda: calls.ticks.count("boom") >= seen + 3)
        assert calls.ticks.count("auto") <= seen + 1  # at most a round already under way
    finally:
        p.stop()


def test_the_latest_body_counts(calls):
    p = start(calls)
    try:
        p.track(body("x", "Builtin"))
        wait_until(lambda: "x" in calls.ticks)
        p.track(body("x", "HPA"))  # autoscaling moved to an HPA
        time.sleep(0.1)
        seen = calls.ticks.count("x")
        time.sleep(0.2)
        assert calls.ticks.count("x") <= seen + 1  # at most a round already under way
    finally:
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
