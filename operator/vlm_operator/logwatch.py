"""Follow the vLLM log of every managed pod and act on failure signatures. Thin: remediation.py
decides, this reads logs through the apiserver and carries decisions out through Kube.

One thread per pod follows `pods/log?follow=true&timestamps=true`. A dropped stream is resumed
with sinceTime (second precision at the apiserver), dropping the replayed lines of that second by
(timestamp, text), so nothing is counted twice or lost. When restartCount grows, the previous
container's log is read once (its tail may not have reached us before it exited). Lines are split
on "\\n" only (signatures.py relies on the "\\r" vLLM leaves on continuation lines).

Acting twice is prevented by: acting only on incidents newer than this process's start (a new
operator re-reads whole logs), newer than what was recorded as acted on for the pod (pod
annotation ACTED_UNTIL, written with the ScaleDown label flip; status.lastRemediation for
Restart, since a restarted pod is gone), by skipping pods already deleting or out of service,
and by leaving incidents to the active replica while kopf's peering pauses this one
(peering.py). The hourly restart budget survives operator restarts in the VLMDeployment
annotation HISTORY. Pods are tracked from kopf pod events (no kopf daemon: daemons put a
finalizer on every pod, which would keep pods Terminating whenever the operator is down).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from vlm_operator import builders, crd, remediation, signatures, status
from vlm_operator.kube import Kube, now_iso, object_path
from vlm_operator.metrics import (
    DETECTIONS,
    LOG_LINES,
    LOG_LINES_DEDUPLICATED,
    LOG_RECONNECTS,
    REMEDIATIONS,
    REMEDIATIONS_SKIPPED,
)
from vlm_operator.reconciler import owner_name
from vlm_operator.spec import SpecError, parse

log = logging.getLogger(__name__)

PREFIX = "serving.vlm-operator.dev"
ACTED_UNTIL = f"{PREFIX}/acted-until"  # pod: newest incident time (epoch s) acted on
SCALE_DOWN_PHASE = f"{PREFIX}/scale-down"  # pod: "draining" while a ScaleDown is under way
HISTORY = f"{PREFIX}/remediations"  # VLMDeployment: JSON list of action times, last hour
READ_TIMEOUT_S = 120.0  # a quiet stream is re-opened (cheap: resumed with sinceTime)
DRAIN_TIMEOUT_S = 60.0
DRAIN_MIN_S = 2.0  # time for the endpoints controllers to drop the pod
HEALTH_TIMEOUT_S = 1.0


def parse_stamp_ns(stamp: str) -> int | None:
    """RFC3339Nano (the kubelet's timestamps=true prefix) to epoch nanoseconds."""
    head, _, frac = stamp.partition(".")
    zone = "Z"
    if frac:
        digits = frac.rstrip("Z")
        for sign in "+-":
            if sign in digits:
                digits, zone = digits.split(sign, 1)[0], sign + digits.split(sign, 1)[1]
        frac = digits
    elif head.endswith("Z"):
        head = head[:-1]
    try:
        secs = dt.datetime.fromisoformat(head + ("+00:00" if zone == "Z" else zone)).timestamp()
    except ValueError:
        return None
    return int(secs) * 1_000_000_000 + int((frac + "000000000")[:9] or 0)


def since_time(sec: int) -> str:
    return dt.datetime.fromtimestamp(sec, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Dedupe:
    """Lines already seen, for resuming a stream with a second-precision sinceTime."""

    def __init__(self) -> None:
        self.sec = 0
        self.seen: set[tuple[int, str]] = set()

    def fresh(self, ns: int, text: str) -> bool:
        sec = ns // 1_000_000_000
        if sec < self.sec or (ns, text) in self.seen:
            return False
        if sec > self.sec:
            self.sec, self.seen = sec, set()
        self.seen.add((ns, text))
        return True


class Follower(threading.Thread):
    """Follows one pod's vllm container log until stopped or the pod is gone."""

    def __init__(self, watch: LogWatch, pod: dict) -> None:
        meta = pod["metadata"]
        super().__init__(daemon=True, name=f"logs {meta['namespace']}/{meta['name']}")
        self.watch = watch
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.owner = owner_name(pod) or ""
        self.pod = pod
        self.stopped = threading.Event()
        self.restarts = _restart_count(pod)
        self.extra: tuple[signatures.Signature, ...] = ()
        self.scanner = signatures.Scanner()
        self.dedupe = Dedupe()
        self.plugin: str | None = None
        self.engine_dead_at: float | None = None
        self._response = None
        self._timer: threading.Timer | None = None

    def recheck_at(self, when: float, fn: Callable[[Follower], None]) -> None:
        """Call fn(self) at epoch time `when` (one pending recheck per follower)."""
        if self._timer is not None and self._timer.is_alive():
            return
        self._timer = threading.Timer(max(0.0, when - time.time()), fn, (self,))
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        self.stopped.set()
        if self._timer is not None:
            self._timer.cancel()
        resp = self._response
        if resp is not None:
            with contextlib.suppress(Exception):  # best effort: the read timeout ends it anyway
                resp.shutdown()

    def run(self) -> None:
        delay = 0.5
        while not self.stopped.is_set():
            try:
                pod = self.watch.kube.get("v1", "Pod", self.namespace, self.name)
                if pod is None or pod["metadata"]["uid"] != self.uid:
                    return
                self.pod = pod
                restarts = _restart_count(pod)
                if restarts > self.restarts:
                    self._stream(previous=True)
                    self.restarts = restarts
                    self._new_instance()
                if not _running(pod):
                    self.stopped.wait(0.5)
                    continue
                self._stream(previous=False)
                delay = 0.5
                LOG_RECONNECTS.inc()
            except ApiException as exc:
                if exc.status == 404:
                    return
                if exc.status != 400:  # 400: container not started yet
                    log.info("log of %s/%s: %s %s", self.namespace, self.name, exc.status,
                             exc.reason)
                self.stopped.wait(delay)
                delay = min(delay * 2, 10.0)
            except Exception as exc:  # never let one pod's stream kill the thread
                LOG_RECONNECTS.inc()
                if not self.stopped.is_set():
                    log.info("log of %s/%s: %s; reconnecting", self.namespace, self.name, exc)
                    self.stopped.wait(delay)
                    delay = min(delay * 2, 10.0)

    def _new_instance(self) -> None:
        self.scanner = signatures.Scanner(self.extra)
        self.dedupe = Dedupe()
        self.plugin = None
        self.engine_dead_at = None

    def _stream(self, previous: bool) -> None:
        query = [("container", builders.CONTAINER), ("timestamps", "true")]
        if previous:
            query.append(("previous", "true"))
        else:
            query.append(("follow", "true"))
        if self.dedupe.sec:
            query.append(("sinceTime", since_time(self.dedupe.sec)))
        api = self.watch.kube.api
        params = api.param_serialize(
            "GET", object_path("v1", "Pod", self.namespace, self.name) + "/log",
            query_params=query, header_params={"Accept": "*/*"}, auth_settings=["BearerToken"])
        response = api.call_api(*params, _request_timeout=(10, READ_TIMEOUT_S))
        raw = response.response
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException(http_resp=response)
        self._response = raw
        try:
            rest = b""
            for chunk in raw.stream(65536, decode_content=False):
                if self.stopped.is_set():
                    return
                parts = (rest + chunk).split(b"\n")
                rest = parts.pop()
                for part in parts:
                    self._line(part.decode("utf-8", "replace"))
            if rest and previous:  # a dead container's last line may lack its newline
                self._line(rest.decode("utf-8", "replace"))
        finally:
            self._response = None
            raw.release_conn()

    def _line(self, line: str) -> None:
        stamp, _, text = line.partition(" ")
        ns = parse_stamp_ns(stamp)
        if ns is None:  # not the kubelet's prefix: count it, scan it untimed
            ns, text = 0, line
        elif not self.dedupe.fresh(ns, text):
            LOG_LINES_DEDUPLICATED.inc()
            return
        LOG_LINES.inc()
        try:
            extra = self.watch.extra_signatures(self.namespace, self.owner)
            if extra is not self.extra:  # the VLMDeployment's extraSignatures changed
                self.extra, self.scanner = extra, signatures.Scanner(extra)
            detections = self.scanner.feed(line)
        except Exception:  # a bad line must never stop the stream
            log.exception("scanner failed on a line of %s/%s", self.namespace, self.name)
            return
        for det in detections:
            if det.new_incident:
                self.watch.detected(self, det, ns / 1e9 if ns else time.time())


def _container_status(pod: dict) -> dict:
    return next((c for c in (pod.get("status") or {}).get("containerStatuses") or []
                 if c.get("name") == builders.CONTAINER), {})


def _restart_count(pod: dict) -> int:
    return int(_container_status(pod).get("restartCount") or 0)


def _running(pod: dict) -> bool:
    return "running" in (_container_status(pod).get("state") or {})


class _Owner:
    """Per-VLMDeployment state: a lock so decisions on its pods are serialised, and what was
    reported already."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.policy: remediation.Policy | None = None
        self.extra: tuple[signatures.Signature, ...] = ()
        self.history: list[float] = []
        self.backoff: dict[str, tuple[int, float]] = {}  # pod -> (attempts, until)
        self.events_sent: set[str] = set()
        self.findings: dict[str, list[remediation.Finding]] = {}


class LogWatch:
    """Owns the followers; registered as a report provider on the Reconciler."""

    def __init__(self, kube: Kube, reconcile: Callable[[str, str], None], *,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S,
                 may_act: Callable[[str], bool] | None = None) -> None:
        """`reconcile(namespace, name)` publishes status after an action and logs its own errors
        (Reconciler.refresh); `may_act(namespace)`: whether this replica is the one that acts
        (peering.py), None when it runs alone."""
        self.kube = kube
        self.reconcile = reconcile
        self.may_act = may_act or (lambda namespace: True)
        self.started = time.time()
        self.drain_timeout_s = drain_timeout_s
        self.windows = remediation.Windows()
        self._lock = threading.Lock()
        self._followers: dict[str, Follower] = {}
        self._owners: dict[tuple[str, str], _Owner] = {}
        self._finishing: set[str] = set()

    # -- pod events (from kopf)
    def observe(self, pod: dict, deleted: bool) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        gone = deleted or bool(meta.get("deletionTimestamp"))
        with self._lock:
            follower = self._followers.get(uid)
            if gone:
                if follower is not None and deleted:
                    self._followers.pop(uid).stop()
                    self.windows.forget(meta["name"])
                    owner = self._owner(meta["namespace"], follower.owner)
                    owner.findings.pop(meta["name"], None)
                return
            if follower is None:
                follower = self._followers[uid] = Follower(self, pod)
                follower.start()
            follower.pod = pod
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        if (labels.get(builders.IN_SERVICE_LABEL) == "false"
                and annotations.get(SCALE_DOWN_PHASE) == "draining"):
            self._finish_scale_down_once(pod)  # an operator restart interrupted the drain
        self._pod_findings(follower, pod)

    def stop(self) -> None:
        with self._lock:
            for follower in self._followers.values():
                follower.stop()
            self._followers.clear()

    def _owner(self, namespace: str, name: str) -> _Owner:
        return self._owners.setdefault((namespace, name), _Owner())

    def extra_signatures(self, namespace: str, name: str) -> tuple[signatures.Signature, ...]:
        owner = self._owners.get((namespace, name))
        return owner.extra if owner is not None else ()

    def spec_changed(self, namespace: str, name: str) -> None:
        """Take the VLMDeployment's health policy and extra signatures now (followers match new
        signatures from their next line on); errors are only logged."""
        try:
            self._refresh(namespace, name, self._owner(namespace, name))
        except Exception as exc:  # the next detection refreshes again
            log.info("policy refresh of %s/%s: %s", namespace, name, exc)

    def reports(self, namespace: str, name: str) -> list[status.Report]:
        owner = self._owners.get((namespace, name))
        if owner is None:
            return []
        out = []
        if owner.policy is not None:
            report = remediation.budget_report(owner.history, time.time(), owner.policy)
            if report:
                out.append(report)
        report = remediation.unpatched_report(owner.findings)
        if report:
            out.append(report)
        return out

    def failing_pods(self, namespace: str, name: str) -> set[str]:
        """Pods of a VLMDeployment with a failure signature inside its window or a pod-status
        finding: the autoscaler removes these first when it scales down."""
        owner = self._owners.get((namespace, name))
        if owner is None:
            return set()
        now = time.time()
        with self._lock:
            pods = [f.name for f in self._followers.values()
                    if f.namespace == namespace and f.owner == name]
        out = {pod for pod, findings in owner.findings.items() if findings}
        if owner.policy is not None:
            out |= {pod for pod in pods for key, rule in owner.policy.rules.items()
                    if self.windows.count(pod, key, now, rule.window_s)}
        return out

    def _pod_findings(self, follower: Follower, pod: dict) -> bool:
        owner = self._owner(follower.namespace, follower.owner)
        now = time.time()
        findings = remediation.pod_findings(pod, now=now,
                                            engine_dead_at=follower.engine_dead_at,
                                            plugin=follower.plugin)
        changed = findings != owner.findings.get(follower.name)
        owner.findings[follower.name] = findings
        due = remediation.unpatched_due(pod, plugin=follower.plugin)
        if due is not None and due > now:  # no pod event comes when the grace runs out
            follower.recheck_at(due + 1, self._recheck)
        for finding in findings:
            if finding.key in owner.events_sent:
                continue
            owner.events_sent.add(finding.key)
            event = status.Event("Warning", finding.kind, finding.message)
            self._post(follower.namespace, follower.owner, pod, event)
        return changed

    def _recheck(self, follower: Follower) -> None:
        """Findings again (a grace ran out, or the plugin's line came): status if they changed."""
        if follower.stopped.is_set() or not follower.owner:
            return
        try:
            if self._pod_findings(follower, follower.pod):
                self.reconcile(follower.namespace, follower.owner)
        except Exception:
            log.exception("findings of %s/%s failed", follower.namespace, follower.name)

    # -- detections (from follower threads)
    def detected(self, follower: Follower, det: signatures.Detection, t: float) -> None:
        DETECTIONS.labels(signature=det.signature).inc()
        if det.signature in ("plugin_active", "plugin_inactive"):
            follower.plugin = "active" if det.signature == "plugin_active" else \
                "inactive: " + det.fields.get("reason", "")
            self._recheck(follower)
            return
        if det.signature == "engine_dead":
            follower.engine_dead_at = t
        if not follower.owner:
            return
        owner = self._owner(follower.namespace, follower.owner)
        try:
            if owner.policy is None:
                self._refresh(follower.namespace, follower.owner, owner)
            found = owner.policy.rule_for(det.signature) if owner.policy else None
            if found is None:
                return
            key, rule = found
            count = self.windows.add(follower.name, key, t, rule.window_s)
            if t < self.started or count < rule.threshold:
                return
            with owner.lock:
                self._decide(follower, owner, det.signature, count, t)
        except Exception:  # an API error must not kill the stream
            log.exception("remediation for %s/%s failed", follower.namespace, follower.name)

    def _refresh(self, namespace: str, name: str, owner: _Owner) -> dict | None:
        body = self.kube.get_vlmd(namespace, name)
        if body is None:
            return None
        try:
            vlmd = parse(body)
        except SpecError:
            return None
        owner.policy = remediation.policy_from_spec(vlmd.spec)
        extra = signatures.compile_spec_signatures(vlmd.spec["health"].get("extraSignatures")
                                                   or [])
        if extra != owner.extra:  # a new tuple makes followers rebuild their scanners
            owner.extra = extra
        raw = (body["metadata"].get("annotations") or {}).get(HISTORY)
        try:
            stored = [float(t) for t in json.loads(raw)] if raw else []
        except (ValueError, TypeError):
            stored = []
        now = time.time()
        owner.history = sorted({t for t in [*stored, *owner.history]
                                if now - t < remediation.HOUR})
        return body

    def _decide(self, follower: Follower, owner: _Owner, signature: str, count: int,
                t: float) -> None:
        ns, name = follower.namespace, follower.owner
        if not self.may_act(ns):
            REMEDIATIONS_SKIPPED.labels(reason="peer_active").inc()
            log.info("%s/%s: %s on pod %s left to the active operator replica", ns, name,
                     signature, follower.name)
            return
        body = self._refresh(ns, name, owner)
        if body is None or owner.policy is None:
            return
        policy = owner.policy
        pods = self.kube.list_pods(ns, builders.get_selector(name))
        with self._lock:
            dead = {f.name for f in self._followers.values() if f.engine_dead_at is not None}
        views = [remediation.pod_view(p, p["metadata"]["name"] in dead) for p in pods]
        pod = next((p for p in pods if p["metadata"]["uid"] == follower.uid), None)
        if pod is None:
            return
        acted = _acted_until(pod, body)
        attempts, until = owner.backoff.get(follower.name, (0, None))
        health = self._health(pod) if signature == "engine_dead" else None
        now = time.time()
        _, rule = policy.rule_for(signature)
        decision = remediation.decide(
            pod=follower.name, signature=signature, rule=rule, count=count, incident_time=t,
            now=now, pods=views, history=owner.history, policy=policy, acted_until=acted,
            backoff_until=until, health=health)
        if not decision.act:
            if decision.reason in remediation.GUARDS:
                REMEDIATIONS_SKIPPED.labels(reason=decision.reason).inc()
            if decision.reason in ("min_available", "budget_exhausted", "health_ok"):
                attempts += 1
                owner.backoff[follower.name] = (attempts, now + remediation.backoff_s(attempts))
                key = f"{follower.name}/skip/{decision.reason}"
                if key not in owner.events_sent:
                    owner.events_sent.add(key)
                    self._post(ns, name, pod, status.Event("Warning", "RemediationSkipped",
                                                           decision.message), body)
                    self._last(ns, name, follower.name, signature, "Skipped", decision.message)
                if decision.reason == "budget_exhausted":
                    self.reconcile(ns, name)
            return
        owner.backoff.pop(follower.name, None)
        if decision.action == remediation.RESTART:
            self._restart(follower, owner, pod, body, signature, decision.message)
        else:
            self._start_scale_down(follower, owner, pod, body, signature, t, decision.message)

    # -- acting
    def _restart(self, follower, owner, pod, body, signature, message) -> None:
        ns, name = follower.namespace, follower.owner
        self.kube._call("DELETE", object_path("v1", "Pod", ns, follower.name),
                        body={"preconditions": {"uid": follower.uid}})
        REMEDIATIONS.labels(action=remediation.RESTART).inc()
        self._record(owner, ns, name)
        log.info("%s/%s: restarted pod %s: %s", ns, name, follower.name, message)
        self._post(ns, name, pod, status.Event("Warning", "PodRestarted", message), body)
        self._last(ns, name, follower.name, signature, remediation.RESTART, message)
        self.reconcile(ns, name)

    def _start_scale_down(self, follower, owner, pod, body, signature, t, message) -> None:
        ns, name = follower.namespace, follower.owner
        self.kube._call("PATCH", object_path("v1", "Pod", ns, follower.name), body={
            "metadata": {"labels": {builders.IN_SERVICE_LABEL: "false"},
                         "annotations": {ACTED_UNTIL: f"{t:.6f}", SCALE_DOWN_PHASE: "draining"}}},
            content_type="application/merge-patch+json")
        REMEDIATIONS.labels(action=remediation.SCALE_DOWN).inc()
        self._record(owner, ns, name)
        self._post(ns, name, pod, status.Event("Warning", "ScaleDownStarted",
                                               message + "; draining"), body)
        self._last(ns, name, follower.name, signature, remediation.SCALE_DOWN, message)
        self._finish_scale_down_once(pod)

    def _finish_scale_down_once(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if not self.may_act(pod["metadata"]["namespace"]):
            return
        with self._lock:
            if uid in self._finishing:
                return
            self._finishing.add(uid)
        threading.Thread(target=self._finish_scale_down, args=(pod,), daemon=True,
                         name=f"drain {pod['metadata']['name']}").start()

    def _finish_scale_down(self, pod: dict) -> None:
        meta = pod["metadata"]
        ns, pod_name, owner_name_ = meta["namespace"], meta["name"], owner_name(pod) or ""
        try:
            running = drain(pod, self.drain_timeout_s)
            self.kube._call("DELETE", object_path("v1", "Pod", ns, pod_name),
                            body={"preconditions": {"uid": meta["uid"]}})
            body = self.kube.get_vlmd(ns, owner_name_)
            if body is None:
                return
            owner = self._owner(ns, owner_name_)
            current = int((body.get("spec") or {}).get("replicas", 1))
            min_available = owner.policy.min_available if owner.policy else 1
            target = remediation.scale_down_replicas(current, min_available)
            if target is not None:
                self.kube._call("PATCH", object_path(crd.API_VERSION, crd.KIND, ns, owner_name_)
                                + "/scale", body={"spec": {"replicas": target}},
                                content_type="application/merge-patch+json")
                text = (f"drained {pod_name} ({running} requests still running), deleted it, "
                        f"replicas {current} -> {target}")
            else:
                text = (f"drained and deleted {pod_name}; replicas kept at {current} "
                        f"(spec.health.minAvailable={min_available})")
            self._post(ns, owner_name_, pod, status.Event("Normal", "ScaledDown", text), body)
            self.reconcile(ns, owner_name_)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("scale-down of %s/%s: %s %s", ns, pod_name, exc.status, exc.reason)
        except Exception:
            log.exception("scale-down of %s/%s failed", ns, pod_name)

    def _record(self, owner: _Owner, ns: str, name: str) -> None:
        now = time.time()
        owner.history = [t for t in owner.history if now - t < remediation.HOUR] + [now]
        self.kube._call("PATCH", object_path(crd.API_VERSION, crd.KIND, ns, name), body={
            "metadata": {"annotations": {HISTORY: json.dumps([round(t, 3)
                                                              for t in owner.history])}}},
            content_type="application/merge-patch+json")

    def _last(self, ns, name, pod, signature, action, reason) -> None:
        try:
            self.kube.patch_vlmd_status(ns, name, {"lastRemediation": {
                "time": now_iso(), "pod": pod, "signature": signature, "action": action,
                "reason": reason[:1024]}})
        except ApiException as exc:
            log.warning("lastRemediation of %s/%s: %s", ns, name, exc.reason)

    def _post(self, ns: str, name: str, pod: dict, event: status.Event,
              body: dict | None = None) -> None:
        """The Event on the pod and on its VLMDeployment."""
        pod = {**pod, "apiVersion": "v1", "kind": "Pod"}
        self.kube.post_event(pod, event)
        body = body or self.kube.get_vlmd(ns, name)
        if body is not None:
            self.kube.post_event(body, event)

    @staticmethod
    def _health(pod: dict) -> str | None:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            return None
        try:
            with urllib.request.urlopen(f"http://{ip}:{builders.PORT}/health",
                                        timeout=HEALTH_TIMEOUT_S) as rsp:
                return "ok" if rsp.status == 200 else "failing"
        except urllib.error.HTTPError:
            return "failing"
        except OSError:
            return "unreachable"


def _acted_until(pod: dict, body: dict) -> float | None:
    """The newest incident time already acted on for this pod: its annotation, else the
    VLMDeployment's lastRemediation when it names this pod."""
    values = []
    raw = ((pod["metadata"].get("annotations") or {}).get(ACTED_UNTIL))
    try:
        if raw:
            values.append(float(raw))
    except ValueError:
        pass
    last = (body.get("status") or {}).get("lastRemediation") or {}
    if last.get("pod") == pod["metadata"]["name"] and last.get("action") != "Skipped":
        t = remediation.parse_time(last.get("time"))
        if t is not None:
            values.append(t)
    return max(values) if values else None


def requests_running(ip: str) -> float | None:
    """vllm:num_requests_running (+ waiting) from the pod's /metrics; None if unreadable."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{builders.PORT}/metrics", timeout=2) as rsp:
            text = rsp.read().decode("utf-8", "replace")
    except OSError:
        return None
    total = 0.0
    for line in text.split("\n"):
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return total


def drain(pod: dict, timeout_s: float) -> float | None:
    """Wait (bounded) until the pod runs no request; returns what still runs at the end."""
    ip = (pod.get("status") or {}).get("podIP")
    start = time.monotonic()
    time.sleep(DRAIN_MIN_S)
    running = None
    while ip and time.monotonic() - start < timeout_s:
        running = requests_running(ip)
        if not running:
            return running
        time.sleep(0.5)
    return running
