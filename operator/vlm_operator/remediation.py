"""What to do about a pod whose log shows a failure signature. Pure: no I/O, times passed in.

logwatch.py feeds detections and pod objects in and carries the decisions out. Times are epoch
seconds; detections are timed by the kubelet's log timestamp, so replaying a log (a reconnect,
an operator restart) puts every line in the same window it fell in the first time.

Guards, in the order they are checked (the first that holds wins, so a skip names one reason):
below the threshold, the policy says Ignore, the incident is not newer than what was already
acted on (operator restarts re-read logs from the start), the pod is already going away, /health
answers 200 for an engine said to be dead (log lines are evidence, not proof: see signatures.py),
the pod's back-off, the VLMDeployment's restart budget, and minAvailable ready pods.

Pods with the tokenizer pool's startup line missing get their own condition, `Unpatched`, not
`Degraded`: an unpatched engine still serves (it may log retries or answer some requests with
400), while Degraded is kept for "the operator cannot keep this healthy" (restart budget spent,
crash loops).
"""

from __future__ import annotations

import datetime as dt
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from vlm_operator import builders
from vlm_operator.spec import with_defaults
from vlm_operator.status import Report

RESTART, SCALE_DOWN, IGNORE = "Restart", "ScaleDown", "Ignore"
HOUR = 3600.0
BACKOFF_BASE_S = 10.0
BACKOFF_CAP_S = 600.0
UNPATCHED_GRACE_S = 60.0

# Signature -> the spec.health key whose policy applies; spec.health.extraSignatures add their
# own. Signatures without a policy are only counted.
SIGNATURE_POLICY = {
    "tokenizer_retry": "tokenizerRetry",
    "tokenizer_borrow_error": "tokenizerRetry",
    "engine_dead": "engineDead",
}
# Skip reasons that are guards (counted in the skipped-actions metric and worth an Event).
GUARDS = ("already_acted", "in_progress", "health_ok", "backoff", "budget_exhausted",
          "min_available")


@dataclass(frozen=True, slots=True)
class Rule:
    threshold: int
    window_s: float
    action: str


@dataclass(frozen=True, slots=True)
class Policy:
    rules: Mapping[str, Rule]
    max_restarts_per_hour: int
    min_available: int
    signature_policy: Mapping[str, str] = field(default_factory=lambda: dict(SIGNATURE_POLICY))

    def rule_for(self, signature: str) -> tuple[str, Rule] | None:
        key = self.signature_policy.get(signature)
        return (key, self.rules[key]) if key in self.rules else None


def policy_from_spec(spec: Mapping) -> Policy:
    """The policy of a VLMDeployment spec; the schema's defaults fill what it leaves out.

    Each of spec.health.extraSignatures gets a rule of its own, keyed `extra:<name>`."""
    health = with_defaults({"health": dict(spec.get("health") or {})})["health"]
    rules = {key: Rule(int(health[key]["threshold"]), float(health[key]["windowSeconds"]),
                       health[key]["action"]) for key in ("tokenizerRetry", "engineDead")}
    mapping = dict(SIGNATURE_POLICY)
    for extra in health.get("extraSignatures") or []:
        key = f"extra:{extra['name']}"
        rules[key] = Rule(int(extra["threshold"]), float(extra["windowSeconds"]), extra["action"])
        mapping[extra["name"]] = key
    return Policy(rules, int(health["maxRestartsPerHour"]), int(health["minAvailable"]), mapping)


class Windows:
    """Per-pod sliding-window counters of incidents, one per policy key."""

    def __init__(self) -> None:
        self._times: dict[tuple[str, str], deque[float]] = {}

    def add(self, pod: str, key: str, t: float, window_s: float) -> int:
        """Count an incident at t; return how many fall in (t - window_s, t]."""
        times = self._times.setdefault((pod, key), deque())
        times.append(t)
        return self.count(pod, key, t, window_s)

    def count(self, pod: str, key: str, now: float, window_s: float) -> int:
        times = self._times.get((pod, key))
        if not times:
            return 0
        while times and times[0] <= now - window_s:
            times.popleft()
        return sum(1 for t in times if t <= now)

    def forget(self, pod: str) -> None:
        for k in [k for k in self._times if k[0] == pod]:
            del self._times[k]


