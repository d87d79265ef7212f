"""What becomes of an incident whose plan does not act (held, kept open or closed) or whose
action's API call failed: the Remediator's bookkeeping on its Owner, and what is told (the
metric, Events, lastRemediation)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from vlm_operator.k8s.kube import Kube
from vlm_operator.remediation import events
from vlm_operator.remediation.decide import GUARDS, Reason, RemediationPlan
from vlm_operator.remediation.intake import Case
from vlm_operator.remediation.policy import backoff_s

log = logging.getLogger(__name__)


def hold(kube: Kube, reconcile: Callable[[str, str], None], case: Case,
         plan: RemediationPlan) -> None:
    """A plan that does not act: held (told once), kept open (in progress), or closed."""
    namespace, name, owner, incident = case.namespace, case.name, case.owner, case.incident
    key = (incident.uid, incident.key)
    was_held = key in owner.held
    if plan.holds:
        owner.held = {**owner.held, key: plan}
        _tell_held(kube, reconcile, case, plan)
        return
    if plan.reason in GUARDS:
        owner.skip_once(key, plan.reason, incident)
    if plan.reason == Reason.IN_PROGRESS:  # kept open: decided again if the action ends
        owner.held = {k: v for k, v in owner.held.items() if k != key}
    else:
        log.info("%s/%s: %s", namespace, name, plan.message)
        owner.close(key)
    if was_held:
        reconcile(namespace, name)  # Remediating no longer says it waits


def _tell_held(kube: Kube, reconcile: Callable[[str, str], None], case: Case,
               plan: RemediationPlan) -> None:
    """A held incident: the metric, an Event and lastRemediation once per reason."""
    owner, incident = case.owner, case.incident
    key = (incident.uid, incident.key)
    if (key, incident.first, plan.reason) in owner.told:
        return
    owner.skip_once(key, plan.reason, incident)
    events.held(kube, case.namespace, case.name, case.pod, incident, plan.message,
                case.body)
    reconcile(case.namespace, case.name)


def failed(kube: Kube, case: Case, exc: ApiException, attempts: int) -> None:
    """An action's API call failed: back off, keep the incident open, say so."""
    owner, incident = case.owner, case.incident
    until = time.time() + backoff_s(attempts + 1)
    owner.backoff[incident.uid] = (attempts + 1, until)
    owner.open = {**owner.open, (incident.uid, incident.key): incident}
    events.failed(kube, case.namespace, case.name, case.pod, incident, exc, until,
                  case.body)
