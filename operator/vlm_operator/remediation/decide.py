"""What to do about a pod whose log shows a failure signature. Pure: no I/O, times passed in.

logs/watcher.py feeds incidents (remediation/incidents.py) and pod objects in and carries the
decisions out.

Guards, in the order they are checked (the first that holds wins, so a skip names one reason):
below the threshold, the policy says Ignore, the incident is older than its window (a replayed
or long-held line), it was already acted on (an action in flight names it), the pod is already
going away or being acted on, /health answers 200 for an engine said to be dead (log lines are
evidence, not proof: see logs/signatures.py), the pod's back-off after a failed attempt, the
VLMDeployment's restart budget, and minAvailable. minAvailable only protects capacity: removing
a pod that serves nothing (engine dead, not ready) never lowers it, so a single dead replica, or
every replica dead at once, is restarted. When the pod still serves and removing it would break
minAvailable, it is replaced instead: one extra replica is surged (if a GPU is free once the
VLMDeployment's pending claims took theirs), and the sick pod is drained and deleted once the
replacement is ready. A pod an action is already removing is not counted as capacity.

Node drains (node_drain_action): a pod on a node that is leaving whose eviction minAvailable
refuses gets a Replace of its own, or waits for capacity at most the node drain wait, then goes.

Held-back incidents stay open and are decided again when the blocking condition may have changed
(pod events, spec changes, a short timer), until acted on, gone or older than their window.

Pods with the tokenizer pool's startup line missing get their own condition, `Unpatched`, not
`Degraded`: an unpatched engine still serves (it may log retries or answer some requests with
400), while Degraded is kept for "the operator cannot keep this healthy" (restart budget spent,
crash loops). A pod whose log the operator cannot read (no line with vLLM's header by the time
the startup line would be due, or a logging prefix it cannot know) is reported with
`LogDetectionOff` instead: a missing line there says nothing about the plugin, and log-based
detection (engine death, tokenizer retries) is off for that pod.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from vlm_operator.api.reports import Report
from vlm_operator.api.validation import with_defaults
from vlm_operator.desired import children
from vlm_operator.k8s.pods import container_status, is_ready, parse_time, ready_condition
from vlm_operator.remediation.incidents import (
    NODE_DRAIN,
    REPLACE,
    SCALE_DOWN,
    Incident,
    InFlight,
    restarts_in_hour,
)

RESTART, IGNORE = "Restart", "Ignore"
ACTIONS = (RESTART, SCALE_DOWN, REPLACE)
BACKOFF_BASE_S = 10.0
BACKOFF_CAP_S = 600.0
UNPATCHED_GRACE_S = 60.0
DRAIN_MIN_S = float(children.ENDPOINTS_LAG_S)  # for the endpoints to drop a pod taken out
DRAIN_TIMEOUT_S = 60.0
# A replacement gets as long as the startup probe gives a model load (children.py), plus the
# time to schedule it: after that the surge is given up and the incident held.
REPLACE_TIMEOUT_S = children.STARTUP_PERIOD_SECONDS * children.STARTUP_FAILURE_THRESHOLD + 300

# Signature -> the spec.health key whose policy applies; spec.health.extraSignatures add their
# own. Signatures without a policy are only counted.
SIGNATURE_POLICY = {
    "tokenizer_retry": "tokenizerRetry",
    "tokenizer_borrow_error": "tokenizerRetry",
    "engine_dead": "engineDead",
    "engine_stalled": "engineStalled",  # from stalls/watch.py, not from the log
    "api_unresponsive": "apiUnresponsive",
}
# Signals stalls/watch.py finds, not the log (a log replay never refills their windows).
NOT_FROM_LOG = ("engine_stalled", "api_unresponsive")
# Signals that prove the pod serves nothing, whatever its readiness says.
NOT_SERVING = ("engine_dead", "engine_stalled", "api_unresponsive")
INCIDENT_WINDOW_S = 60.0  # how long a stall or unresponsive-API incident stays actionable
# Skip reasons that are guards (counted in the skipped-actions metric).
GUARDS = ("expired", "already_acted", "in_progress", "health_ok", "backoff", "budget_exhausted",
          "min_available")
# Guards that hold an incident open (it is decided again later), with the reason the
# Remediating condition gives while they do.
HOLDING = {"health_ok": "HealthCheckPassing", "backoff": "BackingOff",
           "budget_exhausted": "RestartBudgetExhausted", "min_available": "WaitingForCapacity"}


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
    # one stall or unresponsive-API verdict is the incident (stalls/watch.py counts for it)
    stalled = health["engineStalled"]
    rules["engineStalled"] = Rule(1, max(INCIDENT_WINDOW_S, 2.0 * stalled["stallSeconds"]),
                                  stalled["action"])
    rules["apiUnresponsive"] = Rule(1, INCIDENT_WINDOW_S, health["apiUnresponsive"]["action"])
    mapping = dict(SIGNATURE_POLICY)
    for extra in health.get("extraSignatures") or []:
        key = f"extra:{extra['name']}"
        rules[key] = Rule(int(extra["threshold"]), float(extra["windowSeconds"]), extra["action"])
        mapping[extra["name"]] = key
    return Policy(rules, int(health["maxRestartsPerHour"]), int(health["minAvailable"]), mapping)


def backoff_s(attempts: int, base: float = BACKOFF_BASE_S, cap: float = BACKOFF_CAP_S) -> float:
    """Exponential per-pod back-off after the n-th failed attempt (n >= 1)."""
    return min(cap, base * 2 ** max(0, attempts - 1))


# ---------------------------------------------------------------- pods



@dataclass(frozen=True, slots=True)
class PodView:
    name: str
    ready: bool
    deleting: bool = False
    in_service: bool = True
    engine_dead: bool = False  # the log says so: not ready capacity whatever the probe says
    in_flight: bool = False  # an action on it (drain, replacement) is under way

    @property
    def serves(self) -> bool:
        """It may hold requests: ready, not going away, its engine alive (in the Service or
        taken out of it to drain: requests already sent still finish there)."""
        return self.ready and not self.deleting and not self.engine_dead

    @property
    def capacity(self) -> bool:
        """It serves and takes new requests (the Service selects it)."""
        return self.serves and self.in_service



def pod_view(pod: Mapping, engine_dead: bool = False, in_flight: bool = False) -> PodView:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    return PodView(meta.get("name", ""), is_ready(pod),
                   bool(meta.get("deletionTimestamp")),
                   labels.get(children.IN_SERVICE_LABEL, "true") != "false", engine_dead,
                   in_flight)


# ---------------------------------------------------------------- deciding


@dataclass(frozen=True, slots=True)
class Decision:
    action: str | None  # Restart | ScaleDown | Replace; None: hold back or nothing to do
    reason: str  # machine-friendly: act | below_threshold | ignored | one of GUARDS
    message: str

    @property
    def act(self) -> bool:
        return self.action is not None

    @property
    def holds(self) -> bool:
        """Held back by something that may clear: decide again later."""
        return self.reason in HOLDING


def others_ready(pods: Iterable[PodView], pod: str) -> int:
    """Pods other than `pod` that take requests and stay: one an action in flight is about to
    remove (a Replace's sick pod, a drain) is not counted, so its replacement is not taken for
    spare capacity by another removal."""
    return sum(1 for p in pods if p.capacity and not p.in_flight and p.name != pod)


def needs_replacement(pods: Iterable[PodView], pod: str, policy: Policy,
                      signature: str = "") -> bool:
    """Removing `pod` would take ready capacity below minAvailable: it serves, and too few
    others do. A pod that serves nothing can always go: not ready, its engine dead, or proven
    mute by the signal itself (a stalled engine, an API server that answers nothing)."""
    views = list(pods)
    target = next((p for p in views if p.name == pod), None)
    if target is None or not target.capacity or signature in NOT_SERVING:
        return False
    return others_ready(views, pod) < policy.min_available


def decide(*, incident: Incident, rule: Rule, now: float, pods: Iterable[PodView],
           history: Iterable[float], policy: Policy, acted_until: float | None = None,
           backoff_until: float | None = None, health: str | None = None,
           spare_gpus: bool | None = None) -> Decision:
    """Act on the incident's pod or say why not.

    history: times of this VLMDeployment's remediations; acted_until: the newest incident time
    already acted on for this pod (persisted); health: "ok" (GET /health said 200), "failing",
    "unreachable" or None (not asked); spare_gpus: whether one more replica fits the free GPUs
    (None: not known), asked only when needs_replacement() says so."""
    pod, signature, count = incident.pod, incident.signature, incident.count

    def skip(reason: str, message: str) -> Decision:
        return Decision(None, reason, message)

    if count < rule.threshold:
        return skip("below_threshold", f"{count}/{rule.threshold} {signature} in "
                    f"{rule.window_s:g} s")
    if rule.action == IGNORE:
        return skip("ignored", f"{signature} on {pod}: the policy says Ignore")
    if now - incident.last >= rule.window_s:
        return skip("expired", f"{signature} on {pod}: the last detection is "
                    f"{now - incident.last:.0f} s old, outside the {rule.window_s:g} s window")
    if acted_until is not None and incident.last <= acted_until:
        return skip("already_acted", f"{signature} on {pod} at {incident.last:.3f} was "
                    "already acted on")
    views = list(pods)
    target = next((p for p in views if p.name == pod), None)
    if target is not None and (target.deleting or not target.in_service or target.in_flight):
        return skip("in_progress", f"{pod} is already being removed or replaced")
    if signature == "engine_dead" and health == "ok":
        return skip("health_ok", f"{pod} logged engine death but /health answers 200")
    if backoff_until is not None and now < backoff_until:
        return skip("backoff", f"{pod} is backing off for {backoff_until - now:.0f} s after a "
                    "failed attempt")
    spent = restarts_in_hour(history, now)
    if spent >= policy.max_restarts_per_hour:
        return skip("budget_exhausted", f"{spent} remediations in the last hour, the most "
                    f"spec.health.maxRestartsPerHour allows ({policy.max_restarts_per_hour})")
    what = (f"{signature} on {pod}: {incident.detail}" if incident.detail else
            f"{count} {signature} in {rule.window_s:g} s on {pod} (threshold {rule.threshold})")
    if needs_replacement(views, pod, policy, signature):
        others = others_ready(views, pod)
        if spare_gpus:
            return Decision(REPLACE, "act", f"{what}: Replace (it still serves and only "
                            f"{others} other pods are ready, spec.health.minAvailable="
                            f"{policy.min_available}): a replacement comes up first")
        why = ("no GPU is free for a replacement" if spare_gpus is False
               else "the free GPUs could not be read")
        return skip("min_available", f"removing {pod} would leave {others} ready pods, fewer "
                    f"than spec.health.minAvailable ({policy.min_available}), and {why}")
    return Decision(rule.action, "act", f"{what}: {rule.action}")


def scale_down_replicas(current: int, min_available: int) -> int | None:
    """The replica count after a ScaleDown, or None when capacity must not be lowered."""
    target = current - 1
    return target if target >= max(min_available, 0) else None


# ---------------------------------------------------------------- actions in flight

WAIT, DELETE, FINISH, GIVE_UP = "wait", "delete", "finish", "give_up"
SURGE, TAKE_OUT, LET_GO, ABANDON, DROP = "surge", "take_out", "let_go", "abandon", "drop"
# A replacement no node takes for this long: the surge is given up.
UNSCHEDULABLE_S = 60.0
# How long a drain of a node (kubectl drain, the cluster autoscaler, Karpenter) is held for a
# pod minAvailable protects while no GPU is free elsewhere for its replacement; then the pod is
# drained and deleted, so no drain waits for ever (`vlm-operator run --node-drain-wait-seconds`).
NODE_DRAIN_WAIT_S = 600.0


def drain_step(*, serving: bool, running: float | None, since: float, now: float,
               timeout_s: float = DRAIN_TIMEOUT_S, min_drain_s: float = DRAIN_MIN_S) -> str:
    """A pod out of the Service since `since`: DELETE once its requests finished, or it serves
    nothing, or the drain limit passed; else WAIT. running: requests in flight; None when
    /metrics could not be read, which is waited out like a busy pod (unknown is not zero). The
    first min_drain_s always pass: the endpoints must drop the pod before it counts as idle."""
    if now - since < min_drain_s:
        return WAIT
    if not serving or running == 0 or now - since >= timeout_s:
        return DELETE
    return WAIT


SETTLE_S = 30.0  # past a deleted pod's deadline, it is taken as gone (a node that vanished)


def settled(pod: Mapping | None, now: float, settle_s: float = SETTLE_S) -> bool:
    """Whether a deleted pod has left for good: gone from the cluster, or settle_s past the
    deadline the kubelet had to stop it (deletionTimestamp). An action lowers the replica count
    only then: while the pod is terminating, a ReplicaSet that has not seen its deletion yet
    counts it, and lowering the count then can make it remove a pod that serves (with two Ready
    pods it removes the one Ready the shortest: the replacement)."""
    if pod is None:
        return True
    deadline = parse_time((pod.get("metadata") or {}).get("deletionTimestamp"))
    return deadline is not None and now >= deadline + settle_s


def scale_down_step(*, present: bool, serving: bool, running: float | None, since: float,
                    now: float, timeout_s: float = DRAIN_TIMEOUT_S,
                    min_drain_s: float = DRAIN_MIN_S) -> str:
    """The next step of a ScaleDown: wait for the drain, or delete the pod; FINISH (lower the
    replicas) once it is gone (the caller waits until it has `settled`)."""
    if not present:
        return FINISH
    return drain_step(serving=serving, running=running, since=since, now=now,
                      timeout_s=timeout_s, min_drain_s=min_drain_s)


def replace_step(*, record: InFlight, present: bool, serves: bool, running: float | None,
                 others_ready: int, min_available: int, replacement_ready: bool,
                 unschedulable_s: float, replicas: int, leaving: bool,
                 spare_gpus: bool | None, now: float, timeout_s: float = REPLACE_TIMEOUT_S,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S,
                 node_drain_wait_s: float = NODE_DRAIN_WAIT_S,
                 min_drain_s: float = DRAIN_MIN_S) -> str:
    """The next step of a Replace, from what the cluster shows now:

    - the pod is gone: FINISH (the caller waits until it has `settled`);
    - it is out of the Service (record.drain_since): drain_step (requests finish first);
    - it serves nothing: DELETE (nothing to wait for);
    - its node has been leaving for node_drain_wait_s: LET_GO (drain it, then delete);
    - no surge yet (a node drain waiting for capacity): DROP when its node is no longer
      leaving or the others now keep minAvailable (the eviction goes through by itself), SURGE
      when a replica fits the free GPUs, else WAIT;
    - the others (with the replacement, once ready) keep minAvailable: TAKE_OUT (drain first);
    - spec.replicas went below the count it began with (HPA, KEDA, a user): ABANDON at once,
      the ReplicaSet removes the newest, not-ready pod first, which is the replacement;
    - the replacement is refused by the scheduler for UNSCHEDULABLE_S, or none is ready in
      timeout_s: GIVE_UP;
    - else WAIT.

    running: the pod's requests in flight (None: unknown); replacement_ready: the replacement
    pod serves; unschedulable_s: how long the scheduler has refused the replacement; replicas:
    spec.replicas now; leaving: the pod's node is leaving now; spare_gpus: one more replica
    fits the free GPUs (None: unknown), asked only before a surge."""
    if not present:
        return FINISH
    if record.drain_since is not None:
        return drain_step(serving=serves, running=running, since=record.drain_since, now=now,
                          timeout_s=drain_timeout_s, min_drain_s=min_drain_s)
    if not serves:
        return DELETE
    if record.node_since is not None and now - record.node_since >= node_drain_wait_s:
        return LET_GO
    protected = others_ready < max(1, min_available)
    if not record.surge:
        if not leaving or not protected:
            return DROP
        return SURGE if spare_gpus and not record.tried else WAIT
    if not protected:
        return TAKE_OUT
    if replicas < record.replicas and not replacement_ready:
        return ABANDON
    if unschedulable_s >= UNSCHEDULABLE_S or now - record.since >= timeout_s:
        return GIVE_UP
    return WAIT


def node_drain_action(pod: PodView, pods: Iterable[PodView], policy: Policy,
                      always_allow: bool) -> str | None:
    """What a pod on a leaving node needs from the operator, or None where its eviction goes
    through by itself.

    The PodDisruptionBudget (minAvailable ready pods) refuses the eviction of a ready pod when
    the others ready are fewer than minAvailable, and, unless it allows the eviction of
    unhealthy pods (unhealthyPodEvictionPolicy AlwaysAllow), of a pod that is not ready while
    fewer than minAvailable are. REPLACE: the pod serves and minAvailable protects it: a
    replacement comes up elsewhere first (or it waits for capacity, for a bounded time).
    DELETE: it serves nothing and the budget would refuse its eviction: nothing is lost by
    deleting it, and the drain goes on."""
    views = list(pods)
    if pod.deleting:
        return None
    ready = sum(1 for p in views if p.ready and not p.deleting)
    if pod.serves and pod.in_service:
        return REPLACE if needs_replacement(views, pod.name, policy) else None
    if pod.ready:  # out of the Service: another action is draining it
        return None
    return DELETE if not always_allow and ready < policy.min_available else None


def lowered_replicas(current: int, record: InFlight, min_available: int) -> int | None:
    """spec.replicas after a ScaleDown removed its pod; None to leave it (someone changed it
    since the drain began, or it would go below minAvailable)."""
    if current != record.replicas:
        return None
    return scale_down_replicas(current, min_available)


# ---------------------------------------------------------------- reports


def budget_report(history: Iterable[float], now: float, policy: Policy) -> Report | None:
    """Degraded while the restart budget of the last hour is spent: the operator stops acting
    rather than flapping, and says so."""
    spent = restarts_in_hour(history, now)
    if spent < policy.max_restarts_per_hour:
        return None
    return Report("Degraded", "True", "RestartBudgetExhausted",
                  f"{spent} remediations in the last hour (spec.health.maxRestartsPerHour="
                  f"{policy.max_restarts_per_hour}); further failures are only reported")


def remediating_report(in_flight: Mapping[str, InFlight],
                       held: Iterable[tuple[Incident, Decision]], now: float | None = None,
                       node_drain_wait_s: float = NODE_DRAIN_WAIT_S) -> Report:
    """Remediating: True while an action is under way or an incident is held back (and why),
    so `kubectl describe` says what the operator is waiting for."""
    parts, reason = [], None
    for record in sorted(in_flight.values(), key=lambda r: r.pod):
        why = (f"its node {record.node} is being drained" if record.signature == NODE_DRAIN
               else record.signature)
        if record.action == REPLACE and record.drain_since is not None:
            reason = reason or "DrainingPod"
            parts.append(f"draining {record.pod} ({why}) before removing it")
        elif record.action == REPLACE and not record.surge:
            reason = reason or "WaitingForCapacity"
            left = ""
            if now is not None and record.node_since is not None:
                left = (f"; it is let go in "
                        f"{max(0.0, record.node_since + node_drain_wait_s - now):.0f} s")
            parts.append(f"{record.pod} keeps serving on leaving node {record.node} "
                         f"(minAvailable protects it) while no GPU is free elsewhere for a "
                         f"replacement{left}")
        elif record.action == REPLACE:
            reason = reason or "ReplacingPod"
            parts.append(f"replacing {record.pod} ({why}): waiting for a replacement to "
                         "become ready")
        else:
            reason = reason or "DrainingPod"
            parts.append(f"draining {record.pod} ({record.signature}) before removing it")
    for _, decision in sorted(held, key=lambda h: (h[0].pod, h[0].key)):
        reason = reason or HOLDING.get(decision.reason, "HeldBack")
        parts.append(f"held back: {decision.message}")
    if not parts:
        return Report("Remediating", "False", "NoOpenIncidents",
                      "no failure is waiting for an action")
    return Report("Remediating", "True", reason, "; ".join(parts))


# ---------------------------------------------------------------- pod status alone


LOG_DETECTION_OFF = "LogDetectionOff"


@dataclass(frozen=True, slots=True)
class Finding:
    """Something a pod's status (with what its log said) shows; reported with one Event."""

    kind: str  # ExitedAfterEngineDeath | CrashLoopBackOff | Unpatched | LogDetectionOff
    message: str
    key: str  # identity for "Event once"



def pod_findings(pod: Mapping, *, now: float, engine_dead_at: float | None,
                 plugin: str | None, grace_s: float = UNPATCHED_GRACE_S,
                 log_off: str | None = None, log_unread: str | None = None,
                 reading_since: float | None = 0.0) -> list[Finding]:
    """Findings from one pod. engine_dead_at: time of the last engine_dead incident its log
    showed; plugin: "active", "inactive: <reason>" or None (no startup line seen in the
    current container); log_off: why its log cannot be read whatever it holds (None: it can);
    log_unread: while no line with vLLM's header was seen in the current container, what the
    log looks like (None: one was); reading_since: see unpatched_due."""
    name = (pod.get("metadata") or {}).get("name", "")
    cs = container_status(pod)
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
    due = unpatched_due(pod, plugin=plugin, grace_s=grace_s, reading_since=reading_since)
    off = f"{name}/logoff/{cs.get('restartCount', 0)}"
    if plugin is not None and plugin.startswith("inactive"):
        out.append(Finding("Unpatched", f"{name}: tokenizer pool plugin {plugin}",
                           f"{name}/unpatched/{cs.get('restartCount', 0)}"))
    elif log_off is not None:
        out.append(Finding(LOG_DETECTION_OFF, f"{name}: log detection off: {log_off}", off))
    elif due is not None and now > due and log_unread is not None:
        out.append(Finding(LOG_DETECTION_OFF, f"{name}: log detection off: ready for "
                           f"{now - due + grace_s:.0f} s and {log_unread}", off))
    elif due is not None and now > due:
        out.append(Finding("Unpatched", f"{name}: ready for {now - due + grace_s:.0f} s without "
                           "the tokenizer pool plugin's startup line",
                           f"{name}/unpatched/{cs.get('restartCount', 0)}"))
    return out


def unpatched_due(pod: Mapping, *, plugin: str | None, grace_s: float = UNPATCHED_GRACE_S,
                  reading_since: float | None = 0.0) -> float | None:
    """When a ready pod without the plugin's startup line becomes Unpatched, or LogDetectionOff
    if no line of its log could be read (None: it cannot yet). reading_since: when the
    operator began reading the current container's log (None: not yet); the grace counts from
    the later of that and readiness, so a fresh operator process never reports a long-ready
    pod before it has read its log."""
    ready = ready_condition(pod)
    since = parse_time(ready.get("lastTransitionTime"))
    if plugin is not None or ready.get("status") != "True" or since is None or \
            reading_since is None:
        return None
    return max(since, reading_since) + grace_s


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


def log_detection_report(findings_by_pod: Mapping[str, list[Finding]]) -> Report | None:
    """The LogDetectionOff condition over the pods seen so far (None: no pod seen): True names
    the pods whose log the operator cannot read, and why."""
    if not findings_by_pod:
        return None
    off = [f.message for _, fs in sorted(findings_by_pod.items()) for f in fs
           if f.kind == LOG_DETECTION_OFF]
    if off:
        more = f"; and {len(off) - 3} more pods" if len(off) > 3 else ""
        return Report(LOG_DETECTION_OFF, "True", "LogUnreadable",
                      "engine death, tokenizer retries and the tokenizer pool's startup line "
                      "cannot be read from the log of: " + "; ".join(off[:3]) + more)
    return Report(LOG_DETECTION_OFF, "False", "LogsReadable",
                  "every pod's log is read (or its pod is within the startup grace)")
