"""stalls/watch.StallWatch, the acting side of stall detection: a round's readings in, stalls
reported to the remediator (a recording fake), canaries and /health checks through podreads/reader
(a scripted fake). verdicts.py's rules have their own tests; these pin the glue."""

import pytest

from vlm_operator.api.validation import parse
from vlm_operator.podreads import canary, reader
from vlm_operator.podreads.podhttp import TIMEOUT, UNREACHABLE
from vlm_operator.stalls import watch
from vlm_operator.stalls.watch import Heartbeats, StallWatch

from ..fakes import (
    NAMESPACE,
    Clock,
    FakePodHTTP,
    RecordingRemediator,
    counters,
    pod,
    vlmd_body,
)
from ..waiting import wait_until

STALL_S, CANARY_S = 30, 10  # the CRD's defaults for engineStalled
ROUND_S = 5.0


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(watch, "time", clock)  # the watch's and its heartbeats' wall clock
    return clock


@pytest.fixture
def remediator():
    return RecordingRemediator()


@pytest.fixture
def stall_watch(remediator):
    sw = StallWatch(remediator, Heartbeats())
    yield sw
    sw._pool.shutdown()


def vlmd(**health):
    return parse(vlmd_body(health=health))


def rounds(sw, clock, vlmd, pods, reading_at, seconds, step=ROUND_S):
    """Rounds every `step` s for `seconds`: reading_at(t) gives the round's readings."""
    start = clock.now
    while clock.now - start <= seconds:
        sw.observe(vlmd, pods, reading_at(clock.now - start))
        clock.advance(step)


def settled(sw):
    """No canary or /health check left running."""
    wait_until(lambda: not sw._checking)


class Follower:
    """A pod's log follower as Heartbeats reads it: the log time of the last line it
    delivered."""

    def __init__(self) -> None:
        self.last_line_stamp = None


def heartbeat(sw, clock, p, follower, *, steps, running=1, waiting=2, in_flight=0,
              stamp=None):
    """A heartbeat line read now, written at `stamp` (log time; now by default)."""
    stamp = clock.now if stamp is None else stamp
    follower.last_line_stamp = stamp
    sw.heartbeats.beat(p["metadata"]["uid"], 0, "EngineCore_DP0", {
        "every": "5", "steps": str(steps), "in_flight": str(in_flight), "step_s": "0.1",
        "step_tokens": "8", "running": str(running), "waiting": str(waiting)}, follower, stamp)


# ---------------------------------------------------------------- counters and the canary

def test_standing_counters_and_an_unanswered_canary_report_one_stall(
        monkeypatch, clock, remediator, stall_watch):
    http = FakePodHTTP(canary=TIMEOUT).install(monkeypatch)
    p = pod("vl-0")
    # counters stand still: the canary is due at stallSeconds - canaryTimeoutSeconds
    rounds(stall_watch, clock, vlmd(), [p], lambda t: {"vl-0": counters(100)},
           STALL_S - CANARY_S)
    wait_until(lambda: remediator.reports())
    settled(stall_watch)
    assert http.count("canary") == 1
    assert [(ns, name, pod_name, sig) for ns, name, pod_name, sig, _ in remediator.reports()] \
        == [(NAMESPACE, "vl", "vl-0", "engine_stalled")]
    assert http.count("health") == 0


def test_moving_counters_send_no_canary_and_report_nothing(
        monkeypatch, clock, remediator, stall_watch):
    http = FakePodHTTP(canary=TIMEOUT).install(monkeypatch)
    rounds(stall_watch, clock, vlmd(), [pod("vl-0")],
           lambda t: {"vl-0": counters(100 + t)}, 3 * STALL_S)
    settled(stall_watch)
    assert http.calls == []
    assert remediator.reports() == []


