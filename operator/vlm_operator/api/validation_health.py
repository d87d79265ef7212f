"""Validation of spec.health: the stall detector's timings, users' failure signatures (RE2,
linear time), minAvailable against the replicas; and `health_actions`, every policy's action,
for the checks that depend on the autoscaling mode."""

from __future__ import annotations

from typing import Any

from vlm_operator.api import log_signatures
from vlm_operator.api.health_signals import FIELDS
from vlm_operator.api.schema import section


def signature_problems(spec: dict) -> list[str]:
    stalled = section(section(spec, "health"), "engineStalled")
    stall, canary = stalled.get("stallSeconds"), stalled.get("canaryTimeoutSeconds")
    problems = []
    if isinstance(stall, int) and isinstance(canary, int) and canary >= stall:
        problems.append(f"spec.health.engineStalled.canaryTimeoutSeconds: {canary} must be less "
                        f"than stallSeconds ({stall}): the canary is sent that long before a "
                        "stall is declared")
    extra = section(spec, "health").get("extraSignatures")
    if not isinstance(extra, list) or not all(isinstance(d, dict) for d in extra):
        return problems  # shape errors: the schema check has named them
    try:
        log_signatures.compile_spec_signatures(extra)
    except log_signatures.SignatureConfigError as exc:
        problems.append(str(exc))
    return problems


def health_actions(spec: dict) -> list[tuple[str, Any]]:
    """(field, action) of every spec.health policy."""
    health = section(spec, "health")
    out = [(f"spec.health.{key}.action", section(health, key).get("action"))
           for key in FIELDS]
    extra = health.get("extraSignatures")
    for i, sig in enumerate(extra if isinstance(extra, list) else []):
        if isinstance(sig, dict):
            out.append((f"spec.health.extraSignatures[{i}].action", sig.get("action")))
    return out


def availability_problems(spec: dict) -> list[str]:
    """minAvailable above the replicas makes a PodDisruptionBudget that refuses every eviction
    (node drains, upgrades and the cluster autoscaler wait on it) and leaves remediation only
    replacements: refused, whether written by mistake or on purpose."""
    min_available = section(spec, "health").get("minAvailable")
    scaling = section(spec, "autoscaling")
    if scaling.get("enabled"):
        where, fewest = "spec.autoscaling.minReplicas", scaling.get("minReplicas")
        what = "the fewest replicas autoscaling may leave"
    else:
        where, fewest, what = "spec.replicas", spec.get("replicas"), "the replicas asked for"
    if not isinstance(min_available, int) or not isinstance(fewest, int):
        return []
    most = max(1, fewest)  # no replica: a PodDisruptionBudget of 1 holds nothing
    if min_available <= most:
        return []
    return [f"spec.health.minAvailable: {min_available} is more than {where} ({fewest}), "
            f"{what}: the PodDisruptionBudget would refuse every eviction, so node drains "
            f"could never finish; at most {most}"]