def backoff_s(attempts: int, base: float = BACKOFF_BASE_S, cap: float = BACKOFF_CAP_S) -> float:
    """Exponential per-pod back-off after the n-th held-back or failed attempt (n >= 1)."""
    return min(cap, base * 2 ** max(0, attempts - 1))


def restarts_in_hour(history: Iterable[float], now: float) -> int:
    return sum(1 for t in history if now - HOUR < t <= now)


# ---------------------------------------------------------------- pods


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class PodView:
    name: str
    ready: bool
    deleting: bool = False
    in_service: bool = True
    engine_dead: bool = False  # the log says so: not ready capacity whatever the probe says

    @property
    def capacity(self) -> bool:
        return self.ready and not self.deleting and self.in_service and not self.engine_dead


def _ready_condition(pod: Mapping) -> Mapping:
    return next((c for c in (pod.get("status") or {}).get("conditions") or []
                 if c.get("type") == "Ready"), {})


def pod_view(pod: Mapping, engine_dead: bool = False) -> PodView:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    return PodView(meta.get("name", ""), _ready_condition(pod).get("status") == "True",
                   bool(meta.get("deletionTimestamp")),
                   labels.get(builders.IN_SERVICE_LABEL, "true") != "false", engine_dead)


# ---------------------------------------------------------------- deciding


@dataclass(frozen=True, slots=True)
class Decision:
    action: str | None  # Restart | ScaleDown; None: hold back
    reason: str  # machine-friendly: act | below_threshold | ignored | one of GUARDS
    message: str

    @property
    def act(self) -> bool:
        return self.action is not None


def decide(*, pod: str, signature: str, rule: Rule, count: int, incident_time: float,
           now: float, pods: Iterable[PodView], history: Iterable[float], policy: Policy,
           acted_until: float | None = None, backoff_until: float | None = None,
           health: str | None = None) -> Decision:
    """Act on `pod` for `signature` or say why not.

    count: incidents in the rule's window; history: times of this VLMDeployment's restarts;
    acted_until: the newest incident time already acted on for this pod (persisted);
    health: "ok" (GET /health said 200), "failing", "unreachable" or None (not asked)."""
    def skip(reason: str, message: str) -> Decision:
        return Decision(None, reason, message)

    if count < rule.threshold:
        return skip("below_threshold", f"{count}/{rule.threshold} {signature} in "
                    f"{rule.window_s:g} s")
    if rule.action == IGNORE:
        return skip("ignored", f"{signature} on {pod}: the policy says Ignore")
    if acted_until is not None and incident_time <= acted_until:
        return skip("already_acted", f"{signature} on {pod} at {incident_time:.3f} was "
                    "already acted on")
    views = list(pods)
    target = next((p for p in views if p.name == pod), None)
    if target is not None and (target.deleting or not target.in_service):
        return skip("in_progress", f"{pod} is already being removed")
    if signature == "engine_dead" and health == "ok":
        return skip("health_ok", f"{pod} logged engine death but /health answers 200")
    if backoff_until is not None and now < backoff_until:
        return skip("backoff", f"{pod} is backing off for {backoff_until - now:.0f} s")
    spent = restarts_in_hour(history, now)
    if spent >= policy.max_restarts_per_hour:
        return skip("budget_exhausted", f"{spent} restarts in the last hour, the most "
                    f"spec.health.maxRestartsPerHour allows ({policy.max_restarts_per_hour})")
    ready = sum(1 for p in views if p.capacity)
    after = ready - (1 if target is not None and target.capacity else 0)
    if after < policy.min_available:
        return skip("min_available", f"removing {pod} would leave {after} ready pods, fewer than "
                    f"spec.health.minAvailable ({policy.min_available})")
    return Decision(rule.action, "act", f"{count} {signature} in {rule.window_s:g} s on {pod} "
                    f"(threshold {rule.threshold}): {rule.action}")


