"""The operator's Prometheus metrics, served on --metrics-port at /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("vlm_operator_reconciles_total",
                     "Reconcile passes over VLMDeployments, by outcome.", ["result"])
EVENTS = Counter("vlm_operator_events_total",
                 "Kubernetes Events the operator recorded, by type and reason.",
                 ["type", "reason"])

# Builtin autoscaler: its inputs and outputs, per VLMDeployment.
_VLMD = ["namespace", "name"]
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
                         "Pods seen by the autoscaler, by state (ready, loading, pending).",
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

# Log watching and remediation (logwatch.py).
DETECTIONS = Counter("vlm_operator_detections_total",
                     "Incidents detected in managed pods' logs, by signature.", ["signature"])
REMEDIATIONS = Counter("vlm_operator_remediations_total",
                       "Remediation actions taken on pods, by action.", ["action"])
REMEDIATIONS_SKIPPED = Counter("vlm_operator_remediations_skipped_total",
                               "Remediations held back by a guard, by reason.", ["reason"])
LOG_LINES = Counter("vlm_operator_log_lines_total",
                    "Log lines read from managed pods (after de-duplication).")
LOG_LINES_DEDUPLICATED = Counter("vlm_operator_log_lines_deduplicated_total",
                                 "Lines dropped as already seen when a log stream resumed.")
LOG_RECONNECTS = Counter("vlm_operator_log_streams_ended_total",
                         "Follow streams that ended (container exit, timeout, dropped "
                         "connection) and were reopened.")
