"""watchdog.Watchdog and its use in periodic.Periodic: a loop that has not completed a round in
FACTOR times its period is reported (log, gauges, OperatorStalled), and so is its recovery."""

import threading

from prometheus_client import REGISTRY

from vlm_operator.runtime.periodic import Periodic
from vlm_operator.runtime.watchdog import Watchdog, overdue, round_loop

from ..waiting import wait_until


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def condition(dog, ns, name):
    (report,) = dog.reports(ns, name)
    assert report.type == "OperatorStalled"
    return report


def test_overdue_is_factor_times_the_period():
    loops = {"fast": (1.0, 90.0), "slow": (300.0, 0.0)}
    assert overdue(loops, 100.0, factor=10) == {}
    assert overdue(loops, 100.5, factor=10) == {"fast": 10.5}


def test_stall_and_recovery_reported_once_each(caplog):
    caplog.set_level("INFO")
    clock = Clock()
    dog = Watchdog(factor=10, clock=clock)
    dog.beat("rounds", 1.0)
    dog.beat(round_loop("team", "a"), 1.0)
    dog.beat(round_loop("team", "b"), 1.0)
    assert dog.check() == []
    assert condition(dog, "team", "a").status == "False"

    clock.now += 11  # nothing beat: every loop is late
    dog.beat("rounds", 1.0)
    dog.beat(round_loop("team", "b"), 1.0)
    assert dog.check() == [round_loop("team", "a")]
    assert dog.check() == []  # told once
    stalled = condition(dog, "team", "a")
    assert (stalled.status, stalled.reason) == ("True", "LoopStalled")
    assert "its round has not completed in 10 s" in stalled.message
    assert condition(dog, "team", "b").status == "False"  # another VLMDeployment's is fine
    assert REGISTRY.get_sample_value("vlm_operator_rounds_stalled") == 1
    assert "has not completed a round for 11 s" in caplog.text

    clock.now += 11  # the operator-wide loop stalls too: every VLMDeployment is told
    dog.beat(round_loop("team", "a"), 1.0)
    dog.beat(round_loop("team", "b"), 1.0)
    assert dog.check() == [round_loop("team", "a"), "rounds"]  # a ran again, rounds stalled
    assert "rounds has not completed" in condition(dog, "team", "b").message
    assert REGISTRY.get_sample_value("vlm_operator_loop_stalled", {"loop": "rounds"}) == 1

    dog.beat("rounds", 1.0)
    assert dog.check() == ["rounds"]
    assert condition(dog, "team", "b").status == "False"
    assert "rounds completes rounds again" in caplog.text
    dog.forget("rounds")
    assert REGISTRY.get_sample_value("vlm_operator_loop_stalled", {"loop": "rounds"}) is None


def body(name, ns="team"):
    return {"metadata": {"namespace": ns, "name": name}, "spec": {"model": "m"}}



def test_a_stuck_round_is_reported_and_its_vlmdeployment_reconciled():
    release = threading.Event()
    ticks, published = [], []

    def tick(b):
        ticks.append(b["metadata"]["name"])
        if b["metadata"]["name"] == "stuck":
            release.wait()  # a call without an answer

    dog = Watchdog(factor=5)
    p = Periodic(tick=tick, resync=lambda ns, name: published.append(name),
                 forget=lambda ns, name: None, watchdog=dog, round_s=0.02, resync_s=60,
                 check_s=0.02).start()
    try:
        p.track(body("stuck"))
        p.track(body("fine"))
        wait_until(lambda: condition(dog, "team", "stuck").status == "True")
        wait_until(lambda: "stuck" in published)  # its OperatorStalled condition is published
        assert condition(dog, "team", "fine").status == "False"
        seen = ticks.count("fine")
        wait_until(lambda: ticks.count("fine") > seen + 5)  # the others keep their rounds
        assert ticks.count("stuck") == 1  # skipped while its round runs
        published.clear()
        release.set()
        wait_until(lambda: condition(dog, "team", "stuck").status == "False")
        wait_until(lambda: "stuck" in published)
    finally:
        release.set()
        p.stop()


def test_a_failing_round_is_logged_once_until_it_works(caplog):
    caplog.set_level("INFO")
    failures = {"n": 0}

    def tick(b):
        if failures["n"] < 5:
            failures["n"] += 1
            raise RuntimeError("no answer")

    p = Periodic(tick=tick, resync=lambda ns, name: None, forget=lambda ns, name: None,
                 round_s=0.02, resync_s=60).start()
    try:
        p.track(body("flaky"))
        wait_until(lambda: "works again after 5 failed rounds" in caplog.text)
        assert caplog.text.count("round of team/flaky failed") == 1
    finally:
        p.stop()
