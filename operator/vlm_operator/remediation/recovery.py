"""Carrying out a Restart: a new pod; or, with spec.health.recovery InPlace for a pod that
serves nothing, the acting side of remediation/ladder.py: the fence and the first rung, then
every round the next step each fenced pod needs, from its annotation and status alone (so a
fresh operator process carries on). Each step is one patch or one delete, an Event,
lastRemediation (with the rung) and a status refresh. The restart budget was counted when the
Restart was decided: the rungs of one incident never count again. Where the pod's node is
suspect (remediation/suspect.py) the rung is a new pod, told with a NodeSuspect Event on the pod
(the Node itself is never written); each in-place recovery is counted on the pod as it ends."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from vlm_operator.api.actions import Action
from vlm_operator.api.health_signals import NOT_SERVING
from vlm_operator.api.reports import Event
from vlm_operator.k8s.kube import Kube
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.metrics import REMEDIATIONS
from vlm_operator.remediation import actions, events, guards, ladder, suspect
from vlm_operator.remediation.decide import RemediationPlan
from vlm_operator.remediation.incidents import Incident
from vlm_operator.remediation.intake import Case

log = logging.getLogger(__name__)

UNFENCED = "unfenced"  # lastRemediation's rung once a pod recovered in place
RUNG_EVENTS = {ladder.Rung.AWAIT_EXIT: "PodFenced", ladder.Rung.RESTART_REQUEST:
               "PodRestartRequested", ladder.Rung.DELETE: "PodRestarted",
               UNFENCED: "PodRecoveredInPlace"}


class Recovery:
    def __init__(self, kube: Kube, reconcile: Callable[[str, str], None], *,
                 engine_dead: Callable[[str], bool], plugin_loaded: Callable[[str], bool],
                 gpu_error: Callable[[str], suspect.GpuFault | None] = lambda uid: None,
                 kubelet: ladder.KubeletBackoff = ladder.KUBELET_BACKOFF) -> None:
        """`reconcile(ns, name)` publishes status; `engine_dead(uid)`: the pod's current
        container logged engine death; `plugin_loaded(uid)`: the engine plugin's startup line is
        in that container's log (it can act on a restart request); `gpu_error(uid)`: the last
        GPU fault the pod's log showed (None: none); `kubelet`: the nodes' crash-loop back-off
        (ladder.kubelet_backoff_s)."""
        self.kube = kube
        self.reconcile = reconcile
        self.engine_dead = engine_dead
        self.plugin_loaded = plugin_loaded
        self.gpu_error = gpu_error
        self.kubelet = kubelet

    def restart(self, case: Case, plan: RemediationPlan) -> None:
        """A Restart decided. With spec.health.recovery InPlace, a pod that serves nothing is
        fenced and recovered by the ladder; otherwise the pod is deleted for its ReplicaSet to
        make a new one (one that still serves keeps its grace period to drain)."""
        namespace, name, pod, incident = case.namespace, case.name, case.pod, case.incident
        if incident.signature in NOT_SERVING and case.owner.policy.in_place:
            self._fence(case, plan)
            return
        serves = guards.standing(pod, self.engine_dead(incident.uid)).serves and \
            incident.signature not in NOT_SERVING
        if not actions.restart(self.kube, namespace, pod=incident.pod, uid=incident.uid,
                               serves=serves):
            return  # gone already: nothing was done
        REMEDIATIONS.labels(namespace, name, Action.RESTART).inc()
        events.post(self.kube, namespace, name, pod,
                    Event("Warning", "PodRestarted", plan.message), case.body)
        events.last_remediation(self.kube, namespace, name, incident, action=Action.RESTART,
                                reason=plan.message)
        self.reconcile(namespace, name)

    def _fence(self, case: Case, plan: RemediationPlan) -> None:
        """The fence and the cheapest rung that can work (remediation/ladder.py)."""
        namespace, name, pod, incident = case.namespace, case.name, case.pod, case.incident
        now = time.time()
        node = suspect.suspect(pod, self.gpu_error(incident.uid), now)
        rung, why = ladder.first_rung(incident.signature, pod, now, suspect=node,
                                      plugin_loaded=self.plugin_loaded(incident.uid),
                                      kubelet=self.kubelet)
        fence = ladder.Fence(incident.signature, incident.last, now, rung.value,
                             ladder.deadline_for(rung, now, ladder.kubelet_backoff_s(
                                 pod, now, self.kubelet)), Pod(pod).restart_count, plan.message)
        REMEDIATIONS.labels(namespace, name, Action.RESTART).inc()
        self._take(namespace, name, pod, incident, fence, f"{plan.message}; fenced: {why}",
                   case.body, node)

    def round(self, namespace: str, name: str,
              fenced: list[tuple[dict, ladder.Fence]]) -> None:
        """The next step of every fenced pod, with its fence (the caller holds the
        VLMDeployment's lock); an API error is retried by the next round."""
        for pod, fence in fenced:
            try:
                self._climb(namespace, name, pod, fence)
            except ApiException as exc:
                log.warning("%s/%s: recovering %s: %s", namespace, name,
                            Pod(pod).name, exc.reason)

    def _climb(self, namespace: str, name: str, pod: dict, fence: ladder.Fence) -> None:
        meta = Body(pod)
        now = time.time()
        node = (suspect.suspect(pod, self.gpu_error(meta.uid), now)
                if fence.rung != ladder.Rung.DELETE else None)  # told when the rung was taken
        step, rung, why = ladder.next_step(fence, pod, now, suspect=node,
                                           plugin_loaded=self.plugin_loaded(meta.uid),
                                           kubelet=self.kubelet)
        if step in (ladder.Next.WAIT, ladder.Next.FORGET):
            return
        incident = Incident(uid=meta.uid, pod=meta.name, key="", signature=fence.signature,
                            first=fence.incident, last=fence.incident, count=1)
        if step == ladder.Next.UNFENCE:
            actions.unfence(self.kube, namespace, meta.name, now=now,
                            recovered=suspect.recoveries_value(suspect.recoveries(
                                meta.annotations, now), now))
            self._tell(namespace, name, pod, incident, UNFENCED,
                       f"{meta.name} recovered in place ({fence.signature}): {why}; back in "
                       "the Service", None)
            return
        self._take(namespace, name, pod, incident,
                   ladder.climb(fence, rung, now, Pod(pod).restart_count),
                   f"{fence.signature} on {meta.name}: {why}", None, node)

    def _take(self, namespace: str, name: str, pod: dict, incident: Incident,
              fence: ladder.Fence, message: str, body: dict | None,
              node: suspect.Suspect | None = None) -> None:
        """Take the fence's rung: out of the Service with the fence recorded (and the restart
        request where that is the rung) in one patch, then the deletion where the rung is a
        new pod; then say so (and, where a suspect node made it a new pod, that too)."""
        rung = ladder.Rung(fence.rung)
        actions.fence(self.kube, namespace, incident.pod, fence,
                      request=rung == ladder.Rung.RESTART_REQUEST)
        if rung == ladder.Rung.DELETE:
            actions.delete_quickly(self.kube, namespace, pod=incident.pod, uid=incident.uid)
        self._tell(namespace, name, pod, incident, rung, message, body)
        if node is not None and rung == ladder.Rung.DELETE:
            events.post(self.kube, namespace, name, pod, Event(
                "Warning", "NodeSuspect", f"node {node.node} is suspect ({incident.pod}): "
                f"{node.why}. The operator does not cordon or label nodes: check the node's "
                "GPUs (nvidia-smi, Xid lines in its kernel log)"), body)

    def _tell(self, namespace: str, name: str, pod: dict, incident: Incident, rung: str,
              message: str, body: dict | None) -> None:
        log.info("%s/%s: %s", namespace, name, message)
        events.post(self.kube, namespace, name, pod,
                    Event("Normal" if rung == UNFENCED else "Warning", RUNG_EVENTS[rung],
                          message), body)
        events.last_remediation(self.kube, namespace, name, incident, action=Action.RESTART,
                                reason=message, rung=str(rung))
        self.reconcile(namespace, name)
