"""Builtin autoscaling decisions. Pure: samples, history and time in; replicas and reasons out.

The acting side (autoscaler.py) scrapes each pod's /metrics and feeds PodSamples here.

Load model. The need of one sample is in fractional replicas:
    max(sum(metric_i * (1 + multimodalWeight * images_per_request_i)) / target,
        sum(kv_cache_usage_i) / KV_HIGH)
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from vlm_operator.spec import with_defaults

TOLERANCE = 0.2
FAST_FACTOR = 1.5
UP_WINDOW_S = 2.5
SMOOTH_WINDOW_S = 30.0
KV_HIGH = 0.8
DRAIN_TIMEOUT_S = 120.0
GPU = "nvidia.com/gpu"

READY, LOADING, PENDING = "ready", "loading", "pending"


@dataclass(frozen=True)
class PodSample:
    """What the autoscaler knows about one pod at one scrape."""

    name: str
    state: str = READY  # READY (scraped), LOADING (bound, not ready), PENDING (not bound)
    metric: float = 0.0  # the configured vLLM metric, summed over the pod's engines
    kv_cache: float = 0.0  # vllm:kv_cache_usage_perc (0..1)
    images_per_request: float = 0.0
    busy: float = 0.0  # running + waiting requests: what a drain waits for
    failing: bool = False  # a recent failure signature (from log watching)
    created: float = 0.0  # creation time in seconds; newer pods go first among equals


@dataclass(frozen=True)
class Policy:
    min_replicas: int = 1
    max_replicas: int = 1
    target: float = 5.0
    scale_down_delay_s: float = 300.0
    multimodal_weight: float = 1.0


def policy_from_spec(autoscaling: dict) -> Policy:
    """The policy of spec.autoscaling; the schema's defaults fill what it leaves out."""
    spec = with_defaults({"autoscaling": dict(autoscaling)})["autoscaling"]
    return Policy(
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


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str  # CamelCase, also the metrics label
    message: str
    need: float | None
    history: tuple[Point, ...]


def images_per_request(prev: tuple[float, float] | None, cur: tuple[float, float],
                       last: float) -> float:
    """Images per finished request between two scrapes of (request_success, mm_queries)."""
    if prev is None:
        return last
    done, images = cur[0] - prev[0], cur[1] - prev[1]
    if done <= 0 or images < 0:  # nothing finished, or the counters were reset (restart)
        return last
    return images / done


def load_need(pods: list[PodSample], policy: Policy) -> float | None:
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
    return max(metric_need, sum(p.kv_cache for p in ready) / KV_HIGH)


def keep_seconds(policy: Policy) -> float:
    return max(policy.scale_down_delay_s, SMOOTH_WINDOW_S) + UP_WINDOW_S + 5


def decide(pods: list[PodSample], current: int, history: tuple[Point, ...], now: float,
           policy: Policy) -> Decision:
    """The replicas wanted now, before the GPU budget; history is returned updated."""
    lo, hi = policy.min_replicas, max(policy.min_replicas, policy.max_replicas)
    need = load_need(pods, policy)
    history = tuple(p for p in history if p.t >= now - keep_seconds(policy))
    if need is not None:
        window = [p.need for p in history if p.t > now - SMOOTH_WINDOW_S] + [need]
        history = (*history, Point(now, need, sum(window) / len(window)))

    def done(desired: int, reason: str, message: str) -> Decision:
        return Decision(desired, reason, message, need, history)

    if current < lo:
        return done(lo, "BelowMinReplicas", f"{current} replicas is below minReplicas {lo}")
    if current > hi:
        return done(hi, "AboveMaxReplicas", f"{current} replicas is above maxReplicas {hi}")
    if need is None:
        return done(current, "NoMetrics", "no ready pod to read load from")

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
            return done(hi, "AtMaxReplicas", f"{why}, held at maxReplicas {hi}")
        return done(min(up, hi), "ScaleUp", why)

    delay = policy.scale_down_delay_s
    peak = max(p.smooth for p in history if p.t >= now - delay)
    down = max(lo, _ceil(peak / (1 - TOLERANCE)))
    if down >= current > max(lo, _ceil(need / (1 - TOLERANCE))):
        return done(current, "ScaleDownDelayed",
                    f"load is low now (need {need:.2f}) but needed {peak:.2f} replicas within "
                    f"the {delay:g} s scale-down delay")
    if down < current:
        if history[0].t > now - delay:
            return done(current, "ScaleDownDelayed",
                        f"load is low (need {peak:.2f}) for {now - history[0].t:.0f} s of the "
                        f"{delay:g} s scale-down delay")
        return done(down, "ScaleDown",
                    f"need at most {peak:.2f} replicas over the last {delay:g} s")
    return done(current, "WithinTarget", f"need {need:.2f} replicas for {current}")


def _ceil(x: float) -> int:
    """ceil that forgives float noise (2.0000000001 -> 2) and caps infinity."""
    if math.isinf(x):
        return 1 << 30
    return math.ceil(x - 1e-9)


# ---------------------------------------------------------------- the cluster's GPU budget

def _gpus(resources: dict | None) -> int:
    resources = resources or {}
    value = (resources.get("requests") or {}).get(GPU, (resources.get("limits") or {}).get(GPU))
    try:
        return int(str(value)) if value is not None else 0
    except ValueError:
        return 0


def pod_gpus(pod: dict) -> int:
    """GPUs a pod requests: the sum over its containers, or its largest init container."""
    spec = pod.get("spec") or {}
    main = sum(_gpus(c.get("resources")) for c in spec.get("containers") or [])
    init = max((_gpus(c.get("resources")) for c in spec.get("initContainers") or []), default=0)
    return max(main, init)


def _node_ready(node: dict) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def free_gpus(nodes: list[dict], pods: list[dict]) -> int:
    """Allocatable GPUs of Ready, schedulable Nodes minus what pods bound to them request.

    Pending (unbound) pods are not subtracted: they are what the budget is shared between.
    """
    usable = {n["metadata"]["name"]: _gpus({"requests": (n.get("status") or {}).get(
        "allocatable")}) for n in nodes if _node_ready(n)}
    used = sum(pod_gpus(p) for p in pods
               if (p.get("spec") or {}).get("nodeName") in usable
               and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))
    return max(0, sum(usable.values()) - used)


