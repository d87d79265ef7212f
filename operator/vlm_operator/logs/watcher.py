"""Log watching: a follower per managed pod (stream.py), detections counted into incidents
(remediation/incidents.py), incidents handed to the Remediator (remediation/remediator.py), and
what pod status alone shows (remediation/findings.py).

Pods are tracked from kopf pod events (no kopf daemon: daemons put a finalizer on every pod,
which would keep pods Terminating whenever the operator is down). Acting twice is prevented by
the Remediator (actions in flight are recorded on the VLMDeployment, incidents are acted on only
inside their window, and the peering rule picks one operator replica).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from kubernetes.client.exceptions import ApiException

from vlm_operator.api.health_signals import NOT_FROM_LOG
from vlm_operator.api.names import INSTANCE_LABEL, LOG_MARK
from vlm_operator.api.reports import Event, Report
from vlm_operator.k8s.kube import Kube
from vlm_operator.k8s.pods import kept_pod, vlmd_name
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.logs import matcher, stream
from vlm_operator.logs.budget import BURST_S, LineBudget
from vlm_operator.logs.followers import Followers
from vlm_operator.logs.marks import MAX_REPLAY_S, Mark
from vlm_operator.logs.stream import Follower
from vlm_operator.logs.throttle import Throttled
from vlm_operator.metrics import DETECTIONS, LOG_LINE_ERRORS, LOG_LINES_THROTTLED, LOG_MARKS
from vlm_operator.remediation import findings as pod_status
from vlm_operator.remediation import incidents
from vlm_operator.remediation.context import Reporter
from vlm_operator.remediation.intake import Owner
from vlm_operator.remediation.suspect import GpuFault

log = logging.getLogger(__name__)

THROTTLE_EVENT_EVERY_S = 600.0  # at most one LogThrottled Event per VLMDeployment this often


class Heartbeats(Protocol):
    """Where the engine heartbeats the followers read go: stall detection's store
    (stalls/watch.py's Heartbeats, which runner.py passes in)."""

    def beat(self, uid: str, instance: int, proc: str, fields: Mapping[str, str],
             source: Follower, stamp: float) -> None: ...

    def forget(self, uid: str) -> None: ...


class Remediation(Reporter, Protocol):
    """What log watching uses of the Remediator besides reporting detections: its state per
    VLMDeployment (read for the policy and the user's signatures), reading it afresh, waking
    it, forgetting a pod, its conditions, stopping it."""

    def known(self, namespace: str, name: str) -> Owner | None: ...

    def refresh(self, namespace: str, name: str) -> dict | None: ...

    def wake(self) -> None: ...

    def forget_pod(self, namespace: str, name: str, uid: str) -> None: ...

    def reports(self, namespace: str, name: str) -> list[Report]: ...

    def stop(self) -> None: ...


class _NoHeartbeats:
    """No stall detection reads them: heartbeats are dropped."""

    def beat(self, uid: str, instance: int, proc: str, fields: Mapping[str, str],
             source: Follower, stamp: float) -> None:
        pass

    def forget(self, uid: str) -> None:
        pass


class LogWatch:
    """Owns the followers; registered as a report provider on the Reconciler."""

    def __init__(self, kube: Kube, reconcile: Callable[[str, str], None],
                 remediator: Remediation, followers: Followers, *,
                 may_mark: Callable[[str], bool] | None = None,
                 mark_every_s: float = stream.MARK_EVERY_S,
                 heartbeats: Heartbeats | None = None,
                 budget: LineBudget | None = None) -> None:
        """`reconcile(namespace, name)` publishes status and logs its own errors
        (Reconciler.refresh); `remediator`: where detections go; `followers`: the registry this
        watcher keeps the followers in (the remediator asks it about pods); `may_mark(namespace)`:
        whether this replica writes the pods' resume marks (the active one: one writer; None
        when it runs alone); `mark_every_s`: at most one mark per pod this often;
        `heartbeats`: where the engine heartbeats go (stall detection reads them); `budget`:
        the lines and CPU the followers may spend (logs/budget.py)."""
        self.kube = kube
        self.budget = budget if budget is not None else LineBudget()
        self.heartbeats = heartbeats if heartbeats is not None else _NoHeartbeats()
        self.reconcile = reconcile
        self.remediator = remediator
        self.followers = followers
        self.may_mark = may_mark or (lambda namespace: True)
        self.mark_every_s = mark_every_s
        self._errors = {stage: Throttled()
                        for stage in ("detect", "findings", "mark", "owner_chain")}
        self.windows = incidents.Windows()
        self._lock = threading.Lock()  # findings and the Events sent for them
        self._findings: dict[tuple[str, str], dict[str, list[pod_status.Finding]]] = {}
        self._events_sent: set[str] = set()
        self._throttle_told: dict[tuple[str, str], float] = {}  # VLMDeployment -> last Event

    # -- pod events (from kopf)
    def observe(self, pod: dict, deleted: bool) -> None:
        """A pod event (kopf selects pods by the operator's labels, which anyone may copy): only
        a pod whose owner chain leads to its VLMDeployment is followed, and in the small form
        of kept_pod. A follower whose pod stopped being ours is ended; one whose owners could
        not be read goes on (the next write asks again)."""
        meta = Body(pod)
        uid = meta.uid
        pod = kept_pod(pod)
        ending = deleted or meta.deleting
        ours = None if ending else self._ours(pod)
        followers = self.followers.by_uid
        with self.followers.lock:
            follower = followers.get(uid)
            if ending:
                if follower is not None and deleted:
                    followers.pop(uid).stop()
                elif follower is not None:  # terminating: its log is followed to the end
                    follower.hand(pod)
                return
            if ours is False:
                if follower is not None:
                    followers.pop(uid).stop()
                return
            if follower is None:
                if ours is None:  # unknown: the pod's next event asks again
                    return
                follower = followers[uid] = Follower(self, pod, self.mark_every_s)
                follower.start()
            else:
                follower.hand(pod)  # the follower waits on these, it never polls the pod
        if ours:
            self._pod_findings(follower, pod)
        self.remediator.wake()  # readiness may have changed what a held incident waits for

    def _ours(self, pod: dict) -> bool | None:
        """Whether the pod's owner chain leads to the VLMDeployment its label names (None: its
        owners could not be read). Controller references are remembered by Kube, so asking on
        every write costs no request once a pod is known."""
        if vlmd_name(pod) != Pod(pod).labels.get(INSTANCE_LABEL):
            return False
        try:
            return bool(self.kube.owned_pods([pod]))
        except ApiException as exc:
            self._errors["owner_chain"].log(log, logging.WARNING,
                                            "owners of pod %s/%s: %s %s", Pod(pod).namespace,
                                            Pod(pod).name, exc.status, exc.reason)
            return None

    def _still_ours(self, follower: Follower) -> bool:
        """Before anything is written for a followed pod (its mark, an Event, a detection
        handed to remediation): its owner chain still leads to its VLMDeployment."""
        return self._ours(follower.pod) is True

    def follower_ended(self, follower: Follower) -> None:
        """The pod is gone (or stopped being followed): forget what was kept for it."""
        with self.followers.lock:
            if self.followers.by_uid.get(follower.uid) is follower:
                del self.followers.by_uid[follower.uid]
        with self._lock:
            findings = self._findings.get((follower.namespace, follower.vlmd_name))
            if findings is not None and follower.name in findings:
                self._findings[(follower.namespace, follower.vlmd_name)] = {
                    k: v for k, v in findings.items() if k != follower.name}
            self._events_sent = {k for k in self._events_sent
                                 if not k.startswith(follower.name + "/")}
        self.windows.forget(follower.uid)
        self.heartbeats.forget(follower.uid)
        self.budget.forget(follower.namespace, follower.uid)
        if follower.vlmd_name:
            self.remediator.forget_pod(follower.namespace, follower.vlmd_name, follower.uid)

    def stop(self) -> None:
        self.remediator.stop()
        with self.followers.lock:
            for follower in self.followers.by_uid.values():
                follower.stop()
            self.followers.by_uid.clear()

    def extra_signatures(self, namespace: str, name: str) -> tuple[matcher.Signature, ...]:
        owner = self.remediator.known(namespace, name)
        return owner.extra if owner is not None else ()

    def spec_changed(self, namespace: str, name: str) -> None:
        """Take the VLMDeployment's policy, signatures and actions in flight now; decide held
        incidents again (a raised budget, a lower minAvailable); errors are only logged."""
        try:
            self.remediator.refresh(namespace, name)
        except Exception as exc:  # the next detection refreshes again
            log.info("policy refresh of %s/%s: %s", namespace, name, exc)
        self.remediator.wake()

    def reports(self, namespace: str, name: str) -> list[Report]:
        out = self.remediator.reports(namespace, name)
        with self._lock:
            findings = self._findings.get((namespace, name)) or {}
        return out + [r for r in (pod_status.unpatched_report(findings),
                                  pod_status.log_detection_report(findings)) if r]

    def failing_pods(self, namespace: str, name: str) -> set[str]:
        """Pods of a VLMDeployment with a failure signature inside its window or a pod-status
        finding: the autoscaler removes these first when it scales down. Asked every second
        per Builtin VLMDeployment: only pods with incident times are looked at, not every
        followed pod (thousands)."""
        candidates = self.windows.uids()
        with self.followers.lock:
            pods = [f for uid in candidates if (f := self.followers.by_uid.get(uid)) is not None
                    and f.namespace == namespace and f.vlmd_name == name]
        with self._lock:
            findings = self._findings.get((namespace, name)) or {}
        out = {pod for pod, found in findings.items()
               if any(f.kind != pod_status.LOG_DETECTION_OFF for f in found)}
        owner = self.remediator.known(namespace, name)
        policy = owner.policy if owner is not None else None
        if policy is not None:
            now = time.time()
            out |= {f.name for f in pods for key, rule in policy.rules.items()
                    if self.windows.count(f.uid, key, now, rule.window_s)}
        return out

    def _pod_findings(self, follower: Follower, pod: dict) -> bool:
        now = time.time()
        found = pod_status.pod_findings(
            pod, now=now, engine_dead_at=follower.engine_dead_at, plugin=follower.plugin,
            log_off=_log_off(follower), log_unread=_log_unread(follower),
            reading_since=follower.reading_since)
        with self._lock:
            by_pod = self._findings.get((follower.namespace, follower.vlmd_name)) or {}
            changed = found != by_pod.get(follower.name)
            self._findings[(follower.namespace, follower.vlmd_name)] = {**by_pod,
                                                                    follower.name: found}
            new = [f for f in found if f.key not in self._events_sent]
            self._events_sent.update(f.key for f in new)
        due = pod_status.unpatched_due(pod, plugin=follower.plugin,
                                       reading_since=follower.reading_since)
        if due is not None and due > now:  # no pod event comes when the grace runs out
            follower.recheck_at(due + 1, self._recheck)
        for finding in new:
            self.remediator.post_event(follower.namespace, follower.vlmd_name, pod,
                                  Event("Warning", finding.kind, finding.message))
        return changed

    def _recheck(self, follower: Follower) -> None:
        """Findings again (a grace ran out, or the plugin's line came): status if they changed."""
        if follower.stopped.is_set() or not follower.vlmd_name:
            return
        try:
            if self._still_ours(follower) and self._pod_findings(follower, follower.pod):
                self.reconcile(follower.namespace, follower.vlmd_name)
        except Exception as exc:
            self._errors["findings"].log(log, logging.WARNING, "findings of %s/%s failed: %s",
                                         follower.namespace, follower.name, exc)

    # -- from follower threads
    def lookback_s(self, namespace: str, name: str) -> float:
        """How much log before now a fresh follower re-reads: the longest window of the
        VLMDeployment's log signatures (its spec is read if it is not known yet), so counts in
        a window survive an operator restart; MAX_REPLAY_S when it cannot be read."""
        owner = self.remediator.known(namespace, name)
        if owner is None or owner.policy is None:
            try:
                self.remediator.refresh(namespace, name)
            except Exception as exc:  # unknown: the longest replay
                log.info("policy of %s/%s: %s", namespace, name, exc)
            owner = self.remediator.known(namespace, name)
        policy = owner.policy if owner is not None else None
        if policy is None:
            return MAX_REPLAY_S
        keys = {key for signature, key in policy.signature_policy.items()
                if signature not in NOT_FROM_LOG}
        return max((rule.window_s for key, rule in policy.rules.items() if key in keys),
                   default=0.0)

    def write_mark(self, follower: Follower, mark: Mark) -> None:
        """The follower's resume mark on its pod (only from the replica that acts)."""
        if not self.may_mark(follower.namespace) or not self._still_ours(follower):
            return
        try:
            self.kube.patch_pod(follower.namespace, follower.name,
                                annotations={LOG_MARK: mark.value()})
            LOG_MARKS.labels("written").inc()
        except Exception as exc:  # the next mark tries again; a restart then reads more
            LOG_MARKS.labels("error").inc()
            reason = f"{exc.status} {exc.reason}" if isinstance(exc, ApiException) else exc
            self._errors["mark"].log(log, logging.WARNING, "resume mark on %s/%s: %s",
                                     follower.namespace, follower.name, reason)

    def previous_unreadable(self, follower: Follower, reason: str) -> None:
        """The previous container's log could not be read: say so on the pod and its
        VLMDeployment (what it logged before it ended is not known)."""
        if not follower.vlmd_name or not self._still_ours(follower):
            return
        self.remediator.post_event(follower.namespace, follower.vlmd_name, follower.pod, Event(
            "Warning", "PreviousLogUnavailable",
            f"{follower.name}: the log of the vllm container before its restart cannot be read "
            f"({reason}); what it logged before it ended is not known (a failure it showed "
            "is not acted on); the current container is followed"))

    def log_news(self, follower: Follower) -> None:
        """The follower began reading this container's log, or its first line with vLLM's
        header came: findings again (and the timer for the startup line's grace)."""
        self._recheck(follower)

    def throttled(self, follower: Follower, lines: int) -> None:
        """Lines of the pod were skipped over its log budget: counted per namespace, and a
        Warning Event on the pod and its VLMDeployment at most once per
        THROTTLE_EVENT_EVERY_S for that VLMDeployment."""
        LOG_LINES_THROTTLED.labels(follower.namespace).inc(lines)
        key, now = (follower.namespace, follower.vlmd_name), time.monotonic()
        with self._lock:
            last = self._throttle_told.get(key)
            if not follower.vlmd_name or (last is not None and now - last < THROTTLE_EVENT_EVERY_S):
                return
            self._throttle_told = {k: t for k, t in self._throttle_told.items()
                                   if now - t < THROTTLE_EVENT_EVERY_S}
            self._throttle_told[key] = now
        if not self._still_ours(follower):
            return
        lines_s, cpu_s = self.budget.share(follower.namespace)
        self.remediator.post_event(follower.namespace, follower.vlmd_name, follower.pod, Event(
            "Warning", "LogThrottled",
            f"{follower.name}: its log goes over its share of the operator's log budget "
            f"(now {lines_s:g} lines/s and {cpu_s * 1000:g} ms of CPU per second, "
            f"{BURST_S:g} s of it at once): the lines over it are skipped unread, so a "
            "failure they show is not detected from the log"))

    # -- detections (from follower threads)
    def detected(self, follower: Follower, det: matcher.Detection, t: float) -> None:
        DETECTIONS.labels(follower.namespace, follower.vlmd_name, det.signature).inc()
        if det.signature == "engine_heartbeat":  # evidence for stall detection, no incident
            proc = det.line.proc if det.line is not None and det.line.proc else "engine"
            self.heartbeats.beat(follower.uid, follower.restarts, proc, det.fields, follower, t)
            return
        if det.signature in ("plugin_active", "plugin_inactive"):
            was = follower.plugin
            if det.signature == "plugin_inactive":
                if not (was or "").startswith("inactive"):  # the first reason is kept: a
                    # flood of distinct reasons must not make every line a status change
                    follower.plugin = "inactive: " + det.fields.get("reason", "")
            elif was is None:  # an inactive line from any process wins
                follower.plugin = "active"
            if follower.plugin != was:
                self._recheck(follower)
            return
        if det.signature == "engine_dead":
            follower.engine_dead_at = t
        if det.signature == "gpu_error":  # the ladder's input: its node is suspect
            follower.gpu_error = GpuFault(t, det.fields.get("error", det.variant))
        if not follower.vlmd_name or not self._still_ours(follower):
            return
        try:
            self.remediator.report(
                follower.namespace, follower.vlmd_name, uid=follower.uid, pod=follower.name,
                signature=det.signature, t=t,
                count=lambda key, window_s: self.windows.add(follower.uid, key, t, window_s))
        except Exception as exc:  # an API error must not kill the stream, nor flood our log
            LOG_LINE_ERRORS.labels("detect").inc()
            reason = f"{exc.status} {exc.reason}" if isinstance(exc, ApiException) else exc
            self._errors["detect"].log(log, logging.WARNING, "remediation for %s/%s failed: "
                                       "%s: %.200s", follower.namespace, follower.name,
                                       type(exc).__name__, reason)


def _log_off(follower: Follower) -> str | None:
    """Why log detection is off for this pod whatever its log holds, else None."""
    if follower.prefix is None:
        return ("its VLLM_LOGGING_PREFIX comes from valueFrom, so the operator cannot find "
                "vLLM's log header")
    return None


def _log_unread(follower: Follower) -> str | None:
    """What the log of a pod looks like while no line with vLLM's header was seen in it (None:
    one was): once the pod is ready this is why log detection is off."""
    if follower.readable:
        return None
    if follower.scanner.foreign:
        return ("its lines show vLLM's header behind a prefix the operator was not told "
                "(VLLM_LOGGING_PREFIX set in the image?): set the same VLLM_LOGGING_PREFIX in "
                "spec.vllm.env")
    return ("no line in vLLM's log format was seen (a custom VLLM_LOGGING_CONFIG_PATH or "
            "logging config, or vLLM logging nothing at the levels the operator reads)")