def scale_down_replicas(current: int, min_available: int) -> int | None:
    """The replica count after a ScaleDown, or None when capacity must not be lowered."""
    target = current - 1
    return target if target >= max(min_available, 0) else None


def budget_report(history: Iterable[float], now: float, policy: Policy) -> Report | None:
    """Degraded while the restart budget of the last hour is spent: the operator stops acting
    rather than flapping, and says so."""
    spent = restarts_in_hour(history, now)
    if spent < policy.max_restarts_per_hour:
        return None
    return Report("Degraded", "True", "RestartBudgetExhausted",
                  f"{spent} remediations in the last hour (spec.health.maxRestartsPerHour="
                  f"{policy.max_restarts_per_hour}); further failures are only reported")


# ---------------------------------------------------------------- pod status alone


@dataclass(frozen=True, slots=True)
class Finding:
    """Something a pod's status (with what its log said) shows; reported with one Event."""

    kind: str  # ExitedAfterEngineDeath | CrashLoopBackOff | Unpatched
    message: str
    key: str  # identity for "Event once"


def _container_status(pod: Mapping) -> Mapping:
    return next((c for c in (pod.get("status") or {}).get("containerStatuses") or []
                 if c.get("name") == builders.CONTAINER), {})


def pod_findings(pod: Mapping, *, now: float, engine_dead_at: float | None,
                 plugin: str | None, grace_s: float = UNPATCHED_GRACE_S) -> list[Finding]:
    """Findings from one pod. engine_dead_at: time of the last engine_dead incident its log
    showed; plugin: "active", "inactive: <reason>" or None (no startup line seen in the
    current container)."""
    name = (pod.get("metadata") or {}).get("name", "")
    cs = _container_status(pod)
    out = []
    last = (cs.get("lastState") or {}).get("terminated") or {}
    finished = parse_time(last.get("finishedAt"))
    if engine_dead_at is not None and finished is not None and finished >= engine_dead_at:
        code = last.get("exitCode")
        out.append(Finding("ExitedAfterEngineDeath",
                           f"{name}: the vllm container exited with code {code} after its engine "
                           "died" + (" (exit code 0 hides the crash)" if code == 0 else ""),
                           f"{name}/exited/{cs.get('restartCount', 0)}"))
    waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
    if waiting == "CrashLoopBackOff":
        out.append(Finding("CrashLoopBackOff", f"{name}: the vllm container is crash-looping "
                           f"({cs.get('restartCount', 0)} restarts)", f"{name}/crashloop"))
    due = unpatched_due(pod, plugin=plugin, grace_s=grace_s)
    if plugin is not None and plugin.startswith("inactive"):
        out.append(Finding("Unpatched", f"{name}: tokenizer pool plugin {plugin}",
                           f"{name}/unpatched/{cs.get('restartCount', 0)}"))
    elif due is not None and now > due:
        out.append(Finding("Unpatched", f"{name}: ready for {now - due + grace_s:.0f} s without "
                           "the tokenizer pool plugin's startup line",
                           f"{name}/unpatched/{cs.get('restartCount', 0)}"))
    return out


def unpatched_due(pod: Mapping, *, plugin: str | None,
                  grace_s: float = UNPATCHED_GRACE_S) -> float | None:
    """When a ready pod without the plugin's startup line becomes Unpatched (None: it cannot)."""
    ready = _ready_condition(pod)
    since = parse_time(ready.get("lastTransitionTime"))
    if plugin is not None or ready.get("status") != "True" or since is None:
        return None
    return since + grace_s


def unpatched_report(findings_by_pod: Mapping[str, list[Finding]]) -> Report | None:
    """The Unpatched condition over the pods seen so far (None: no pod seen)."""
    if not findings_by_pod:
        return None
    bad = sorted(p for p, fs in findings_by_pod.items() if any(f.kind == "Unpatched" for f in fs))
    if bad:
        return Report("Unpatched", "True", "PluginMissing",
                      "pods without an active tokenizer pool: " + ", ".join(bad))
    return Report("Unpatched", "False", "AllPodsPatched",
                  "every pod logged the tokenizer pool's startup line or is within its grace")
