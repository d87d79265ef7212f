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
from vlm_testbed.failure_matrix import ROWS, Bed, Observed


def said(seen: Observed, signature: str, action: str) -> None:
    """status.lastRemediation names what was detected and done."""
    last = seen.notes["last_remediation"] or {}
    assert (last.get("signature"), last.get("action")) == (signature, action), last


def dead(n):
    def check(seen: Observed) -> None:
        assert seen.recovered_s is not None, "not serving again"
        assert seen.events["PodRestarted"] == n, seen.events
        assert seen.touched == []
        assert not seen.events["RemediationSkipped"]
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
    assert seen.notes["restarts_at_budget"] == 2, "flapping past the budget"
    assert seen.notes["degraded"]["status"] == "True"
    assert seen.events["RemediationSkipped"] >= 1
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
    assert seen.events["PodRestarted"] == 1 and not seen.events["PodReplacing"]
    other = seen.notes["other"]
    assert other["events"].get("PodReplacing") == 1 and not other["events"].get("PodRestarted")
    assert seen.touched == [] and other["touched"] == []


def previous_refused(seen: Observed) -> None:
    dead(1)(seen)  # the new container was followed: its engine death was acted on
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
    assert seen.recovered_s is not None
    assert seen.notes["most_surges_at_once"] == 1, "two surges onto one free GPU"
    held = seen.notes["held_condition"]
    assert held and "no GPU is free" in held["message"], held
    assert (seen.events["PodReplacing"], seen.events["PodReplaced"]) == (2, 2), seen.events
    assert not {"ReplaceFailed", "PodRestarted"} & set(seen.events)
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
    assert seen.events["PodRestarted"] == 1 and seen.touched == [], seen.events
    said(seen, "engine_stalled", "Restart")
    assert "one step (1 tokens scheduled) has run for" in seen.notes["last_remediation"][
        "reason"]


CHECKS = {
    "engine-dead-exit0-1": dead(1), "engine-dead-exit1-1": dead(1),
    "engine-dead-alive-1": dead(1), "engine-dead-exit0-3": dead(1),
    "engine-dead-exit1-3": dead(1), "engine-dead-alive-3": dead(1),
    "engine-dead-all-3": dead(3), "storm-1-of-3": storm_one_of_three,
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
    "claim-node-full": claim_node_full, "node-added-by-autoscaler": node_added_by_autoscaler,
    "storms-two-pods-one-gpu": storms_two_pods_one_gpu,
    "replace-under-load": replace_under_load, "scaledown-under-load": scale_down_under_load,
    "engine-dead-logging-prefix": dead(1), "previous-log-refused": previous_refused,
    "long-prefill-only-replica": long_prefill,
    "hung-engine-api-key": hung_api_key,
}


def test_every_row_has_a_check():
    assert sorted(CHECKS) == sorted(r.id for r in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_failure_mode(row, api, cluster, operator):
    # rows with operators of their own stay out of the session operator's namespaces
    prefix = "e2e-solo-" if row.own_operator else SESSION_NS_PREFIX
    with Bed.new(api, cluster.kubeconfig, f"{prefix}{uuid.uuid4().hex[:6]}") as bed:
        bed.watcher = None if row.own_operator else operator
        try:
            seen = row.run(bed, None)
        except BaseException:
            for proc in bed.operators:
                print(f"operator {proc.log_path}:", proc.log()[-4000:], sep="\n")
            raise
        print(row.id, seen.as_dict())
        CHECKS[row.id](seen)
