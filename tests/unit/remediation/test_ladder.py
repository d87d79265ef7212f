"""remediation/ladder.py: which rung recovers a pod that serves nothing, and the next step of a
fenced pod, from its annotation and status alone."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vlm_operator.api.names import ACTED_UNTIL, FENCE, RECOVERED_IN_PLACE
from vlm_operator.desired import children
from vlm_operator.k8s.pods import parse_time, rfc3339
from vlm_operator.remediation import ladder, suspect
from vlm_operator.remediation.ladder import Fence, Next, Rung
from vlm_operator.remediation.suspect import GpuFault

T = 1_800_000_000.0


def pod(*, restarts=0, ready=True, env=(), control=True, started=None, deleting=False,
        annotations=None, node="gpu-7") -> dict:
    running = {"startedAt": started} if started else {}
    meta = {"name": "p", "uid": "u", "annotations": dict(annotations or {})}
    if deleting:
        meta["deletionTimestamp"] = "2027-01-15T08:00:00Z"
    return {
        "metadata": meta,
        "spec": {"nodeName": node,
                 "containers": [{"name": children.CONTAINER, "env": list(env)}],
                 "volumes": [{"name": "control", "downwardAPI": {"items": []}}]
                 if control else []},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                   "containerStatuses": [{"name": children.CONTAINER, "ready": ready,
                                          "restartCount": restarts,
                                          "state": {"running": running}}]},
    }


KEEP_ALIVE = [{"name": "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "value": "1"}]


def fence(rung=Rung.AWAIT_EXIT, deadline=T + 30, restarts=0) -> Fence:
    return Fence("engine_dead", T - 1, T, rung.value, deadline, restarts, "engine died")


def test_an_engine_death_that_exits_waits_for_the_kubelet_in_place():
    rung, why = ladder.first_rung("engine_dead", pod(), T, plugin_loaded=True)
    assert rung == Rung.AWAIT_EXIT and "in place" in why


def test_a_process_that_stays_up_is_asked_to_exit_where_the_plugin_runs():
    for signature, p in (("engine_dead", pod(env=KEEP_ALIVE)), ("engine_stalled", pod()),
                         ("api_unresponsive", pod())):
        assert ladder.first_rung(signature, p, T, plugin_loaded=True)[0] == Rung.RESTART_REQUEST
        # without the plugin, or without the projected request, nothing restarts it in place
        assert ladder.first_rung(signature, p, T, plugin_loaded=False)[0] == Rung.DELETE
    assert ladder.first_rung("engine_stalled", pod(control=False), T,
                             plugin_loaded=True)[0] == Rung.DELETE


def test_a_kubelet_back_off_past_a_cold_start_makes_a_new_pod_cheaper():
    # runs not known (no start times): every restart assumed chained, the longest back-off
    assert [ladder.kubelet_backoff_s(pod(restarts=n), T) for n in range(7)] == [
        0, 10, 20, 40, 80, 160, 300]
    assert ladder.first_rung("engine_dead", pod(restarts=4), T, plugin_loaded=True)[0] == \
        Rung.AWAIT_EXIT  # 80 s: still cheaper than 110 s cold
    rung, why = ladder.first_rung("engine_dead", pod(restarts=5), T, plugin_loaded=True)
    assert rung == Rung.DELETE and "160 s" in why


def at(t: float) -> str:
    return rfc3339(t)


def history(*, restarts, started, prev=None, waiting=False) -> dict:
    """A pod whose current container started at `started` (or, waiting: ended then) and whose
    previous one ran over `prev` = (start, end)."""
    p = pod(restarts=restarts, ready=not waiting)
    cs = p["status"]["containerStatuses"][0]
    cs["state"] = {"waiting": {"reason": "CrashLoopBackOff"}} if waiting else {
        "running": {"startedAt": at(started)}}
    if prev:
        cs["lastState"] = {"terminated": {"startedAt": at(prev[0]), "finishedAt": at(prev[1])}}
    return p


def test_the_back_off_is_estimated_from_recent_restarts_as_the_kubelet_keeps_it():
    day = 86400
    # 5 restarts weeks ago, running for days: the kubelet forgot the back-off (run > 10 min)
    old = history(restarts=5, started=T - 3 * day, prev=(T - 20 * day, T - 3 * day))
    assert ladder.kubelet_backoff_s(old, T) == 0
    rung, why = ladder.first_rung("engine_dead", old, T, plugin_loaded=True)
    assert rung == Rung.AWAIT_EXIT and "in place at once" in why
    # a short run now after a long one: the back-off began again at the last restart
    again = history(restarts=5, started=T - 60, prev=(T - 2 * day, T - 61))
    assert ladder.kubelet_backoff_s(again, T) == 10
    rung, why = ladder.first_rung("engine_dead", again, T, plugin_loaded=True)
    assert rung == Rung.AWAIT_EXIT and "after its back-off (about 10 s)" in why
    # awaiting the exit waits out that back-off too
    assert ladder.deadline_for(Rung.AWAIT_EXIT, T, 10) == T + ladder.EXIT_WAIT_S + 10
    assert ladder.kubelet_backoff_s(history(restarts=1, started=T - 60,
                                            prev=(T - 70, T - 61)), T) == 10
    # the last two ran briefly: earlier restarts are not visible, the lifetime count bounds it
    recent = history(restarts=5, started=T - 60, prev=(T - 300, T - 200))
    assert ladder.kubelet_backoff_s(recent, T) == 160
    assert ladder.first_rung("engine_dead", recent, T, plugin_loaded=True)[0] == Rung.DELETE
    # ended and waiting: what is left of the back-off counted from its end
    assert ladder.kubelet_backoff_s(history(restarts=1, started=0, prev=(T - 30, T - 4),
                                            waiting=True), T) == 6
    assert ladder.kubelet_backoff_s(history(restarts=4, started=0, prev=(T - 2 * day, T - 5),
                                            waiting=True), T) == 0
    # the kubelet's back-off as configured on the nodes (KubeletCrashLoopBackOffMax)
    short = ladder.KubeletBackoff(initial_s=1, max_s=5)
    assert ladder.kubelet_backoff_s(history(restarts=5, started=T - 11, prev=(T - 20, T - 12)),
                                    T, short) == 0
    assert ladder.kubelet_backoff_s(history(restarts=5, started=T - 3, prev=(T - 9, T - 4)),
                                    T, short) == 5


def test_the_newest_container_is_dated_by_its_start_running_or_waiting():
    assert ladder.container_since(pod()) is None
    # the pod's first container: no earlier one, so no line of its own is ever taken for one's
    assert ladder.container_since(history(restarts=0, started=T - 0.5)) is None
    assert ladder.container_since(history(restarts=1, started=T - 6)) == T - 6
    assert ladder.container_since(history(restarts=2, started=0, prev=(T - 30, T - 4),
                                          waiting=True)) == T - 30


def test_a_fence_waits_for_its_deadline_then_climbs():
    f = fence()
    assert ladder.next_step(f, pod(), T + 10, plugin_loaded=True)[0] == Next.WAIT
    step, rung, why = ladder.next_step(f, pod(), T + 31, plugin_loaded=True)
    assert (step, rung) == (Next.REQUEST, Rung.RESTART_REQUEST) and "did not exit" in why
    assert ladder.next_step(f, pod(), T + 31, plugin_loaded=False)[:2] == (
        Next.DELETE, Rung.DELETE)
    asked = ladder.climb(f, Rung.RESTART_REQUEST, T + 31, 0)
    assert asked.deadline == T + 31 + ladder.REQUEST_WAIT_S
    assert ladder.next_step(asked, pod(), T + 100, plugin_loaded=True)[0] == Next.WAIT
    assert ladder.next_step(asked, pod(), asked.deadline, plugin_loaded=True)[:2] == (
        Next.DELETE, Rung.DELETE)


def test_a_container_restarted_in_place_is_unfenced_once_ready():
    f = fence()
    assert ladder.next_step(f, pod(restarts=1, ready=False), T + 40,
                            plugin_loaded=True)[0] == Next.WAIT  # restarted, not running yet
    step, _, why = ladder.next_step(f, pod(restarts=1), T + 40, plugin_loaded=True)
    assert step == Next.UNFENCE and "in place" in why
    # the same restart count as at the fence: not recovered, whatever readiness says
    assert ladder.next_step(f, pod(restarts=0), T + 10, plugin_loaded=True)[0] == Next.WAIT


def test_a_container_that_never_gets_ready_again_is_replaced():
    f = fence()
    stamp = "2027-01-15T08:00:00Z"
    began = parse_time(stamp)
    p = pod(restarts=1, ready=False, started=stamp)
    assert ladder.next_step(f, p, began + 60, plugin_loaded=True)[0] == Next.WAIT
    step, rung, why = ladder.next_step(f, p, began + ladder.READY_WAIT_S + 1,
                                       plugin_loaded=True)
    assert (step, rung) == (Next.DELETE, Rung.DELETE) and "not Ready" in why


def test_a_pod_going_away_needs_nothing_and_a_failed_delete_is_retried():
    assert ladder.next_step(fence(), pod(deleting=True), T, plugin_loaded=True)[0] == \
        Next.FORGET
    assert ladder.next_step(fence(), None, T, plugin_loaded=True)[0] == Next.FORGET
    assert ladder.next_step(fence(Rung.DELETE, deadline=T), pod(), T,
                            plugin_loaded=True)[0] == Next.DELETE


def test_the_fence_round_trips_through_its_annotation():
    f = fence(Rung.RESTART_REQUEST, restarts=2)
    assert ladder.parse_fence({FENCE: ladder.fence_value(f)}) == f
    assert ladder.parse_fence({}) is None


@given(st.one_of(st.text(max_size=300), st.binary(max_size=100).map(repr),
                 st.dictionaries(st.text(max_size=10), st.integers() | st.text(max_size=5)
                                 | st.floats()).map(str)))
def test_an_annotation_the_operator_did_not_write_is_never_a_fence_and_never_raises(raw):
    f = ladder.parse_fence({FENCE: raw})
    assert f is None or all(math.isfinite(x) for x in (f.incident, f.at, f.deadline))


@pytest.mark.parametrize("raw", [
    '{"signature":"x","incident":"nan","at":1,"rung":"delete","deadline":1,"restarts":0,'
    '"reason":""}',
    '{"signature":"x","incident":1,"at":1,"rung":"reboot","deadline":1,"restarts":0,'
    '"reason":""}',
    '{"signature":"x","incident":1,"at":1,"rung":"delete","deadline":1,"restarts":-1,'
    '"reason":""}',
    "x" * 5000,
])
def test_a_fence_with_an_impossible_value_is_ignored(raw):
    assert ladder.parse_fence({FENCE: raw}) is None


def test_recovered_until_reads_the_pods_annotation():
    assert ladder.recovered_until(pod(annotations={ACTED_UNTIL: f"{T:.3f}"})) == T
    for bad in ("soon", "inf", "nan"):
        assert ladder.recovered_until(pod(annotations={ACTED_UNTIL: bad})) is None
    assert ladder.recovered_until(pod()) is None


# ---------------------------------------------------------------- a suspect node

ILLEGAL = "CUDA error: an illegal memory access was encountered"


def recovered(*times: float) -> dict:
    return {RECOVERED_IN_PLACE: ",".join(f"{t:.3f}" for t in times)}


def test_a_gpu_error_makes_the_first_rung_a_new_pod_naming_the_node_and_the_error():
    node = suspect.suspect(pod(), GpuFault(T - 2, ILLEGAL), T)
    for signature in ("engine_dead", "gpu_error", "engine_stalled"):
        rung, why = ladder.first_rung(signature, pod(), T, plugin_loaded=True, suspect=node)
        assert rung == Rung.DELETE
        assert why == (f"GPU error on node gpu-7: {ILLEGAL}; a new pod, not an in-place "
                       "restart on the same GPU")
    # an hour later the GPU error no longer counts against the node
    assert suspect.suspect(pod(), GpuFault(T - suspect.SUSPECT_WINDOW_S - 1, ILLEGAL), T) is None


def test_a_gpu_error_found_while_fenced_replaces_the_pod_even_after_its_in_place_restart():
    node = suspect.suspect(pod(), GpuFault(T + 1, ILLEGAL), T + 2)
    for p in (pod(), pod(restarts=1, ready=False), pod(restarts=1, ready=True)):
        step, rung, why = ladder.next_step(fence(), p, T + 2, plugin_loaded=True, suspect=node)
        assert (step, rung) == (Next.DELETE, Rung.DELETE) and "GPU error on node gpu-7" in why
    # a pod going away still needs nothing
    assert ladder.next_step(fence(), pod(deleting=True), T + 2, plugin_loaded=True,
                            suspect=node)[0] == Next.FORGET


def test_after_two_in_place_recoveries_within_an_hour_the_next_is_a_new_pod():
    once = pod(annotations=recovered(T - 600))
    assert suspect.suspect(once, None, T) is None
    assert ladder.first_rung("engine_dead", once, T, plugin_loaded=True,
                             suspect=suspect.suspect(once, None, T))[0] == Rung.AWAIT_EXIT
    twice = pod(annotations=recovered(T - 3000, T - 600))
    node = suspect.suspect(twice, None, T)
    rung, why = ladder.first_rung("engine_dead", twice, T, plugin_loaded=True, suspect=node)
    assert rung == Rung.DELETE and node.node == "gpu-7"
    assert "already recovered in place 2 times on node gpu-7" in why
    # one of them more than an hour ago: it does not count
    assert suspect.suspect(pod(annotations=recovered(T - 4000, T - 600)), None, T) is None


def test_each_in_place_recovery_is_added_to_the_pods_count_and_it_stays_bounded():
    value = suspect.recoveries_value((), T)
    assert suspect.recoveries({RECOVERED_IN_PLACE: value}, T) == (T,)
    times = tuple(T - 10 * i for i in range(20, 0, -1))
    value = suspect.recoveries_value(times, T)
    assert len(value) <= suspect.MAX_RAW
    assert suspect.recoveries({RECOVERED_IN_PLACE: value}, T) == (*times[-7:], T)


@pytest.mark.parametrize("raw", [
    "nan,nan,nan", "inf,-inf", "1e400,1e400", ",,,", "soon,later", "x" * 300,
    f"{T + 3600:.3f},{T + 7200:.3f}",  # from the future
    ",".join(["1"] * 10_000),
])
def test_a_recovery_count_the_operator_did_not_write_counts_nothing(raw):
    assert suspect.recoveries({RECOVERED_IN_PLACE: raw}, T) == ()
    assert suspect.suspect(pod(annotations={RECOVERED_IN_PLACE: raw}), None, T) is None


@given(st.one_of(st.text(max_size=400),
                 st.lists(st.floats() | st.integers() | st.text(max_size=8), max_size=40).map(
                     lambda xs: ",".join(map(str, xs)))))
def test_any_recovery_annotation_reads_as_a_few_finite_times_in_the_window(raw):
    times = suspect.recoveries({RECOVERED_IN_PLACE: raw}, T)
    assert len(times) <= suspect.MAX_KEPT
    assert all(math.isfinite(t) and T - suspect.SUSPECT_WINDOW_S < t <= T + 60 for t in times)


@pytest.mark.parametrize("raw", ["[" * 4096, "[" * 4000, "{" * 4096, '{"a":' * 800])
def test_a_nested_fence_is_no_fence_and_never_raises(raw):
    """4,096 characters of `[` passed the length cap and raised RecursionError."""
    assert ladder.parse_fence({FENCE: raw}) is None
