"""The operator's Prometheus metrics, served on --metrics-port at /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

RECONCILES = Counter("vlm_operator_reconciles_total",
                     "Reconcile passes over VLMDeployments, by outcome.", ["result"])
EVENTS = Counter("vlm_operator_events_total",
                 "Kubernetes Events the operator recorded, by type and reason.",
                 ["type", "reason"])

# Per-VLMDeployment label names. Not `namespace`/`name`: Prometheus gives every scraped series
# the target's own `namespace` (the operator's), and a scraped label of that name would become
# `exported_namespace` (docs/install.md).
_VLMD = ["vlmdeployment_namespace", "vlmdeployment"]

# Builtin autoscaler: its inputs and outputs, per VLMDeployment.
AUTOSCALER_NEED = Gauge("vlm_operator_autoscaler_need_replicas",
                        "Replicas the observed load needs (fractional), before stabilisation.",
                        _VLMD)
AUTOSCALER_LOAD = Gauge("vlm_operator_autoscaler_metric",
                        "Sum over ready pods of the scaled-on vLLM metric, multimodal-weighted.",
                        _VLMD)
AUTOSCALER_DESIRED = Gauge("vlm_operator_autoscaler_desired_replicas",
                           "Replicas the last decision asked for (after the GPU budget).", _VLMD)
AUTOSCALER_CURRENT = Gauge("vlm_operator_autoscaler_current_replicas",
                           "spec.replicas when the last decision was taken.", _VLMD)
AUTOSCALER_READY = Gauge("vlm_operator_autoscaler_pods",
                         "Pods seen by the autoscaler, by state (ready, unknown, loading, "
                         "pending).",
                         [*_VLMD, "state"])
AUTOSCALER_DECISIONS = Counter("vlm_operator_autoscaler_decisions_total",
                               "Autoscaler decisions, by reason.", [*_VLMD, "reason"])
AUTOSCALER_SCALES = Counter("vlm_operator_autoscaler_scale_writes_total",
                            "Replica counts written through the scale subresource, by direction.",
                            [*_VLMD, "direction"])
AUTOSCALER_SCRAPE_ERRORS = Counter("vlm_operator_autoscaler_scrape_errors_total",
                                   "Pod /metrics scrapes that failed.", _VLMD)
AUTOSCALER_FREE_GPUS = Gauge("vlm_operator_autoscaler_free_gpus",
                             "Allocatable GPUs of Ready Nodes not requested by bound pods.")
AUTOSCALER_TICK = Histogram("vlm_operator_autoscaler_tick_seconds",
                            "Time of one autoscaler round (scrapes, decision, writes).",
                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))

# Log watching, stall detection and remediation, per VLMDeployment (never per pod: bounded).
DETECTIONS = Counter("vlm_operator_detections_total",
                     "Incidents detected in managed pods' logs or by stall detection, by "
                     "signature.", [*_VLMD, "signature"])
REMEDIATIONS = Counter("vlm_operator_remediations_total",
                       "Remediation actions taken on pods, by action.", [*_VLMD, "action"])
REMEDIATIONS_SKIPPED = Counter("vlm_operator_remediations_skipped_total",
                               "Remediations held back by a guard, by reason (once per incident "
                               "and reason).", [*_VLMD, "reason"])
CANARIES = Counter("vlm_operator_canaries_total",
                   "Canary completions sent to pods whose progress counters stood still, by "
                   "result (answered, timeout, refused, unauthorized, error).", [*_VLMD, "result"])
LOG_LINES = Counter("vlm_operator_log_lines_total",
                    "Log lines read from managed pods (after de-duplication).")
LOG_LINES_TRUNCATED = Counter("vlm_operator_log_lines_truncated_total",
                              "Log lines longer than the follower's limit, cut to their start.")
LOG_LINES_DEDUPLICATED = Counter("vlm_operator_log_lines_deduplicated_total",
                                 "Lines dropped as already seen when a log stream resumed.")
LOG_RECONNECTS = Counter("vlm_operator_log_streams_ended_total",
                         "Follow streams that ended (container exit, timeout, dropped "
                         "connection) and were reopened.")
LOG_LINE_ERRORS = Counter("vlm_operator_log_line_errors_total",
                          "Log lines whose handling failed, by stage (scan: the matcher; "
                          "detect: acting on a detection); each kind is logged at most once a "
                          "minute.", ["stage"])
LOG_PREVIOUS_UNREADABLE = Counter("vlm_operator_log_previous_unreadable_total",
                                  "Previous-container logs that could not be read (the kubelet "
                                  "lost the container, e.g. after a node restart) and were "
                                  "skipped to follow the current container.")
LOG_LINES_THROTTLED = Counter("vlm_operator_log_lines_throttled_total",
                              "Log lines skipped unread because their pod logged more than its "
                              "share of the log budget (lines and CPU per second), by "
                              "namespace.", ["vlmdeployment_namespace"])
LOG_MARKS = Counter("vlm_operator_log_marks_total",
                    "Resume marks written to followed pods (the last log line handled), by "
                    "result (written, error).", ["result"])

# Robustness: the operator's own API calls, its watch-fed caches and its watchdog.
API_REQUESTS = Counter("vlm_operator_api_requests_total",
                       "Requests the operator sent to the apiserver (kopf's own come on top), by "
                       "verb and HTTP status code (none: no answer before the deadline).",
                       ["verb", "code"])
CACHE_OBJECTS = Gauge("vlm_operator_cache_objects",
                      "Objects held by each watch-fed cache (nodes, gpu-pods, managed-pods).",
                      ["cache"])
CACHE_LISTS = Counter("vlm_operator_cache_lists_total",
                      "Full LISTs made by each watch-fed cache (the first, after 410 Gone, the "
                      "rare relist, or polls where watch is not permitted).", ["cache"])
LOOP_ROUND_AGE = Gauge("vlm_operator_loop_seconds_since_round",
                       "Seconds since each of the operator's loops last completed a round.",
                       ["loop"])
LOOP_STALLED = Gauge("vlm_operator_loop_stalled",
                     "1 while a loop has not completed a round in the watchdog's factor times "
                     "its period.", ["loop"])
ROUNDS = Counter("vlm_operator_rounds_total",
                 "VLMDeployment rounds run (stall detection, Builtin autoscaling); a "
                 "VLMDeployment with nothing to read or decide (no pods) has none.")
ROUNDS_STALLED = Gauge("vlm_operator_rounds_stalled",
                       "VLMDeployments whose once-a-second round has not completed in the "
                       "watchdog's factor times its period.")

# Reading tenants' pods (podreads/reachability.py): per VLMDeployment and kind of error, never per
# pod.
POD_READ_ERRORS = Counter("vlm_operator_pod_read_errors_total",
                          "Rounds' /metrics reads of managed pods that failed, by kind "
                          "(unreachable, timeout, too_large, redirect, bad_answer, http_error).",
                          [*_VLMD, "kind"])
PODS_UNREACHABLE = Gauge("vlm_operator_pods_unreachable",
                         "Ready pods of the VLMDeployment the operator cannot connect to "
                         "(PodsReachable=False).", _VLMD)
PODS_UNREADABLE = Gauge("vlm_operator_pods_unreadable",
                        "Started pods of the VLMDeployment that connect but whose /metrics "
                        "answers fail (PodsReadable=False).", _VLMD)

def _labelled_by_vlmd() -> list[MetricWrapperBase]:
    return [m for m in globals().values() if isinstance(m, MetricWrapperBase)
            and tuple(m._labelnames[:2]) == tuple(_VLMD)]


def _series(metric: MetricWrapperBase) -> set[tuple[str, ...]]:
    """The label values of every series of a labelled metric."""
    return {tuple(v for k, v in sample.labels.items() if k != "le")
            for family in metric.collect() for sample in family.samples}


def vlmds_with_series() -> set[tuple[str, str]]:
    """(namespace, name) of every VLMDeployment some metric holds series for."""
    return {values[:2] for metric in _labelled_by_vlmd() for values in _series(metric)}


def forget_vlmd(namespace: str, name: str) -> None:
    """Drop every series of a VLMDeployment that is gone (or another shard's now): per-object
    series would otherwise pile up for ever with the objects that come and go."""
    for metric in _labelled_by_vlmd():
        for values in _series(metric):
            if values[:2] == (namespace, name):
                metric.remove(*values)


def keep_only(tracked: set[tuple[str, str]]) -> None:
    """Drop the series of every VLMDeployment not in `tracked`: a safety net behind
    forget_vlmd for series a round still running wrote after its VLMDeployment went."""
    for namespace, name in vlmds_with_series() - tracked:
        forget_vlmd(namespace, name)
