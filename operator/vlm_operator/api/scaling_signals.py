"""The load signals every autoscaling mode reads besides spec.autoscaling.metric, each declared
once: a vLLM gauge and its value on one fully used replica. Builtin mode's need
(autoscaling/recommend.py) takes the sum over ready pods divided by that value, the round's
scrape reads the gauge (autoscaling/autoscaler.py), the HPA asks prometheus-adapter for it as a
Pods metric with that target and KEDA queries its sum with that threshold
(desired/autoscaler_objects.py, api/promql.py). A new signal is one entry here and its tests.
Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CapacitySignal:
    metric: str  # a vLLM gauge on each pod's /metrics (summed over its engines)
    full: float  # its value on one fully used replica
    why: str  # what it keeps from being scaled away


SIGNALS: tuple[CapacitySignal, ...] = (
    CapacitySignal("vllm:kv_cache_usage_perc", 0.8,
                   "replicas busy without a queue (waiting 0, KV cache full)"),
)
