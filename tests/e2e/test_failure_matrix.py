"""The failure-mode matrix: every row of vlm_testbed.failure_matrix on the real
control plane, the operator as its own process, the default spec unless the row says
otherwise. Each row asserts its outcome and that nothing else happened: no other pod touched,
each action counted once, and status and Events that say what happened. Times are measured by
bench/failure_matrix.py, never asserted here."""

from __future__ import annotations

import uuid

import pytest
import yaml
from kube_helpers import SESSION_NS_PREFIX

from vlm_testbed.chart import CHART
from vlm_testbed.failure_matrix import DRAIN_WAIT_S, ROWS, Bed, Observed


def said(seen: Observed, signature: str, action: str) -> None:
    """status.lastRemediation names what was detected and done."""
    last = seen.notes["last_remediation"] or {}
    assert (last.get("signature"), last.get("action")) == (signature, action), last


# The default spec recovers a pod that serves nothing in place: it is fenced (out of the
# Service) with the cheapest rung that works, the kubelet restarts its container, the pod goes
# back into the Service; nothing is deleted.
EXITS = "PodFenced"  # the process exits by itself: the fence, then the kubelet's restart
STAYS_UP = "PodRestartRequested"  # kept alive: the restart request the engine plugin acts on


def dead(n, rung=EXITS):
    def check(seen: Observed) -> None:
        assert seen.recovered_s is not None, "not serving again"
        assert (seen.events[rung], seen.events["PodRecoveredInPlace"]) == (n, n), seen.events
        assert not {"PodRestarted", "PodReplacing", "RemediationSkipped"} & set(seen.events)
        assert seen.touched == []
        said(seen, "engine_dead", "Restart")
    return check


def storm_one_of_three(seen: Observed) -> None:
    assert seen.recovered_s is not None and seen.events["PodRestarted"] == 1, seen.events
    assert seen.touched == [] and seen.lowest_ready >= 2
    said(seen, "tokenizer_retry", "Restart")


def storm_gpu_free(seen: Observed) -> None:
    assert seen.recovered_s is not None
    assert (seen.events["PodReplacing"], seen.events["PodReplaced"]) == (1, 1), seen.events
    assert seen.events["PodRestarted"] == 0
    assert seen.lowest_ready >= 1, "the only replica was removed before its replacement served"
    assert seen.events["DriftRestored"] == 0, "the surge's own replicas change called drift"
    said(seen, "tokenizer_retry", "Replace")


def storm_no_gpu(seen: Observed) -> None:
    held = seen.notes["held_condition"]
    assert (held["status"], held["reason"]) == ("True", "WaitingForCapacity")
    assert "no GPU is free" in held["message"]
    assert seen.notes["held_events"].get("RemediationSkipped") == 1
    assert seen.notes["held_recovered"] is None and seen.notes["touched_while_held"] == []
    # a GPU freed up: the held incident was acted on, by replacement, once
    assert seen.recovered_s is not None
    assert seen.events["PodReplacing"] == 1 and seen.lowest_ready >= 1
    said(seen, "tokenizer_retry", "Replace")


def below_threshold(seen: Observed) -> None:
    assert seen.touched == []
    assert not {"PodRestarted", "PodReplacing", "ScaleDownStarted",
                "RemediationSkipped"} & set(seen.events)
    assert seen.notes["last_remediation"] is None


def saturation(seen: Observed) -> None:
    assert seen.touched == [] and seen.lowest_ready == 2
    assert seen.notes["out_of_service"] == [] and seen.notes["replicas"] == 2
    assert not {"PodRestarted", "PodReplacing", "ScaleDownStarted"} & set(seen.events)
    assert seen.notes["autoscaling"]["reason"].startswith("LoadUnknown")


