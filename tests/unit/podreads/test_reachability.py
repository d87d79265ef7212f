"""podreads/reachability.py: the rounds' /metrics reads turned into PodsReachable / PodsReadable,
their Events and per-VLMDeployment metrics; a flapping read does not flip status every second."""

from __future__ import annotations

from prometheus_client import REGISTRY

from vlm_operator import metrics
from vlm_operator.podreads.reachability import ENTER, LEAVE, PodReads, PodState, observe, reports
from vlm_operator.podreads.reader import BUSY, Scrape
from vlm_operator.reconcile import status

OK = Scrape(values={"vllm:generation_tokens_total": 1.0})
REFUSED = Scrape(error="unreachable", detail="connection refused")
DROPPED = Scrape(error="unreachable", detail="connect timed out after 1 s")
TOO_LARGE = Scrape(error="too_large", detail="the answer is over 2097152 bytes")
BUSY_READ = Scrape(error=BUSY, detail="its last read still runs")


def pod(name, ready=True, started=True):
    return {"metadata": {"name": name, "uid": f"uid-{name}"}, "status": {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "vllm", "started": started,
                               "state": {"running": {}}}]}}


def by_type(items):
    return {r.type: r for r in items}


def test_a_pod_enters_after_enter_reads_and_leaves_after_leave():
    state = None
    for _ in range(ENTER - 1):
        state = observe(state, "p", "unreachable", "connection refused")
        assert state.kind is None
    state = observe(state, "p", "unreachable", "connection refused")
    assert (state.kind, state.detail) == ("unreachable", "connection refused")
    state = observe(state, "p", None, "")  # one good read is not enough
    state = observe(state, "p", "unreachable", "connection refused")  # and resets the count
    for _ in range(LEAVE - 1):
        state = observe(state, "p", None, "")
        assert state.kind == "unreachable"
    assert observe(state, "p", None, "").kind is None


def test_the_detail_stays_while_the_kind_does():
    """What a pod answers must not rewrite status every second: a page whose size changes
    keeps the first detail; a new kind brings its own."""
    state = PodState("p", "too_large", "Content-Length 5000000 is over the cap")
    assert observe(state, "p", "too_large", "Content-Length 7000000 ...").detail == (
        "Content-Length 5000000 is over the cap")
    moved = observe(state, "p", "unreachable", "connection refused")
    assert (moved.kind, moved.detail) == ("unreachable", "connection refused")


def test_reports_name_the_pods_and_what_happened():
    states = [PodState("a", "unreachable", "connection refused"),
              PodState("b", "unreachable", "connect timed out after 1 s"),
              PodState("c", "redirect", "answered 302 redirecting to 'http://x/'"),
              PodState("d")]
    got = by_type(reports(states, 4))
    reach, read = got["PodsReachable"], got["PodsReadable"]
    assert (reach.status, reach.reason) == ("False", "PodsUnreachable")
    assert "2 of 4 started pods" in reach.message
    assert "a (connection refused), b (connect timed out after 1 s)" in reach.message
    assert "Nothing is done to them" in reach.message and "networkPolicy" in reach.message
    assert (read.status, read.reason) == ("False", "RedirectRefused")
    assert "c (answered 302" in read.message
    fine = by_type(reports([PodState("d")], 1))
    assert (fine["PodsReachable"].status, fine["PodsReadable"].status) == ("True", "True")


def test_many_pods_are_counted_past_the_named_ones():
    states = [PodState(f"p{i:02}", "timeout", "connected, but no full answer") for i in range(15)]
    message = by_type(reports(states, 15))["PodsReadable"].message
    assert "p09 (" in message and "p10 (" not in message and "and 5 more" in message


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, {"vlmdeployment_namespace": "t",
                                            "vlmdeployment": "m", **labels})


def test_the_tracker_publishes_changes_only_and_counts_errors():
    refreshed = []
    reads = PodReads(lambda ns, name: refreshed.append((ns, name)))
    metrics.forget_vlmd("t", "m")  # series of an earlier test
    pods = [pod("a"), pod("b")]
    for _ in range(ENTER):
        reads.observe("t", "m", pods, {"a": REFUSED, "b": OK})
    assert refreshed == [("t", "m")]  # once, when a entered
    assert sample("vlm_operator_pod_read_errors_total", kind="unreachable") == ENTER
    assert sample("vlm_operator_pods_unreachable") == 1
    reads.observe("t", "m", pods, {"a": DROPPED, "b": BUSY_READ})  # same kind: no change
    assert refreshed == [("t", "m")]
    assert "a (connection refused)" in by_type(reads.reports("t", "m"))[
        "PodsReachable"].message
    for _ in range(ENTER):
        reads.observe("t", "m", pods, {"a": REFUSED, "b": TOO_LARGE})
    assert len(refreshed) == 2 and sample("vlm_operator_pods_unreadable") == 1
    assert sample("vlm_operator_pod_read_errors_total", kind="too_large") == ENTER
    reads.observe("t", "m", [], {})  # the pods went: state cleared, published
    assert len(refreshed) == 3 and not reads.tracks("t", "m")
    assert sample("vlm_operator_pods_unreachable") == 0
    metrics.forget_vlmd("t", "m")  # the VLMDeployment went: its series go with it
    assert sample("vlm_operator_pods_unreachable") is None
    assert sample("vlm_operator_pod_read_errors_total", kind="unreachable") is None


def test_loading_pods_and_pods_that_are_down_are_not_unreachable():
    """A vLLM still loading refuses connections for minutes (its startup probe has not
    passed): no news. A pod that is not Ready and refuses is down, not cut off from the
    operator: the kubelet does not reach it either."""
    reads = PodReads()
    pods = [pod("loading", ready=False, started=False), pod("down", ready=False)]
    for _ in range(ENTER + 1):
        reads.observe("t", "n", pods, {"loading": REFUSED, "down": REFUSED})
    reach = by_type(reads.reports("t", "n"))["PodsReachable"]
    assert reach.status == "True", reach
    assert "loading" not in reach.message
    reads.observe("t", "n", [pod("down")], {"down": REFUSED})  # Ready: counted from now on
    assert by_type(reads.reports("t", "n"))["PodsReachable"].status == "True"  # not yet 3
    for _ in range(ENTER):
        reads.observe("t", "n", [pod("down")], {"down": DROPPED})
    assert "down (connect timed out" in by_type(reads.reports("t", "n"))[
        "PodsReachable"].message
    reads.forget("t", "n")


def test_conditions_going_false_and_back_are_events():
    old = {"conditions": [{"type": "PodsReachable", "status": "True", "reason": "PodsReachable",
                           "message": "the operator connects to every running pod"}]}
    down = {"conditions": [{"type": "PodsReachable", "status": "False",
                            "reason": "PodsUnreachable", "message": "cannot connect to a"}]}
    assert status.get_events(old, down) == [
        status.Event("Warning", "PodsUnreachable", "cannot connect to a")]
    assert status.get_events(down, down) == []
    assert status.get_events(down, old) == [status.Event(
        "Normal", "PodsReachable", "the operator connects to every running pod")]
    assert status.get_events(None, old) == []  # reachable from the start: nothing to say
