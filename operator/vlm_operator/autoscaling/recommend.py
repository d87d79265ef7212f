"""Builtin autoscaling decisions. Pure and stateless: one ScalingRequest in (the pods' samples,
the current replicas, the need history, the time, the ScalingPolicy), one ScalingRecommendation
out (the replicas wanted, a ScalingReason, a message, and the history to pass next time).

The acting side (autoscaling/autoscaler.py) scrapes each pod's /metrics and feeds PodSamples here.

Load model. The need of one sample is in fractional replicas:
    max(sum(metric_i * (1 + multimodalWeight * images_per_request_i)) / target,
        sum(usage_i) / full for each capacity signal (api/scaling_signals.py: KV-cache usage))
over ready pods. Multimodal requests weigh more: images per request are observed per pod as the
increase of vllm:mm_cache_queries_total (one per multimodal item looked up) over the increase of
vllm:request_success_total between two scrapes; the last known ratio is kept while no request
finishes. The KV-cache term keeps replicas that are busy without a queue (waiting = 0, cache
full) from being scaled away.

Stabilisation (no oscillation under steady noisy load):
- fast scale-up: the minimum need over the last UP_WINDOW_S (three 1 s rounds) is above
  current * FAST_FACTOR -> ceil(that minimum) (a load step is followed within seconds, a
  one- or two-second burst is not);
- slow scale-up: the mean need over SMOOTH_WINDOW_S is above current * (1 + TOLERANCE);
- scale-down: only after scaleDownDelaySeconds of observation, to
  ceil(max over that delay of the SMOOTH_WINDOW_S mean need / (1 - TOLERANCE)): bursts average
  out, sustained peaks keep the replicas, and the hysteresis band between the up and down
  thresholds stops flapping at the boundary.
Pods still loading count as capacity on the way: needs are absolute replica counts compared
with the current replica count, which includes them.

Unknown is not zero: a ready pod whose /metrics could not be read (UNKNOWN) adds nothing to the
need, so the need of the others is a lower bound: it may scale up, but no scale-down happens
while any pod's load is unknown, no such pod is chosen to leave, and a draining one waits out
its drain limit (an overloaded pod is exactly the one that answers slowly).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from vlm_operator.api import scaling_signals
from vlm_operator.api.names import DRAIN_SINCE
from vlm_operator.api.validation import with_defaults
from vlm_operator.desired.children import IN_SERVICE_LABEL
from vlm_operator.desired.stopping import DRAIN_LIMIT_S
from vlm_operator.k8s.views import Pod

TOLERANCE = 0.2
FAST_FACTOR = 1.5
UP_WINDOW_S = 2.5
SMOOTH_WINDOW_S = 30.0
DRAIN_TIMEOUT_S = float(DRAIN_LIMIT_S)

READY, LOADING, PENDING, UNKNOWN = "ready", "loading", "pending", "unknown"


@dataclass(frozen=True)
class PodSample:
    """What the autoscaler knows about one pod at one scrape."""

    name: str
    state: str = READY  # READY (scraped), UNKNOWN (ready, scrape failed), LOADING (bound, not
    # ready), PENDING (not bound)
    metric: float = 0.0  # the configured vLLM metric, summed over the pod's engines
    usage: tuple[float, ...] = ()  # each capacity signal's gauge (scaling_signals.SIGNALS)
    images_per_request: float = 0.0
    busy: float = 0.0  # running + waiting requests: what a drain waits for
    failing: bool = False  # a recent failure signature (from log watching)
    fenced: bool = False  # out of the Service recovering in place (remediation/ladder.py's
    # fence): LOADING, capacity on its way back, and the first to go on a scale-down
    created: float = 0.0  # creation time in seconds; newer pods go first among equals


@dataclass(frozen=True)
class ScalingPolicy:
    """spec.autoscaling, as the decision reads it."""

    min_replicas: int = 1
    max_replicas: int = 1
    target: float = 5.0
    scale_down_delay_s: float = 300.0
    multimodal_weight: float = 1.0


def scaling_policy_from_spec(autoscaling: dict) -> ScalingPolicy:
    """The policy of spec.autoscaling; the schema's defaults fill what it leaves out."""
    spec = with_defaults({"autoscaling": dict(autoscaling)})["autoscaling"]
    return ScalingPolicy(
        min_replicas=int(spec["minReplicas"]),
        max_replicas=int(spec["maxReplicas"]),
        target=float(spec["target"]),
        scale_down_delay_s=float(spec["scaleDownDelaySeconds"]),
        multimodal_weight=float(spec["multimodalWeight"]),
    )


class Point(NamedTuple):
    t: float
    need: float
    smooth: float  # mean need over the SMOOTH_WINDOW_S up to t