def crash_loop(seen: Observed) -> None:
    # Restarts decided (the remediation history), whatever rungs each took: in place, the
    # crash-looping container never comes back Ready, so its fence climbs to a new pod, and
    # the fenced pod's later deaths belong to that recovery (no incident of their own)
    assert seen.notes["restarts_at_budget"] == 2, "flapping past the budget"
    # Degraded (its reason the crash loop or the spent budget, whichever the status shows
    # first), and the Event says the budget is spent
    assert seen.notes["degraded"]["status"] == "True", seen.notes["degraded"]
    assert seen.events["RestartBudgetExhausted"] >= 1, seen.events
    assert seen.notes["restarts_after_raise"] == 3  # then it crash-loops on: no said()


def killed_mid_incident(seen: Observed) -> None:
    assert seen.recovered_s is not None
    assert seen.events["PodReplacing"] == 1 and seen.events["PodRestarted"] == 0


def killed_stale(seen: Observed) -> None:
    assert seen.notes["pod_kept"] and seen.touched == []
    assert not {"PodRestarted", "PodReplacing"} & set(seen.events)
    assert seen.notes["remediating"]["status"] == "False"


def killed_mid_drain(seen: Observed) -> None:
    assert seen.notes["replicas"] == 1, "replicas lowered twice or not at all"
    assert seen.notes["out_of_service"] == []
    assert seen.events["ScaleDownStarted"] == 1 and seen.events["ScaledDown"] == 1
    assert seen.touched == []
    said(seen, "tokenizer_retry", "ScaleDown")


def standby(seen: Observed) -> None:
    assert seen.recovered_s is not None
    assert seen.events["PodReplacing"] == 1 and seen.events["PodReplaced"] == 1
    assert seen.lowest_ready >= 1


def two_at_once(seen: Observed) -> None:
    assert seen.recovered_s is not None
    assert seen.events["PodRecoveredInPlace"] == 1 and not seen.events["PodReplacing"]
    assert not seen.events["PodRestarted"], seen.events
    other = seen.notes["other"]
    assert other["events"].get("PodReplacing") == 1 and not other["events"].get("PodRestarted")
    assert seen.touched == [] and other["touched"] == []


def previous_refused(seen: Observed) -> None:
    dead(1, STAYS_UP)(seen)  # the new container was followed: its engine death acted on
    assert seen.events["PreviousLogUnavailable"] == 1, seen.events


def existing_service(seen: Observed) -> None:
    assert seen.recovered_s is not None, "the VLMDeployment's pods never served"
    assert seen.notes["degraded"]["reason"] == "ObjectNotOwned"
    assert "Service row" in seen.notes["degraded"]["message"]
    assert seen.events["ObjectNotOwned"] == 1
    assert seen.notes["service_kept"], "the other app's Service was changed"
    assert seen.notes["service_owners"] == []
    assert seen.notes["service_selector"] == {"app": "their-app"}


def unreachable(detail):
    """Nothing done to the pod; status, an Event and the metrics say why it is not read."""
    def check(seen: Observed) -> None:
        assert seen.touched == [] and seen.lowest_ready == 1, "the pod was touched"
        assert not {"PodRestarted", "PodReplacing", "ScaleDownStarted",
                    "RemediationSkipped"} & set(seen.events), seen.events
        assert seen.notes["last_remediation"] is None
        condition = seen.notes["condition"]
        assert (condition["status"], condition["reason"]) == ("False", "PodsUnreachable")
        assert f"{seen.notes['pod']} ({detail}" in condition["message"], condition
        assert seen.events["PodsUnreachable"] == 1, seen.events
        assert seen.notes["pods_unreachable"] == 1 and seen.notes["read_errors"] >= 3
        assert seen.notes["reachable_again"], "still unreachable once the firewall lifted"
        assert seen.notes["events_after"].get("PodsReachable") == 1, "no Event when it cleared"
    return check


