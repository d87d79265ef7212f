"""The operator's Prometheus metrics, served on --metrics-port at /metrics."""

from __future__ import annotations

from prometheus_client import Counter

RECONCILES = Counter("vlm_operator_reconciles_total",
                     "Reconcile passes over VLMDeployments, by outcome.", ["result"])
EVENTS = Counter("vlm_operator_events_total",
                 "Kubernetes Events the operator recorded, by type and reason.",
                 ["type", "reason"])