class ScalingReason(StrEnum):
    """Why a recommendation wants the replicas it does: CamelCase, written into
    status.autoscaling.reason and used as the decisions metric's label. `decide` gives all but
    the last two; the autoscaler gives those when the GPU budget holds a scale-up back."""

    BELOW_MIN_REPLICAS = "BelowMinReplicas"
    ABOVE_MAX_REPLICAS = "AboveMaxReplicas"
    NO_METRICS = "NoMetrics"
    AT_MAX_REPLICAS = "AtMaxReplicas"
    SCALE_UP = "ScaleUp"
    LOAD_UNKNOWN = "LoadUnknown"
    SCALE_DOWN_DELAYED = "ScaleDownDelayed"
    SCALE_DOWN = "ScaleDown"
    WITHIN_TARGET = "WithinTarget"
    SCALING_LIMITED = "ScalingLimited"  # the free GPUs do not fit the scale-up
    GPU_BUDGET_UNKNOWN = "GPUBudgetUnknown"  # the free GPUs are not known


@dataclass(frozen=True)
class ScalingRequest:
    """Everything one decision reads. pods: this round's samples (any iterable; kept as a
    tuple); history: what the last recommendation returned, () at first."""

    pods: tuple[PodSample, ...]
    current: int
    history: tuple[Point, ...]
    now: float
    policy: ScalingPolicy

    def __post_init__(self) -> None:
        pods: Iterable[PodSample] = self.pods
        object.__setattr__(self, "pods", tuple(pods))


@dataclass(frozen=True)
class ScalingRecommendation:
    desired: int
    reason: ScalingReason
    message: str
    need: float | None  # replicas the load needs (fractional); None: no pod could be read
    history: tuple[Point, ...]  # pass on in the next request


def images_per_request(prev: tuple[float, float] | None, cur: tuple[float, float],
                       last: float) -> float:
    """Images per finished request between two scrapes of (request_success, mm_queries)."""
    if prev is None:
        return last
    done, images = cur[0] - prev[0], cur[1] - prev[1]
    if done <= 0 or images < 0:  # nothing finished, or the counters were reset (restart)
        return last
    return images / done


def load_need(pods: Iterable[PodSample], policy: ScalingPolicy) -> float | None:
    """Replicas (fractional) the ready pods' load needs; None when no pod could be scraped."""
    ready = [p for p in pods if p.state == READY]
    if not ready:
        return None
    weighted = sum(p.metric * (1 + policy.multimodal_weight * p.images_per_request)
                   for p in ready)
    if policy.target > 0:
        metric_need = weighted / policy.target
    else:
        metric_need = math.inf if weighted > 0 else 0.0
    # a sample without a signal's reading (none taken) counts 0 for it
    return max([metric_need, *(sum(p.usage[i] for p in ready if i < len(p.usage)) / signal.full
                               for i, signal in enumerate(scaling_signals.SIGNALS))])


def keep_seconds(policy: ScalingPolicy) -> float:
    return max(policy.scale_down_delay_s, SMOOTH_WINDOW_S) + UP_WINDOW_S + 5


def decide(request: ScalingRequest) -> ScalingRecommendation:
    """The replicas wanted now, before the GPU budget; history is returned updated."""
    pods, current, history = request.pods, request.current, request.history
    now, policy = request.now, request.policy
    lo, hi = policy.min_replicas, max(policy.min_replicas, policy.max_replicas)
    need = load_need(pods, policy)
    history = tuple(p for p in history if p.t >= now - keep_seconds(policy))
    if need is not None:
        window = [p.need for p in history if p.t > now - SMOOTH_WINDOW_S] + [need]
        history = (*history, Point(now, need, sum(window) / len(window)))

    def done(desired: int, reason: ScalingReason, message: str) -> ScalingRecommendation:
        return ScalingRecommendation(desired, reason, message, need, history)

    if current < lo:
        return done(lo, ScalingReason.BELOW_MIN_REPLICAS,
                    f"{current} replicas is below minReplicas {lo}")
    if current > hi:
        return done(hi, ScalingReason.ABOVE_MAX_REPLICAS,
                    f"{current} replicas is above maxReplicas {hi}")
    if need is None:
        return done(current, ScalingReason.NO_METRICS, "no ready pod to read load from")
    unknown = sorted(p.name for p in pods if p.state == UNKNOWN)

    recent = [p.need for p in history if p.t >= now - UP_WINDOW_S]
    fast = min(recent)
    mean = history[-1].smooth
    up = 0
    if len(recent) >= 2 and fast > current * FAST_FACTOR:
        up, why = _ceil(fast), f"load step: need {fast:.2f} replicas over {UP_WINDOW_S:g} s"
    settled = history[0].t <= now - SMOOTH_WINDOW_S / 2  # a mean of a few rounds is no mean
    if settled and mean > current * (1 + TOLERANCE) and _ceil(mean) > up:
        up, why = _ceil(mean), f"sustained load: need {mean:.2f} replicas over " \
                               f"{SMOOTH_WINDOW_S:g} s"
    if up > current:
        if current >= hi:
            return done(hi, ScalingReason.AT_MAX_REPLICAS, f"{why}, held at maxReplicas {hi}")
        return done(min(up, hi), ScalingReason.SCALE_UP, why)

    delay = policy.scale_down_delay_s
    peak = max(p.smooth for p in history if p.t >= now - delay)
    down = max(lo, _ceil(peak / (1 - TOLERANCE)))
    if down < current and unknown:
        return done(current, ScalingReason.LOAD_UNKNOWN,
                    f"not scaling down: the load of {', '.join(unknown)} is unknown (/metrics "
                    "unreadable)")
    if down >= current > max(lo, _ceil(need / (1 - TOLERANCE))):
        return done(current, ScalingReason.SCALE_DOWN_DELAYED,
                    f"load is low now (need {need:.2f}) but needed {peak:.2f} replicas within "
                    f"the {delay:g} s scale-down delay")
    if down < current:
        if history[0].t > now - delay:
            return done(current, ScalingReason.SCALE_DOWN_DELAYED,
                        f"load is low (need {peak:.2f}) for {now - history[0].t:.0f} s of the "
                        f"{delay:g} s scale-down delay")
        return done(down, ScalingReason.SCALE_DOWN,
                    f"need at most {peak:.2f} replicas over the last {delay:g} s")
    return done(current, ScalingReason.WITHIN_TARGET, f"need {need:.2f} replicas for {current}")


