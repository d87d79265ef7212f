"""What the operator may do about a pod: one closed set. The values are what users write in
spec.health's `action` fields and what the in-flight annotation records, so each is spelled once
here; code that dispatches on an action handles every member or raises UnknownAction. Pure."""

from __future__ import annotations

import enum


class Action(enum.StrEnum):
    RESTART = "Restart"  # delete the pod (a new one comes), or recover it in place
    REPLACE = "Replace"  # a replacement first (surge), then drain and delete the pod
    SCALE_DOWN = "ScaleDown"  # drain, delete, one replica fewer
    IGNORE = "Ignore"  # count the signal, do nothing


# What spec.health's action fields accept (a Replace is the operator's choice, not the user's:
# a Restart that minAvailable protects becomes one), each with what it does as users read it in
# the CRD's schema and docs/reference.md
POLICY_MEANS = {
    Action.RESTART: "deletes the pod (its Deployment replaces it)",
    Action.SCALE_DOWN: ("takes it out of the Service, drains it, then removes it and lowers the "
                        "replica count"),
    Action.IGNORE: "only counts",
}
POLICY = tuple(POLICY_MEANS)
# What takes more than one step, and so is recorded on the VLMDeployment until it ends
MULTI_STEP = (Action.REPLACE, Action.SCALE_DOWN)


def policy_help() -> str:
    """What each action spec.health accepts does, in one sentence per action."""
    return "; ".join(f"{a.value} {means}" for a, means in POLICY_MEANS.items()) + "."


class UnknownAction(ValueError):
    """An action this operator does not know reached code that must act on it."""

    def __init__(self, action: object, where: str) -> None:
        shown = action.value if isinstance(action, Action) else action
        super().__init__(f"{where}: unknown action {shown!r}; one of "
                         f"{', '.join(a.value for a in Action)}")
        self.action = action


def recorded(value: object) -> Action | None:
    """The multi-step action a record names; None for a value this operator does not know (a
    newer operator's, or a forged one): the caller keeps such a record as it is and says so."""
    try:
        action = Action(value)
    except ValueError:
        return None
    return action if action in MULTI_STEP else None