def test_an_answered_canary_is_an_idle_engine_not_a_stall(
        monkeypatch, clock, remediator, stall_watch):
    http = FakePodHTTP(canary=canary.ANSWERED).install(monkeypatch)
    rounds(stall_watch, clock, vlmd(), [pod("vl-0")], lambda t: {"vl-0": counters(100)},
           STALL_S - CANARY_S)
    wait_until(lambda: http.count("canary") == 1)
    settled(stall_watch)
    assert remediator.reports() == []


def test_an_unreachable_pod_is_never_acted_on(monkeypatch, clock, remediator, stall_watch):
    http = FakePodHTTP(canary=UNREACHABLE, health=UNREACHABLE).install(monkeypatch)
    cut_off = reader.Scrape(error=UNREACHABLE, detail="connect timed out")
    # its /metrics cannot be read: no counters, no canary, no /health check
    rounds(stall_watch, clock, vlmd(), [pod("vl-0")], lambda t: {"vl-0": cut_off},
           3 * STALL_S)
    settled(stall_watch)
    assert http.calls == []
    # readable counters that stand still, but a canary that cannot connect: unknown, not stalled
    rounds(stall_watch, clock, vlmd(), [pod("vl-1")], lambda t: {"vl-1": counters(7)},
           3 * STALL_S)
    settled(stall_watch)
    assert http.count("canary") >= 1
    assert remediator.reports() == []


def test_ignore_sends_no_canary(monkeypatch, clock, remediator, stall_watch):
    http = FakePodHTTP(canary=TIMEOUT).install(monkeypatch)
    rounds(stall_watch, clock, vlmd(engineStalled={"action": "Ignore"}), [pod("vl-0")],
           lambda t: {"vl-0": counters(100)}, 3 * STALL_S)
    settled(stall_watch)
    assert http.calls == [] and remediator.reports() == []


# ---------------------------------------------------------------- the engine heartbeat

def test_a_heartbeat_with_steps_standing_still_reports_the_stall_once(
        monkeypatch, clock, remediator, stall_watch):
    http = FakePodHTTP(canary=TIMEOUT).install(monkeypatch)
    p, follower = pod("vl-0"), Follower()

    def reading(t):
        heartbeat(stall_watch, clock, p, follower, steps=42)  # the same step count each time
        return {"vl-0": counters(100)}

    # reported when steps have stood still for stallSeconds, then not again within it
    rounds(stall_watch, clock, vlmd(), [p], reading, STALL_S + 2 * ROUND_S)
    assert [r[2:4] for r in remediator.reports()] == [("vl-0", "engine_stalled")]
    settled(stall_watch)
    assert http.calls == []  # the heartbeat decides: no canary


def test_a_heartbeat_with_steps_completing_reports_nothing(
        monkeypatch, clock, remediator, stall_watch):
    http = FakePodHTTP(canary=TIMEOUT).install(monkeypatch)
    p, follower = pod("vl-0"), Follower()
    steps = iter(range(1000))

    def reading(t):
        heartbeat(stall_watch, clock, p, follower, steps=next(steps))
        return {"vl-0": counters(100)}  # counters flat: only the heartbeat shows the work

    rounds(stall_watch, clock, vlmd(), [p], reading, 3 * STALL_S)
    settled(stall_watch)
    assert http.calls == [] and remediator.reports() == []


def test_a_heartbeat_read_late_behind_a_busy_log_is_no_stall(
        monkeypatch, clock, remediator, stall_watch):
    """A log flood puts the follower minutes behind: it reads the idle engine's beats long after
    they were written, with the flood's lines between them, but those lines span one period of
    log time after each beat: the heartbeat did not stop. Late beats are no verdict: the canary
    (answered: the engine works) decides, and no stall is reported."""
    FakePodHTTP(canary=canary.ANSWERED).install(monkeypatch)
    p, follower = pod("vl-0"), Follower()
    start, written = clock.now, []

    def reading(t):
        if t % (2 * STALL_S) == 0:  # a beat read every 60 s; written 5 s after the last one
            written.append(start + 5 * len(written))
            heartbeat(stall_watch, clock, p, follower, steps=1, running=0, waiting=0,
                      stamp=written[-1])
        follower.last_line_stamp = written[-1] + 3  # the flood's lines after it: 3 s of log
        return {"vl-0": counters(100)}

    rounds(stall_watch, clock, vlmd(), [p], reading, 4 * STALL_S)
    settled(stall_watch)
    assert [r[2:4] for r in remediator.reports()] == []


