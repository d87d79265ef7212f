"""Inputs for remediation's pure functions, shared by their tests: a policy from spec.health,
pod standings from a compact spec, incidents, actions in flight, a pod object's status, and one
decide() call."""

from __future__ import annotations

from vlm_operator.api.actions import Action
from vlm_operator.remediation.decide import PlanRequest, decide
from vlm_operator.remediation.guards import Standing
from vlm_operator.remediation.incidents import NODE_DRAIN, Incident, InFlight
from vlm_operator.remediation.policy import health_policy_from_spec

NOW = 1_000_000.0


def policy(**health):
    return health_policy_from_spec({"health": health})


def pods(*spec):
    """'r' ready, 'n' not ready, 'd' deleting, 'x' engine dead, 'o' out of service,
    'f' an action in flight on it."""
    return [Standing(f"p{i}", ready="r" in s or "x" in s, deleting="d" in s,
                    in_service="o" not in s, engine_dead="x" in s, in_flight="f" in s)
            for i, s in enumerate(spec)]


def incident(pod="p0", signature="tokenizer_retry", count=5, last=NOW):
    key = {"engine_dead": "engineDead"}.get(signature, "tokenizerRetry")
    return Incident(f"uid-{pod}", pod, key, signature, last - 1, last, count)


def record(action=Action.SCALE_DOWN, replicas=3, since=NOW):
    """An action on p0 in flight since `since`, for a tokenizer retry storm."""
    return InFlight(action, "p0", "uid-p0", "tokenizer_retry", NOW - 5, since, replicas)


def drain_record(**kw):
    """p0's Replace for its leaving node n1, waiting for capacity (no surge) since NOW."""
    return InFlight(Action.REPLACE, "p0", "uid-p0", NODE_DRAIN, NOW, NOW, 1,
                    **{"surge": False, "node": "n1", "node_since": NOW, **kw})


def run(pol=None, signature="tokenizer_retry", count=5, pod="p0", standings=None, history=(),
        last=NOW, **kw):
    """decide() on one incident of `signature` with `count` detections, three ready pods by
    default."""
    pol = pol or policy()
    _, rule = pol.rule_for(signature)
    return decide(PlanRequest(incident=incident(pod, signature, count, last), rule=rule,
                              now=NOW, pods=tuple(standings if standings is not None
                                                  else pods("r", "r", "r")),
                              history=tuple(history), policy=pol, **kw))


def pod(name="p0", ready=True, since="2026-01-01T00:00:00Z", restarts=0, last=None,
        waiting=None, labels=None, deleting=False):
    """A pod object's metadata and status, as the apiserver returns them."""
    cs = {"name": "vllm", "restartCount": restarts, "state": {"running": {}}}
    if last:
        cs["lastState"] = {"terminated": last}
    if waiting:
        cs["state"] = {"waiting": {"reason": waiting}}
    meta = {"name": name, "labels": labels or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                        "lastTransitionTime": since}],
        "containerStatuses": [cs]}}