def _ceil(x: float) -> int:
    """ceil that forgives float noise (2.0000000001 -> 2) and caps infinity."""
    if math.isinf(x):
        return 1 << 30
    return math.ceil(x - 1e-9)


# ---------------------------------------------------------------- graceful scale-down

def victim_order(pods: list[PodSample]) -> list[PodSample]:
    """Pods in the order they should go: fenced, failing, not bound, loading, least busy,
    newest. Pods whose load is unknown are never picked."""
    rank = {PENDING: 0, LOADING: 1, READY: 2}
    return sorted((p for p in pods if p.state != UNKNOWN),
                  key=lambda p: (not p.fenced, not p.failing, rank[p.state], p.busy,
                                 -p.created, p.name))


class DrainPlan(NamedTuple):
    take_out: list[str]  # flip in-service to "false" and start draining
    put_back: list[str]  # no longer to be removed: back into the Service
    delete: list[str]  # drained (or not serving, or timed out): delete, then lower replicas


def plan_scale_down(pods: list[PodSample], desired: int, current: int,
                    draining: dict[str, float], now: float,
                    drain_timeout_s: float = DRAIN_TIMEOUT_S) -> DrainPlan:
    """Which pods leave the Service, come back, or are deleted this round. A fenced pod picked
    to go is deleted at once: it is out of the Service already and serves nothing, and is
    never marked as draining (a drain's end would put it back into the Service)."""
    by_name = {p.name: p for p in pods}
    draining = {n: t for n, t in draining.items() if n in by_name}
    excess = max(0, current - desired)
    if len(draining) > excess:  # load came back: keep the longest-draining ones
        keep = sorted(draining, key=lambda n: (draining[n], n))[:excess]
        put_back = sorted(set(draining) - set(keep))
        draining = {n: draining[n] for n in keep}
    else:
        put_back = []
    fresh = victim_order([p for p in pods if p.name not in draining])[:excess - len(draining)]
    take_out = [p.name for p in fresh if not p.fenced]
    delete = sorted([p.name for p in fresh if p.fenced] + [
        n for n, since in draining.items() if drained(by_name[n])
        or now - since >= drain_timeout_s])
    return DrainPlan(take_out, put_back, delete)


def drained(pod: PodSample) -> bool:
    """Nothing left to wait for: it does not serve, or it read idle (unknown is not idle)."""
    return pod.state in (LOADING, PENDING) or (pod.state == READY and pod.busy <= 0)


def draining_since(pod: dict) -> float | None:
    """When the autoscaler took this pod out of the Service (its annotation), if it did."""
    meta = Pod(pod)
    if meta.labels.get(IN_SERVICE_LABEL) != "false":
        return None
    try:
        return float(meta.annotations[DRAIN_SINCE])
    except (KeyError, TypeError, ValueError):
        return None


def stale_drains(pods: list[dict], builtin: bool) -> list[str]:
    """Pods the autoscaler took out that nothing will finish: Builtin autoscaling is off (a
    mode switch, autoscaling disabled). They go back into the Service."""
    if builtin:
        return []
    return sorted(Pod(p).name for p in pods if draining_since(p) is not None
                  and not Pod(p).deleting)