class Claim(NamedTuple):
    """One VLMDeployment's ask for GPUs; `bound` replicas already hold theirs."""

    key: tuple[str, str]
    priority: int
    gpus_per_replica: int
    current: int
    bound: int
    desired: int


def share_gpus(free: int, claims: list[Claim]) -> dict[tuple[str, str], int]:
    """Granted replicas per claim: free GPUs go to higher priority first (ties by name).

    Scale-downs and holds are always granted; a scale-up gets only replicas whose GPUs are free,
    never below the current count (pods already asked for are left to the scheduler).
    """
    granted = {}
    for c in sorted(claims, key=lambda c: (-c.priority, c.key)):
        want = max(0, max(c.desired, c.current) - c.bound)
        take = min(want, free // max(1, c.gpus_per_replica))
        free -= take * c.gpus_per_replica
        if c.desired <= c.current:
            granted[c.key] = c.desired
        else:
            granted[c.key] = max(c.current, min(c.desired, c.bound + take))
    return granted


# ---------------------------------------------------------------- graceful scale-down

def victim_order(pods: list[PodSample]) -> list[PodSample]:
    """Pods in the order they should go: failing, not bound, loading, least busy, newest."""
    rank = {PENDING: 0, LOADING: 1, READY: 2}
    return sorted(pods, key=lambda p: (not p.failing, rank.get(p.state, 0), p.busy,
                                       -p.created, p.name))


class DrainPlan(NamedTuple):
    take_out: list[str]  # flip in-service to "false" and start draining
    put_back: list[str]  # no longer to be removed: back into the Service
    delete: list[str]  # drained (or not serving, or timed out): delete, then lower replicas


def plan_scale_down(pods: list[PodSample], desired: int, current: int,
                    draining: dict[str, float], now: float,
                    drain_timeout_s: float = DRAIN_TIMEOUT_S) -> DrainPlan:
    """Which pods leave the Service, come back, or are deleted this round."""
    by_name = {p.name: p for p in pods}
    draining = {n: t for n, t in draining.items() if n in by_name}
    excess = max(0, current - desired)
    if len(draining) > excess:  # load came back: keep the longest-draining ones
        keep = sorted(draining, key=lambda n: (draining[n], n))[:excess]
        put_back = sorted(set(draining) - set(keep))
        draining = {n: draining[n] for n in keep}
    else:
        put_back = []
    fresh = [p.name for p in victim_order([p for p in pods if p.name not in draining])]
    take_out = fresh[:excess - len(draining)]
    delete = sorted(n for n, since in draining.items()
                    if by_name[n].state != READY or by_name[n].busy <= 0
                    or now - since >= drain_timeout_s)
    return DrainPlan(take_out, put_back, delete)