def memory_limit_mib() -> float:
    """The operator's memory limit in the chart's values (a Mi quantity)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    limit = values["resources"]["limits"]["memory"]
    assert limit.endswith("Mi"), limit
    return float(limit[:-2])


def hostile_tenant(seen: Observed) -> None:
    dead(1)(seen)  # the other tenant's engine death, acted on as usual
    assert seen.notes["redirect_target_requests"] == [], "a redirect was followed"
    assert seen.notes["tracebacks"] == 0, "hostile log lines made the operator log tracebacks"
    assert seen.notes["peak_rss_mib"] < memory_limit_mib(), seen.notes
    reasons = {"redirect": "RedirectRefused", "huge": "AnswerTooLarge", "drip": "ReadTimeout"}
    for mode, hostile in seen.notes["hostile"].items():
        assert hostile["touched"] == [], f"{mode}: a hostile pod was acted on"
        assert (hostile["readable"]["status"], hostile["readable"]["reason"]) == (
            "False", reasons[mode]), hostile["readable"]
        assert hostile["read_errors"] >= 2, hostile
        assert not {"PodRestarted", "PodReplacing", "ScaleDownStarted"} & set(
            hostile["events"]), hostile["events"]


def no_request_failed(seen: Observed) -> None:
    load = seen.notes["load"]
    assert load["answered"] > 0 and load["failed"] == 0, load


def drain_gpu_free(seen: Observed) -> None:
    assert seen.notes["drain_rc"] == 0, seen.notes["drain_output"]
    no_request_failed(seen)
    assert seen.recovered_s is not None and seen.lowest_ready >= 1, "a serving gap"
    assert (seen.events["PodReplacing"], seen.events["PodReplaced"]) == (1, 1), seen.events
    assert not {"NodeDrainHeld", "NodeDrainWaitExpired", "PodRestarted"} & set(seen.events)
    assert seen.notes["in_flight_left"] == 0


def drain_no_gpu(seen: Observed) -> None:
    # held while no GPU is free (the condition says so), then let through: the drain ends
    assert seen.notes["drain_rc"] == 0, seen.notes["drain_output"]
    held = seen.notes["held_condition"]
    assert held and held["status"] == "True" and "no GPU is free" in held["message"], held
    assert (seen.events["NodeDrainHeld"], seen.events["NodeDrainWaitExpired"]) == (1, 1), \
        seen.events
    assert not seen.events["PodReplacing"] and seen.notes["in_flight_left"] == 0


def cordon_no_drain(seen: Observed) -> None:
    # a cordon stops new pods: the only serving replica stays, however long, and serves
    no_request_failed(seen)
    assert seen.touched == [] and seen.lowest_ready == 1, \
        "the only serving replica was removed for a cordon alone"
    held = seen.notes["held_condition"]
    assert held and "cordon alone never lets it go" in held["message"], held
    cordoned = seen.notes["events_cordoned"]
    assert cordoned.get("NodeDrainHeld") == 1, cordoned
    assert not {"NodeDrainWaitExpired", "PodReplaced", "PodRestarted"} & set(cordoned)
    assert seen.notes["in_flight_cordoned"] == 1
    # the uncordon ends the wait; the same pod serves on
    assert seen.notes["cancelled"] and seen.events["NodeDrainCancelled"] == 1, seen.events
    assert seen.notes["serving"]


def drain_slow_replacement(seen: Observed) -> None:
    assert seen.lowest_ready >= 1, "a serving gap: the pod went before its replacement served"
    no_request_failed(seen)
    assert seen.notes["drain_rc"] == 0, seen.notes["drain_output"]
    ready_s = seen.notes["replacement_ready_s"]
    assert ready_s is not None and ready_s > DRAIN_WAIT_S, \
        f"the replacement served at {ready_s} s: the row did not outlast the drain wait"
    # one replacement; the move ends with the operator's delete, or with kubectl drain's own
    # eviction (retried every 5 s, let through by the PodDisruptionBudget once the replacement
    # serves): PodReplaced says which, once
    assert (seen.events["PodReplacing"], seen.events["PodReplaced"]) == (1, 1), seen.events
    assert not {"NodeDrainHeld", "NodeDrainWaitExpired", "ReplaceFailed"} & set(seen.events)
    assert seen.notes["in_flight_left"] == 0


def claim_node_full(seen: Observed) -> None:
    # the free GPU is on a node the claim's pod affinity keeps the replacement off: held
    held = seen.notes["held_condition"]
    assert (held.get("status"), held.get("reason")) == ("True", "WaitingForCapacity"), held
    assert "no GPU is free for a replacement on a node its pods may use" in held["message"]
    assert seen.notes["pods_seen"] == [seen.notes["pod"]], "a replacement was surged"
    assert not {"PodReplacing", "PodRestarted"} & set(seen.notes["events_after"]), \
        seen.notes["events_after"]
    assert seen.notes["events_after"].get("RemediationSkipped") == 1
    assert seen.touched == [] and seen.lowest_ready == 1


def node_added_by_autoscaler(seen: Observed) -> None:
    # the replacement waited Pending for the node the stand-in added, and serves there
    assert seen.recovered_s is not None and seen.lowest_ready >= 1, "a serving gap"
    assert (seen.events["PodReplacing"], seen.events["PodReplaced"]) == (1, 1), seen.events
    assert not {"PodRestarted", "RemediationSkipped"} & set(seen.events), seen.events
    assert len(seen.notes["nodes_added"]) == 1
    assert "for a node the node autoscaler adds" in seen.notes["waiting_condition"]["message"]
    assert seen.notes["pod_nodes"] == seen.notes["nodes_added"], seen.notes
    said(seen, "tokenizer_retry", "Replace")


def storms_two_pods_one_gpu(seen: Observed) -> None:
    """The first sick pod is replaced while the second is held (no GPU free). The second is
    replaced in turn, or restarted when, by its decision, the ReplicaSet's pod for the first
    one's deleted pod (the replicas drop only once the ReplicaSet saw it go) was already
    ready: then the others keep minAvailable without a surge. Either way one surge at a time,
    never below minAvailable, each incident acted on and counted once."""
    assert seen.recovered_s is not None
    assert seen.notes["most_surges_at_once"] == 1, "two surges onto one free GPU"
    held = seen.notes["held_condition"]
    assert held and "no GPU is free" in held["message"], held
    replaced, restarted = seen.events["PodReplacing"], seen.events["PodRestarted"]
    assert (replaced, restarted) in ((2, 0), (1, 1)), seen.events
    assert seen.events["PodReplaced"] == replaced, seen.events
    assert "ReplaceFailed" not in seen.events
    assert seen.notes["budget_entries"] == 2, "an incident counted twice in the budget"
    assert seen.lowest_ready >= 2 and seen.touched == []


def replace_under_load(seen: Observed) -> None:
    no_request_failed(seen)
    assert (seen.events["PodReplacing"], seen.events["PodReplaced"]) == (1, 1), seen.events
    assert seen.lowest_ready >= 1
    said(seen, "tokenizer_retry", "Replace")


def scale_down_under_load(seen: Observed) -> None:
    no_request_failed(seen)
    assert (seen.events["ScaleDownStarted"], seen.events["ScaledDown"]) == (1, 1), seen.events
    assert seen.notes["replicas"] == 1 and seen.touched == []
    said(seen, "tokenizer_retry", "ScaleDown")


def long_prefill(seen: Observed) -> None:
    assert not {"PodRestarted", "PodReplacing", "ScaleDownStarted",
                "RemediationSkipped"} & set(seen.events), seen.events
    assert seen.notes["last_remediation"] is None
    assert seen.notes["prompt_done"], "the long prompt never completed"
    assert seen.touched == [] and seen.lowest_ready == 1


def hung_api_key(seen: Observed) -> None:
    assert seen.recovered_s is not None, "not serving again"
    assert (seen.events[STAYS_UP], seen.events["PodRecoveredInPlace"]) == (1, 1), seen.events
    assert not seen.events["PodRestarted"] and seen.touched == [], seen.events
    said(seen, "engine_stalled", "Restart")
    assert any("one step (1 tokens scheduled) has run for" in why
               for why in seen.notes["restart_reasons"]), seen.notes["restart_reasons"]


def fenced_under_scale_down(seen: Observed) -> None:
    assert seen.notes["replicas"] == 1
    assert seen.notes["healthy_kept"], "the healthy pod was removed, not the fenced one"
    assert seen.notes["pods_left"] == [seen.notes["healthy_uid"]], seen.notes
    assert seen.touched == [] and seen.lowest_ready >= 1
    assert seen.events["PodFenced"] == 1 and not seen.events["PodRestarted"], seen.events


def late_engine_death_line(seen: Observed) -> None:
    assert seen.notes["pod_kept"], "the restarted container was deleted or restarted again"
    assert seen.touched == [] and seen.recovered_s is not None
    assert not {"PodFenced", "PodRestarted", "PodRestartRequested"} & set(seen.events), \
        seen.events
    assert seen.notes["last_remediation"] is None
    assert seen.notes["late_line_read"], "the late line was never decided on"


def old_restarts_in_place(seen: Observed) -> None:
    assert seen.recovered_s is not None, "not serving again"
    assert seen.notes["pod_kept"], "replaced by a new pod"
    assert seen.events["PodFenced"] == 1 and seen.events["PodRecoveredInPlace"] == 1, \
        seen.events
    assert not seen.events["PodRestarted"], seen.events
    (fenced,) = seen.notes["fenced"]  # the kubelet forgot the back-off: no wait estimated
    assert "restarts the container in place at once" in fenced, fenced
    assert seen.notes["last_remediation"]["rung"] == "unfenced"
    said(seen, "engine_dead", "Restart")


CHECKS = {
    "engine-dead-exit0-1": dead(1), "engine-dead-exit1-1": dead(1),
    "engine-dead-alive-1": dead(1, STAYS_UP), "engine-dead-exit0-3": dead(1),
    "engine-dead-exit1-3": dead(1), "engine-dead-alive-3": dead(1, STAYS_UP),
    "engine-dead-all-3": dead(3, STAYS_UP), "storm-1-of-3": storm_one_of_three,
    "storm-only-gpu-free": storm_gpu_free, "storm-only-no-gpu": storm_no_gpu,
    "storm-below-threshold": below_threshold, "saturation": saturation,
    "crash-loop-budget": crash_loop, "operator-killed-mid-incident": killed_mid_incident,
    "operator-killed-stale-incident": killed_stale,
    "operator-killed-mid-drain": killed_mid_drain, "standby-takes-over": standby,
    "two-vlmds-at-once": two_at_once, "existing-service": existing_service,
    "unreachable-drop": unreachable("connect timed out"),
    "unreachable-reject": unreachable("connection refused"),
    "hostile-tenant": hostile_tenant,
    "drain-gpu-free": drain_gpu_free, "drain-no-gpu": drain_no_gpu,
    "cordon-no-drain": cordon_no_drain, "drain-slow-replacement": drain_slow_replacement,
    "claim-node-full": claim_node_full, "node-added-by-autoscaler": node_added_by_autoscaler,
    "storms-two-pods-one-gpu": storms_two_pods_one_gpu,
    "replace-under-load": replace_under_load, "scaledown-under-load": scale_down_under_load,
    "engine-dead-logging-prefix": dead(1), "previous-log-refused": previous_refused,
    "long-prefill-only-replica": long_prefill,
    "hung-engine-api-key": hung_api_key,
    "fenced-under-builtin-scaledown": fenced_under_scale_down,
    "late-engine-death-line": late_engine_death_line,
    "old-restarts-in-place": old_restarts_in_place,
}


def test_every_row_has_a_check():
    assert sorted(CHECKS) == sorted(r.id for r in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_failure_mode(row, api, cluster, operator):
    # rows with operators of their own stay out of the session operator's namespaces
    prefix = "e2e-solo-" if row.own_operator else SESSION_NS_PREFIX
    with Bed.new(api, cluster.kubeconfig, f"{prefix}{uuid.uuid4().hex[:6]}") as bed:
        bed.watcher = None if row.own_operator else operator
        CHECKS[row.id](bed.run(row))
