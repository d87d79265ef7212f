"""remediation/ladder.py: which rung recovers a pod that serves nothing, and the next step of a
fenced pod, from its annotation and status alone."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vlm_operator.api.names import ACTED_UNTIL, FENCE
from vlm_operator.desired import children
from vlm_operator.k8s.pods import parse_time
from vlm_operator.remediation import ladder
from vlm_operator.remediation.ladder import Fence, Next, Rung

T = 1_800_000_000.0


def pod(*, restarts=0, ready=True, env=(), control=True, started=None, deleting=False,
        annotations=None) -> dict:
    running = {"startedAt": started} if started else {}
    meta = {"name": "p", "uid": "u", "annotations": dict(annotations or {})}
    if deleting:
        meta["deletionTimestamp"] = "2027-01-15T08:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": children.CONTAINER, "env": list(env)}],
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
    rung, why = ladder.first_rung("engine_dead", pod(), plugin_loaded=True)
    assert rung == Rung.AWAIT_EXIT and "in place" in why


def test_a_process_that_stays_up_is_asked_to_exit_where_the_plugin_runs():
    for signature, p in (("engine_dead", pod(env=KEEP_ALIVE)), ("engine_stalled", pod()),
                         ("api_unresponsive", pod())):
        assert ladder.first_rung(signature, p, plugin_loaded=True)[0] == Rung.RESTART_REQUEST
        # without the plugin, or without the projected request, nothing restarts it in place
        assert ladder.first_rung(signature, p, plugin_loaded=False)[0] == Rung.DELETE
    assert ladder.first_rung("engine_stalled", pod(control=False),
                             plugin_loaded=True)[0] == Rung.DELETE


def test_a_kubelet_back_off_past_a_cold_start_makes_a_new_pod_cheaper():
    assert [ladder.kubelet_backoff_s(n) for n in range(7)] == [0, 10, 20, 40, 80, 160, 300]
    assert ladder.first_rung("engine_dead", pod(restarts=4), plugin_loaded=True)[0] == \
        Rung.AWAIT_EXIT  # 80 s: still cheaper than 110 s cold
    rung, why = ladder.first_rung("engine_dead", pod(restarts=5), plugin_loaded=True)
    assert rung == Rung.DELETE and "160 s" in why


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