def test_a_heartbeat_that_stopped_while_the_log_went_on_is_a_stall(
        monkeypatch, clock, remediator, stall_watch):
    """The engine's beats stopped; the API server's lines go on being written and read."""
    FakePodHTTP(canary=TIMEOUT).install(monkeypatch)
    p, follower = pod("vl-0"), Follower()
    heartbeat(stall_watch, clock, p, follower, steps=1, running=0, waiting=0)

    def reading(t):
        follower.last_line_stamp = clock.now  # other lines, read as they are written
        return {"vl-0": counters(100)}

    rounds(stall_watch, clock, vlmd(), [p], reading, STALL_S + 2 * ROUND_S)
    settled(stall_watch)
    assert [r[2:4] for r in remediator.reports()] == [("vl-0", "engine_stalled")]


def test_a_stopped_heartbeat_in_a_log_read_behind_is_found_by_the_heartbeat_not_a_canary(
        monkeypatch, clock, remediator, stall_watch):
    """The engine's beats stopped; the API server's lines reach the operator 15 s after they
    were written (a loaded node). The heartbeat verdict waits for them instead of a canary."""
    http = FakePodHTTP(canary=TIMEOUT).install(monkeypatch)
    p, follower = pod("vl-0"), Follower()
    heartbeat(stall_watch, clock, p, follower, steps=1, running=0, waiting=0)

    def reading(t):
        follower.last_line_stamp = clock.now - 15
        return {"vl-0": counters(100)}

    rounds(stall_watch, clock, vlmd(), [p], reading, STALL_S + 20, step=1.0)
    settled(stall_watch)
    assert [r[2:4] for r in remediator.reports()] == [("vl-0", "engine_stalled")]
    assert http.count("canary") == 0


# ---------------------------------------------------------------- an unresponsive API server

def test_api_timeouts_are_reported_only_when_the_kubelet_agrees(
        monkeypatch, clock, remediator, stall_watch):
    http = FakePodHTTP(health=TIMEOUT).install(monkeypatch)
    timed_out = reader.Scrape(error=TIMEOUT, detail="connected, no answer")
    spec = vlmd(apiUnresponsive={"timeouts": 2})

    def checks(p, n):
        for _ in range(n):
            stall_watch.observe(spec, [p], {p["metadata"]["name"]: timed_out})
            settled(stall_watch)
            clock.advance(ROUND_S)

    checks(pod("vl-0", ready=True), 4)  # the kubelet's probe passes: not acted on
    assert http.count("health") == 4 and remediator.reports() == []
    down = pod("vl-1", ready=False)
    checks(down, 1)
    stall_watch.observe(spec, [down], {"vl-1": counters(5)})  # it answered: count again
    checks(down, 1)
    assert remediator.reports() == []
    checks(down, 1)  # two in a row
    assert [r[2:4] for r in remediator.reports()] == [("vl-1", "api_unresponsive")]


def test_a_pod_that_leaves_takes_its_state_with_it(monkeypatch, clock, remediator, stall_watch):
    FakePodHTTP(canary=TIMEOUT).install(monkeypatch)
    spec = vlmd()
    rounds(stall_watch, clock, spec, [pod("vl-0")], lambda t: {"vl-0": counters(1)}, ROUND_S)
    assert stall_watch.reports(NAMESPACE, "vl")[0].reason == "Canary"
    stall_watch.observe(spec, [], {})
    assert stall_watch.reports(NAMESPACE, "vl") == []
    stall_watch.forget(NAMESPACE, "vl")
    assert stall_watch._progress == {}
