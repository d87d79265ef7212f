"""Carrying out a decided plan: the one place where each action the operator may take starts,
with the Event it starts with. A Restart goes to the recovery (remediation/recovery.py: in place,
or a new pod); an action of more than one step (api/actions.MULTI_STEP) is recorded on the
VLMDeployment first and then driven step by step (remediation/in_flight.py). The dispatch
matches every member it handles and raises UnknownAction for the rest, before anything is
written: an action without its start here is never taken for another."""

from __future__ import annotations

import time
from collections.abc import Callable

from vlm_operator.api.actions import Action, UnknownAction
from vlm_operator.api.reports import Event
from vlm_operator.desired import children
from vlm_operator.metrics import REMEDIATIONS
from vlm_operator.remediation import actions, events
from vlm_operator.remediation.context import ActionContext
from vlm_operator.remediation.decide import RemediationPlan
from vlm_operator.remediation.incidents import InFlight, stamp
from vlm_operator.remediation.intake import Case


def execute(ctx: ActionContext, restart: Callable[[Case, RemediationPlan], None], case: Case,
            plan: RemediationPlan) -> None:
    """Start the plan's action on the case's pod (restart: the recovery's Restart)."""
    match plan.action:
        case Action.RESTART:
            restart(case, plan)
        case Action.REPLACE:
            _start_multi_step(ctx, case, plan, "PodReplacing",
                              "; bringing up a replacement first")
        case Action.SCALE_DOWN:
            _start_multi_step(ctx, case, plan, "ScaleDownStarted", "; draining")
        case _:
            raise UnknownAction(plan.action, f"the plan for {case.incident.pod}")


def _start_multi_step(ctx: ActionContext, case: Case, plan: RemediationPlan, reason: str,
                      told: str) -> None:
    """Record the action on the VLMDeployment (a fresh operator or a standby finishes it from
    there), take a ScaleDown's pod out of the Service, say so (the Event `reason`, the plan's
    message and `told`), and wake the action's worker."""
    namespace, name, incident = case.namespace, case.name, case.incident
    record = InFlight(plan.action, incident.pod, incident.uid, incident.signature,
                      incident.last, stamp(time.time()),
                      int(case.body["spec"].get("replicas", 1)),
                      before=(actions.pod_uids(case.pods) if plan.action == Action.REPLACE
                              else ()))
    ctx.write_in_flight(namespace, name, case.owner, add=record)
    if plan.action == Action.SCALE_DOWN:  # out of the Service now; the steps drain it
        ctx.kube.patch_pod(namespace, incident.pod, labels={children.IN_SERVICE_LABEL: "false"})
    REMEDIATIONS.labels(namespace, name, plan.action).inc()
    events.post(ctx.kube, namespace, name, case.pod,
                Event("Warning", reason, plan.message + told), case.body)
    ctx.in_flight.drive(namespace, name)
    events.last_remediation(ctx.kube, namespace, name, incident, action=plan.action,
                            reason=plan.message)
    ctx.reconcile(namespace, name)
