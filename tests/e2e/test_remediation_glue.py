"""The glue between remediation's pure decisions and its actions, in-process against the real
apiserver: the Remediator, a log Follower and the Reconciler on bare pods (no kubelet, no
operator process; a pod's readiness and IP are written through pods/status, and /metrics is
served by a small local server where a test needs one). Each test pins down a way the glue
once lost or doubled an action."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
import uuid

import pytest
from kube_helpers import events, wait_for
from kubernetes import client

from vlm_operator.api import crd
from vlm_operator.api.actions import Action
from vlm_operator.api.names import DRAIN_SINCE, IN_FLIGHT
from vlm_operator.autoscaling.autoscaler import put_out_of_service
from vlm_operator.desired import children
from vlm_operator.k8s.kube import Kube
from vlm_operator.logs.followers import Followers
from vlm_operator.logs.watcher import LogWatch
from vlm_operator.reconcile.reconciler import Reconciler
from vlm_operator.remediation import incidents
from vlm_operator.remediation.incidents import Incident, InFlight
from vlm_operator.remediation.remediator import Remediator

SLOW = {"health": {"tokenizerRetry": {"threshold": 1, "windowSeconds": 60,
                                      "action": "ScaleDown"}}}


class BareKube(Kube):
    """The pods here are bare (no ReplicaSet or Deployment owns them): the owner-chain check
    (Kube.owned_pods, tests/unit/k8s/test_kube.py) is left out, every labelled pod is taken."""

    def owned_pods(self, pods):
        return pods


@pytest.fixture
def kube(api):
    return BareKube(api)


@pytest.fixture
def made(kube):
    """Remediators and watches made by a test, stopped afterwards."""
    out = []
    yield out
    for thing in out:
        thing.stop()


def vlmd(api, ns, name="glue", replicas=2, **spec):
    body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
            "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2", "replicas": replicas,
                     **spec}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        crd.GROUP, crd.VERSION, ns, crd.PLURAL, body)
    return name


def get(kube, ns, name="glue"):
    return kube.get_vlmd(ns, name)


def pod(api, ns, name, owner="glue", ready=True, ip=None):
    """A bare managed pod no scheduler takes (schedulerName none), made Ready by hand."""
    core = client.CoreV1Api(api)
    created = core.create_namespaced_pod(ns, {"metadata": {
        "name": name, "labels": children.get_labels(owner)}, "spec": {
        "schedulerName": "none", "containers": [{"name": children.CONTAINER, "image": "x"}]}})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {"phase": "Running", "podIP": ip or "127.0.0.1", "conditions": [
        {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now}],
        "containerStatuses": [{"name": children.CONTAINER, "ready": ready, "restartCount": 0,
                               "image": "x", "imageID": "", "state": {"running": {}}}]}
    core.patch_namespaced_pod_status(name, ns, {"status": status})
    return created.metadata.uid


def set_unschedulable(api, ns, name, seconds_ago):
    """The scheduler's verdict on a pod no node takes, written as it writes it."""
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - seconds_ago))
    client.CoreV1Api(api).patch_namespaced_pod_status(name, ns, {"status": {
        "phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "lastTransitionTime": since}]}})


def in_service(api, ns, name):
    return client.CoreV1Api(api).read_namespaced_pod(name, ns).metadata.labels.get(
        children.IN_SERVICE_LABEL)


def set_ready(api, ns, name, ready):
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    client.CoreV1Api(api).patch_namespaced_pod_status(name, ns, {"status": {"conditions": [
        {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now}]}})


def pod_names(api, ns):
    return sorted(p.metadata.name for p in client.CoreV1Api(api).list_namespaced_pod(ns).items
                  if p.metadata.deletion_timestamp is None)


def storm(uid, pod_name, t=None):
    t = t or time.time()
    return Incident(uid, pod_name, "tokenizerRetry", "tokenizer_retry", t - 1, t, 5)


class MetricsServer:
    """/metrics on a pod's loopback IP: `running` requests in flight, or answering `delay` late."""

    def __init__(self, running=0.0, delay=0.0):
        self.ip = f"127.77.{uuid.uuid4().int % 200 + 1}.{uuid.uuid4().int % 200 + 2}"
        self.running, self.delay = running, delay
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                """quiet"""

            def do_GET(self):
                time.sleep(server.delay)
                body = (f'vllm:num_requests_running{{engine="0"}} {server.running}\n'
                        'vllm:num_requests_waiting{engine="0"} 0\n').encode()
                with contextlib.suppress(OSError):  # the reader may have timed out
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer((self.ip, children.PORT), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def metrics_server():
    servers = []

    def make(**kw):
        servers.append(MetricsServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def test_history_counts_each_restart_once_across_processes(api, kube, namespace, made):
    """Three restarts are three, in memory, in the annotation and for a fresh process."""
    vlmd(api, namespace, health={"maxRestartsPerHour": 4})
    first = Remediator(kube, lambda ns, name: None)
    made.append(first)
    first.refresh(namespace, "glue")
    owner = first.owner(namespace, "glue")
    for _ in range(3):
        first._record(owner, namespace, "glue")
        first.refresh(namespace, "glue")  # reads the annotation back into memory
    assert len(owner.history) == 3
    assert len(incidents.parse_history(
        get(kube, namespace)["metadata"]["annotations"][incidents.HISTORY])) == 3
    assert not [r for r in first.reports(namespace, "glue") if r.type == "Degraded"]
    second = Remediator(kube, lambda ns, name: None)
    made.append(second)
    second.refresh(namespace, "glue")
    assert len(second.owner(namespace, "glue").history) == 3
    first._record(owner, namespace, "glue")  # the 4th spends the budget of 4
    (degraded,) = [r for r in first.reports(namespace, "glue") if r.type == "Degraded"]
    assert degraded.reason == "RestartBudgetExhausted"


def test_a_drain_waits_out_unreadable_metrics(api, kube, namespace, made, metrics_server):
    """A pod whose /metrics times out is not drained: it is deleted at the drain limit
    (with a DrainTimedOut Event), and only then are the replicas lowered."""
    vlmd(api, namespace, replicas=2, **SLOW)
    slow = metrics_server(running=0, delay=30)
    sick = pod(api, namespace, "sick", ip=slow.ip)
    pod(api, namespace, "fine")
    rem = Remediator(kube, lambda ns, name: None, drain_timeout_s=8).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    record = incidents.parse_in_flight(get(kube, namespace)["metadata"]["annotations"])[sick]
    assert record.action == Action.SCALE_DOWN and record.replicas == 2
    core = client.CoreV1Api(api)
    assert core.read_namespaced_pod("sick", namespace).metadata.labels[
        children.IN_SERVICE_LABEL] == "false"
    time.sleep(4)  # past DRAIN_MIN_S, several steps with the scrape timing out
    assert "sick" in pod_names(api, namespace), "deleted while its load was unknown"
    wait_for("deleted at the drain limit", lambda: "sick" not in pod_names(api, namespace),
             timeout=30)
    wait_for("replicas lowered", lambda: get(kube, namespace)["spec"]["replicas"] == 1)
    wait_for("record removed", lambda: IN_FLIGHT not in (
        get(kube, namespace)["metadata"].get("annotations") or {}))
    assert events(api, namespace, "glue", "DrainTimedOut")
    assert pod_names(api, namespace) == ["fine"]


def test_a_drained_pod_goes_at_once(api, kube, namespace, made, metrics_server):
    vlmd(api, namespace, replicas=2, **SLOW)
    idle = metrics_server(running=0)
    sick = pod(api, namespace, "sick", ip=idle.ip)
    pod(api, namespace, "fine")
    rem = Remediator(kube, lambda ns, name: None, drain_timeout_s=300).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    wait_for("deleted when drained", lambda: "sick" not in pod_names(api, namespace),
             timeout=30)
    wait_for("replicas lowered", lambda: get(kube, namespace)["spec"]["replicas"] == 1)
    assert not events(api, namespace, "glue", "DrainTimedOut")


@pytest.mark.parametrize("pod_left", [True, False])
def test_a_fresh_process_finishes_a_drain_another_began(api, kube, namespace, made,
                                                        metrics_server, pod_left):
    """The first operator recorded the ScaleDown and died; a fresh one finishes it from the
    cluster alone: the pod goes (if still there), the replicas are lowered once."""
    vlmd(api, namespace, replicas=3, **SLOW)
    idle = metrics_server(running=0)
    sick = pod(api, namespace, "sick", ip=idle.ip) if pod_left else "uid-gone"
    pod(api, namespace, "fine")
    record = InFlight(Action.SCALE_DOWN, "sick", sick, "tokenizer_retry", time.time() - 5,
                      time.time() - 5, 3)
    kube.patch_vlmd_annotations(namespace, "glue", {IN_FLIGHT: incidents.in_flight_value(
        {sick: record})})
    fresh = Remediator(kube, lambda ns, name: None).start()
    made.append(fresh)
    fresh.refresh(namespace, "glue")  # what the resume handler does at start
    wait_for("finished", lambda: IN_FLIGHT not in (
        get(kube, namespace)["metadata"].get("annotations") or {}), timeout=30)
    assert pod_names(api, namespace) == ["fine"]
    assert get(kube, namespace)["spec"]["replicas"] == 2
    # a record whose replica step already happened (spec no longer the count it began with)
    # is closed without lowering again
    kube.patch_vlmd_annotations(namespace, "glue", {IN_FLIGHT: incidents.in_flight_value(
        {"uid-x": InFlight(Action.SCALE_DOWN, "x", "uid-x", "s", 1.0, time.time(), 3)})})
    again = Remediator(kube, lambda ns, name: None).start()
    made.append(again)
    again.refresh(namespace, "glue")
    wait_for("closed", lambda: IN_FLIGHT not in (
        get(kube, namespace)["metadata"].get("annotations") or {}), timeout=30)
    assert get(kube, namespace)["spec"]["replicas"] == 2


def test_the_last_serving_replica_is_replaced_not_removed(api, kube, namespace, made,
                                                          metrics_server):
    """With the default spec (1 replica, minAvailable 1): surge, drain (here idle), delete."""
    vlmd(api, namespace, replicas=1)
    idle = metrics_server(running=0)  # a pod that cannot be read would wait the drain out
    sick = pod(api, namespace, "sick", ip=idle.ip)
    published = []
    rem = Remediator(kube, lambda ns, name: published.append(name),
                     replica_fits=lambda vlmd, pending=0: True).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    body = get(kube, namespace)
    assert incidents.surge(body["metadata"]["annotations"]) == 1
    assert body["status"]["lastRemediation"]["action"] == Action.REPLACE
    assert published, "status was not refreshed: the Deployment would not surge"
    (report,) = [r for r in rem.reports(namespace, "glue") if r.type == "Remediating"]
    assert (report.status, report.reason) == ("True", "ReplacingPod")
    time.sleep(2)
    assert "sick" in pod_names(api, namespace), "removed before a replacement was ready"
    pod(api, namespace, "replacement", ready=False)
    time.sleep(2)
    assert "sick" in pod_names(api, namespace)
    set_ready(api, namespace, "replacement", True)
    wait_for("sick pod removed", lambda: pod_names(api, namespace) == ["replacement"],
             timeout=30)
    wait_for("surge over", lambda: incidents.surge(
        get(kube, namespace)["metadata"].get("annotations")) == 0)
    assert events(api, namespace, "glue", "PodReplacing")
    assert events(api, namespace, "glue", "PodReplaced")
    (report,) = [r for r in rem.reports(namespace, "glue") if r.type == "Remediating"]
    assert report.status == "False"


def test_a_replacement_that_never_comes_is_given_up(api, kube, namespace, made):
    vlmd(api, namespace, replicas=1)
    sick = pod(api, namespace, "sick")
    rem = Remediator(kube, lambda ns, name: None, replica_fits=lambda vlmd, pending=0: True,
                     replace_timeout_s=3).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    wait_for("given up", lambda: events(api, namespace, "glue", "ReplaceFailed"), timeout=30)
    assert incidents.surge(get(kube, namespace)["metadata"].get("annotations")) == 0
    assert pod_names(api, namespace) == ["sick"]  # it keeps serving
    assert rem.owner(namespace, "glue").backoff[sick][0] == 1


def test_a_held_incident_is_acted_on_when_capacity_returns(api, kube, namespace, made):
    """Held by minAvailable with no GPU free, with a condition that says so; acted on as
    soon as another pod is ready, without a new log line."""
    vlmd(api, namespace, replicas=2)
    sick = pod(api, namespace, "sick")
    pod(api, namespace, "other", ready=False)
    rem = Remediator(kube, lambda ns, name: None,
                     replica_fits=lambda vlmd, pending=0: False).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    (report,) = [r for r in rem.reports(namespace, "glue") if r.type == "Remediating"]
    assert (report.status, report.reason) == ("True", "WaitingForCapacity")
    assert "no GPU is free" in report.message
    assert get(kube, namespace)["status"]["lastRemediation"]["action"] == "Skipped"
    assert "sick" in pod_names(api, namespace)
    set_ready(api, namespace, "other", True)
    rem.wake()
    wait_for("restarted once capacity returned", lambda: "sick" not in pod_names(
        api, namespace), timeout=15)
    assert len(events(api, namespace, "glue", "RemediationSkipped")) == 1
    assert len(events(api, namespace, "glue", "PodRestarted")) == 1


def test_a_held_incident_expires_with_its_window(api, kube, namespace, made):
    """Held past its window, it is dropped, never acted on late."""
    vlmd(api, namespace, replicas=1, health={"tokenizerRetry": {"windowSeconds": 3}})
    sick = pod(api, namespace, "sick")
    rem = Remediator(kube, lambda ns, name: None,
                     replica_fits=lambda vlmd, pending=0: False).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    assert rem.owner(namespace, "glue").open
    wait_for("expired", lambda: not rem.owner(namespace, "glue").open, timeout=20)
    (report,) = [r for r in rem.reports(namespace, "glue") if r.type == "Remediating"]
    assert report.status == "False"
    assert pod_names(api, namespace) == ["sick"]


def test_a_paused_replica_leaves_incidents_and_lets_them_expire(api, kube, namespace, made):
    """A standby that kopf's peering paused counts the incident once (peer_active), never
    acts, and drops it with its window instead of re-checking it for ever."""
    vlmd(api, namespace, replicas=2, health={"tokenizerRetry": {"windowSeconds": 3}})
    sick = pod(api, namespace, "sick")
    pod(api, namespace, "other")
    rem = Remediator(kube, lambda ns, name: None, may_act=lambda ns: False).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    owner = rem.owner(namespace, "glue")
    assert owner.open and [m for m in owner.told if m[2] == "peer_active"]
    wait_for("expired on the standby", lambda: not owner.open and not owner.told, timeout=20)
    assert pod_names(api, namespace) == ["other", "sick"]


def test_a_follower_of_a_deleted_pod_removes_itself(api, kube, namespace):
    """A follower that finds its pod gone leaves the watch (it stayed registered)."""
    followers = Followers()
    watch = LogWatch(kube, lambda ns, name: None, Remediator(kube, lambda ns, name: None),
                     followers)
    try:
        pod(api, namespace, "short")
        body = kube.get("v1", "Pod", namespace, "short")
        watch.observe(body, deleted=False)
        assert len(followers.by_uid) == 1
        client.CoreV1Api(api).delete_namespaced_pod("short", namespace)
        wait_for("follower gone", lambda: not followers.by_uid, timeout=30)
    finally:
        watch.stop()


def test_stale_autoscaler_drains_are_put_back(api, kube, namespace):
    """A pod the Builtin autoscaler was draining when autoscaling was turned off goes back
    into the Service; one that log watching is removing is left alone."""
    vlmd(api, namespace, replicas=2, autoscaling={"enabled": False})
    pod(api, namespace, "drained")
    pod(api, namespace, "removed")
    put_out_of_service(kube, namespace, "drained", time.time())
    kube.patch_pod(namespace, "removed", labels={children.IN_SERVICE_LABEL: "false"})
    Reconciler(kube).reconcile(namespace, "glue")
    core = client.CoreV1Api(api)
    back = core.read_namespaced_pod("drained", namespace).metadata
    assert back.labels[children.IN_SERVICE_LABEL] == "true"
    assert DRAIN_SINCE not in (back.annotations or {})
    assert core.read_namespaced_pod("removed", namespace).metadata.labels[
        children.IN_SERVICE_LABEL] == "false"
    assert events(api, namespace, "glue", "DrainCancelled")


def test_a_failing_apply_shows_in_status_and_events(api, kube, namespace):
    """A child the apiserver refuses (here an invalid affinity) does not freeze status:
    Degraded=ApplyFailed with the apiserver's message, an Event, and the other children are
    still applied; fixing the spec clears it."""
    bad = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Bogus"}]}]}}}
    vlmd(api, namespace, replicas=1, scheduling={"affinity": bad})
    reconciler = Reconciler(kube)
    reconciler.reconcile(namespace, "glue")
    body = get(kube, namespace)
    degraded = next(c for c in body["status"]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    assert degraded["message"].startswith("Deployment glue: 422") and "Bogus" in \
        degraded["message"]
    assert events(api, namespace, "glue", "ApplyFailed")
    assert kube.get("v1", "Service", namespace, "glue") is not None
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "glue",
        {"spec": {"scheduling": {"affinity": None}}})
    reconciler.reconcile(namespace, "glue")
    degraded = next(c for c in get(kube, namespace)["status"]["conditions"]
                    if c["type"] == "Degraded")
    assert degraded["status"] == "False"
    assert kube.get("apps/v1", "Deployment", namespace, "glue") is not None



def test_a_replace_drains_its_pod_before_deleting_it(api, kube, namespace, made,
                                                     metrics_server):
    """The sick pod still serves: once its replacement is ready it leaves the Service, and it
    is deleted only when its requests in flight finished."""
    vlmd(api, namespace, replicas=1)
    busy = metrics_server(running=1)
    sick = pod(api, namespace, "sick", ip=busy.ip)
    rem = Remediator(kube, lambda ns, name: None,
                     replica_fits=lambda vlmd, pending=0: True).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    pod(api, namespace, "replacement")
    wait_for("out of the Service", lambda: in_service(api, namespace, "sick") == "false",
             timeout=15)
    time.sleep(4)  # past the endpoints' lag: only the request in flight holds it
    assert "sick" in pod_names(api, namespace), "deleted with a request in flight"
    busy.running = 0
    wait_for("deleted once drained", lambda: "sick" not in pod_names(api, namespace),
             timeout=15)
    wait_for("surge over", lambda: incidents.surge(
        get(kube, namespace)["metadata"].get("annotations")) == 0)
    assert events(api, namespace, "glue", "PodReplaced")
    assert not events(api, namespace, "glue", "DrainTimedOut")


def test_a_pod_another_drain_took_out_still_drains(api, kube, namespace, made,
                                                   metrics_server):
    """A Replace whose pod the Builtin autoscaler took out of the Service meanwhile: the pod
    still serves its requests in flight, so it is not deleted as if it served nothing."""
    vlmd(api, namespace, replicas=1)
    busy = metrics_server(running=1)
    sick = pod(api, namespace, "sick", ip=busy.ip)
    rem = Remediator(kube, lambda ns, name: None,
                     replica_fits=lambda vlmd, pending=0: True).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    put_out_of_service(kube, namespace, "sick", time.time())  # the autoscaler's drain
    time.sleep(4)
    assert "sick" in pod_names(api, namespace), "a draining pod deleted at once"


def test_a_surge_is_abandoned_at_once_when_another_writer_lowers_replicas(api, kube,
                                                                          namespace, made):
    """spec.replicas lowered meanwhile (an HPA, KEDA, a user): the ReplicaSet removes the
    replacement still coming up, so the surge is given up at once and says so, instead of
    waiting for a replacement that never comes."""
    vlmd(api, namespace, replicas=2)
    sick = pod(api, namespace, "sick")
    pod(api, namespace, "other", ready=False)
    rem = Remediator(kube, lambda ns, name: None,
                     replica_fits=lambda vlmd, pending=0: True).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    assert incidents.surge(get(kube, namespace)["metadata"]["annotations"]) == 1
    pod(api, namespace, "replacement", ready=False)
    kube.scale_vlmd(namespace, "glue", 1)
    (abandoned,) = wait_for("abandoned", lambda: events(api, namespace, "glue",
                                                        "ReplaceAbandoned"), timeout=15)
    assert "from 2 to 1" in abandoned.message
    assert incidents.surge(get(kube, namespace)["metadata"].get("annotations")) == 0
    assert "sick" in pod_names(api, namespace)  # it keeps serving
    (report,) = [r for r in rem.reports(namespace, "glue") if r.type == "Remediating"]
    assert report.status == "False"


def test_only_its_own_replacement_refused_by_the_scheduler_gives_a_surge_up(api, kube,
                                                                           namespace, made):
    """Another pod of the VLMDeployment unschedulable for long (an over-scale) is not the
    surge's replacement: the surge waits for its own, and gives up when that one is refused
    for UNSCHEDULABLE_S."""
    vlmd(api, namespace, replicas=2)
    sick = pod(api, namespace, "sick")
    pod(api, namespace, "stuck", ready=False)
    set_unschedulable(api, namespace, "stuck", 70)
    rem = Remediator(kube, lambda ns, name: None,
                     replica_fits=lambda vlmd, pending=0: True).start()
    made.append(rem)
    rem.incident(namespace, "glue", storm(sick, "sick"))
    time.sleep(3)
    assert not events(api, namespace, "glue", "ReplaceFailed"), "gave up on another pod"
    assert incidents.surge(get(kube, namespace)["metadata"]["annotations"]) == 1
    pod(api, namespace, "replacement", ready=False)
    set_unschedulable(api, namespace, "replacement", 70)
    wait_for("given up on its own replacement", lambda: events(
        api, namespace, "glue", "ReplaceFailed"), timeout=15)
    record_gone = incidents.parse_in_flight(get(kube, namespace)["metadata"].get(
        "annotations")) == {}
    assert record_gone and "sick" in pod_names(api, namespace)


def test_a_flood_of_matching_lines_costs_no_api_request_each(api, kube, namespace, made):
    """A pod's log is its tenant's: a tenant's own image can print retry warnings as fast as it
    likes. Every decision reads the VLMDeployment and lists its pods, so a held incident (here
    the restart budget is spent) must not be decided again for each line: 300 lines within a
    second cost a decision or two, and the held incident is still decided again later."""
    from prometheus_client import REGISTRY

    def requests():
        return sum(s.value for m in REGISTRY.collect() if m.name == "vlm_operator_api_requests"
                   for s in m.samples if s.name == "vlm_operator_api_requests_total")

    vlmd(api, namespace, replicas=1, health={"maxRestartsPerHour": 0})
    sick = pod(api, namespace, "sick")
    rem = Remediator(kube, lambda ns, name: None).start()
    made.append(rem)
    rem.refresh(namespace, "glue")
    before = requests()
    for _ in range(300):
        rem.report(namespace, "glue", uid=sick, pod="sick", signature="tokenizer_retry",
                   t=time.time(), count=lambda key, window_s: 10)
    spent = requests() - before
    assert spent <= 12, f"{spent} API requests for 300 lines"
    (report,) = [r for r in rem.reports(namespace, "glue") if r.type == "Remediating"]
    assert (report.status, report.reason) == ("True", "RestartBudgetExhausted")
    assert "sick" in pod_names(api, namespace)
