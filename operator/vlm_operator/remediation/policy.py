"""A VLMDeployment's spec.health as the remediation code reads it: which signature falls under
which rule, each rule's threshold, window and action, the restart budget and minAvailable, and
the per-pod back-off after a failed attempt. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vlm_operator.api.actions import Action
from vlm_operator.api.health_signals import LOG, SIGNALS, SIGNATURE_FIELD
from vlm_operator.api.validation import with_defaults

BACKOFF_BASE_S = 10.0
BACKOFF_CAP_S = 600.0

INCIDENT_WINDOW_S = 60.0  # how long a stall or unresponsive-API incident stays actionable


@dataclass(frozen=True, slots=True)
class Rule:
    threshold: int
    window_s: float
    action: Action


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    rules: Mapping[str, Rule]
    max_restarts_per_hour: int
    min_available: int
    signature_policy: Mapping[str, str] = field(default_factory=lambda: dict(SIGNATURE_FIELD))
    in_place: bool = False  # spec.health.recovery InPlace: remediation/ladder.py's rungs

    def rule_for(self, signature: str) -> tuple[str, Rule] | None:
        key = self.signature_policy.get(signature)
        return (key, self.rules[key]) if key in self.rules else None


def health_policy_from_spec(spec: Mapping) -> HealthPolicy:
    """The policy of a VLMDeployment spec; the schema's defaults fill what it leaves out.

    Each of spec.health.extraSignatures gets a rule of its own, keyed `extra:<name>`."""
    health = with_defaults({"health": dict(spec.get("health") or {})})["health"]
    rules = {sig.field: Rule(int(health[sig.field]["threshold"]),
                             float(health[sig.field]["windowSeconds"]),
                             Action(health[sig.field]["action"]))
             for sig in SIGNALS if sig.source == LOG}
    # one stall or unresponsive-API verdict is the incident (stalls/watch.py counts for it)
    stalled = health["engineStalled"]
    rules["engineStalled"] = Rule(1, max(INCIDENT_WINDOW_S, 2.0 * stalled["stallSeconds"]),
                                  Action(stalled["action"]))
    rules["apiUnresponsive"] = Rule(1, INCIDENT_WINDOW_S,
                                    Action(health["apiUnresponsive"]["action"]))
    mapping = dict(SIGNATURE_FIELD)  # signatures without a policy are only counted
    for extra in health.get("extraSignatures") or []:
        key = f"extra:{extra['name']}"
        rules[key] = Rule(int(extra["threshold"]), float(extra["windowSeconds"]),
                          Action(extra["action"]))
        mapping[extra["name"]] = key
    return HealthPolicy(rules, int(health["maxRestartsPerHour"]), int(health["minAvailable"]),
                        mapping, in_place=health["recovery"] == "InPlace")


def backoff_s(attempts: int, base: float = BACKOFF_BASE_S, cap: float = BACKOFF_CAP_S) -> float:
    """Exponential per-pod back-off after the n-th failed attempt (n >= 1)."""
    return min(cap, base * 2 ** max(0, attempts - 1))
