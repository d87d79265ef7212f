"""spec.gateway.inferencePool against the real control plane: the InferencePool CRD of the
Gateway API Inference Extension (v1) installed on the test bed, a VLMDeployment's pool, and a
pod list with the pool's selector, which is what a gateway's endpoint picker chooses from.

The test bed's apiserver is Kubernetes 1.20: the CRD's two CEL rules (x-kubernetes-validations,
1.25+) and its one empty-string default (which 1.20 reads as null) are stripped there
(vlm_testbed.gateway.install_crd); the unit tests hold rendered pools to the CEL rules instead
(tests/unit/deploy/test_object_schemas.py).
"""

from __future__ import annotations

import time

import pytest
from kube_helpers import (
    condition,
    cr,
    create,
    get_cr,
    health,
    patch_cr,
    pod_gone,
    sim_post,
    wait_for,
    wait_ready_pods,
)
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from vlm_operator.api.names import FENCE, IN_SERVICE_LABEL
from vlm_testbed import gateway

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
PICKER = {"inferencePool": {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}


def get_pool(api, ns, name) -> dict | None:
    try:
        return client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def crd_installed(api) -> bool:
    try:
        client.ApiextensionsV1Api(api).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


@pytest.fixture(scope="module")
def pool_crd(api):
    """The InferencePool CRD for this module's tests, removed afterwards (no other module
    expects it)."""
    stripped = gateway.install_crd(api)
    assert stripped, "the test bed's apiserver is 1.20: without the CEL rules (1.25+)"
    yield
    client.ApiextensionsV1Api(api).delete_custom_resource_definition(f"{PLURAL}.{GROUP}")
    wait_for("InferencePool CRD removed", lambda: not crd_installed(api))


def pool_selector(api, ns, name) -> str:
    pool = wait_for(f"InferencePool {name}", lambda: get_pool(api, ns, name))
    return ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())


def in_pool(api, ns, selector) -> dict[str, object]:
    """The pods a picker chooses from: listed with the pool's selector, by name."""
    return {p.metadata.name: p for p in client.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector=selector).items}


def test_without_the_crd_degraded_says_so_and_the_pool_comes_once_it_is_served(api, ns):
    if crd_installed(api):
        pytest.fail("the InferencePool CRD is already installed: this test needs a control "
                    "plane without it (no other module installs it)")
    create(api, ns, cr("gw", replicas=0, gateway=PICKER))
    degraded = wait_for("Degraded: InferencePoolUnavailable", lambda: (
        c := condition(get_cr(api, ns, "gw"), "Degraded")) and
        c["reason"] == "InferencePoolUnavailable" and c)
    assert degraded["status"] == "True"
    assert degraded["message"] == (
        "spec.gateway.inferencePool: the cluster does not serve inference.networking.k8s.io/v1 "
        "InferencePools: install the Gateway API Inference Extension's CRD (the pool is made "
        "once it is served)")
    # nothing else breaks: the other children are there
    assert client.CoreV1Api(api).read_namespaced_service("gw", ns)
    assert client.AppsV1Api(api).read_namespaced_deployment("gw", ns)

    assert gateway.install_crd(api)
    patch_cr(api, ns, "gw", {"rendererNumWorkers": 2})  # any change reconciles
    pool = wait_for("the pool made once the CRD is served", lambda: get_pool(api, ns, "gw"))
    owner = get_cr(api, ns, "gw")["metadata"]["uid"]
    assert [(r["kind"], r["uid"], r["controller"]) for r in pool["metadata"][
        "ownerReferences"]] == [("VLMDeployment", owner, True)]
    service = client.CoreV1Api(api).read_namespaced_service("gw", ns)
    assert pool["spec"]["selector"]["matchLabels"] == service.spec.selector
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    wait_for("Degraded cleared", lambda: condition(get_cr(api, ns, "gw"), "Degraded")[
        "reason"] != "InferencePoolUnavailable")

    # a spec that no longer asks for a pool loses ours
    patch_cr(api, ns, "gw", {"gateway": None})
    wait_for("the pool deleted", lambda: get_pool(api, ns, "gw") is None)


def test_a_pool_of_that_name_another_controller_owns_is_left_alone(api, ns, pool_crd):
    theirs = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferencePool",
              "metadata": {"name": "taken", "namespace": ns},
              "spec": {"selector": {"matchLabels": {"app": "theirs"}},
                       "targetPorts": [{"number": 9000}],
                       "endpointPickerRef": {"name": "their-epp", "port": {"number": 9002}}}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL,
                                                                 theirs)
    create(api, ns, cr("taken", replicas=0, gateway=PICKER))
    degraded = wait_for("ObjectNotOwned", lambda: (c := condition(
        get_cr(api, ns, "taken"), "Degraded")) and c["reason"] == "ObjectNotOwned" and c)
    assert "InferencePool taken" in degraded["message"]
    pool = get_pool(api, ns, "taken")
    assert pool["spec"]["selector"] == {"matchLabels": {"app": "theirs"}}
    assert "ownerReferences" not in pool["metadata"]


def leaves_selection(api, ns, stream, name: str):
    """The pod `name` as read right after it left a label-selector watch (DELETED: its labels
    no longer match; the event carries the pod as it was while it still matched)."""
    next(ev for ev in stream if ev["type"] == "DELETED" and ev["object"].metadata.name == name)
    return client.CoreV1Api(api).read_namespaced_pod(name, ns)


def watch_pool(api, ns, name, *pods):
    """The pool's selector once it holds every one of `pods`, and a watch of the pods it
    selects (what a gateway's endpoint picker follows)."""
    selector = pool_selector(api, ns, name)
    wait_for("the pods in the pool", lambda: {p.metadata.name for p in pods} <= set(
        in_pool(api, ns, selector)))
    w = watch.Watch()
    return selector, w, w.stream(client.CoreV1Api(api).list_namespaced_pod, ns,
                                 label_selector=selector, timeout_seconds=60)


def test_a_fenced_pod_leaves_the_pool_at_once_and_comes_back_after_recovering(api, ns, sim,
                                                                           pool_crd):
    create(api, ns, cr("fence", replicas=2, gateway=PICKER, health={
        "recovery": "InPlace", "maxRestartsPerHour": 20, "minAvailable": 1}))
    a, b = wait_ready_pods(api, ns, "fence", 2)
    selector, w, stream = watch_pool(api, ns, "fence", a, b)
    assert IN_SERVICE_LABEL + "=true" in selector
    died = time.monotonic()
    # the engine dies; the process stays up 5 s more, as vLLM's does while it shuts down
    sim_post(a.status.pod_ip, "/sim/fault", {"fault": "engine_dead", "exit_delay": 5})
    left = leaves_selection(api, ns, stream, a.metadata.name)
    took = time.monotonic() - died
    w.stop()
    print(f"fenced pod left the pool's selection {took:.3f} s after the engine died")
    # out of the pool on the log line: the container had not even exited, so no probe and no
    # Ready condition could have said anything yet
    (cs,) = left.status.container_statuses
    assert cs.restart_count == 0 and cs.state.running is not None
    assert FENCE in (left.metadata.annotations or {})
    assert left.metadata.labels[IN_SERVICE_LABEL] == "false"
    assert set(in_pool(api, ns, selector)) == {b.metadata.name}

    def back():
        pod = in_pool(api, ns, selector).get(a.metadata.name)
        return pod and FENCE not in (pod.metadata.annotations or {}) and pod
    pod = wait_for("back in the pool after recovering in place", back, timeout=90)
    assert pod.metadata.uid == a.metadata.uid  # the same pod, restarted in place
    (cs,) = pod.status.container_statuses
    assert cs.restart_count == 1 and cs.ready


def test_a_drained_pod_leaves_the_pool_before_it_is_deleted(api, ns, sim, pool_crd):
    create(api, ns, cr("drain", replicas=2, gateway=PICKER, health=health(
        tokenizerRetry={"threshold": 2, "windowSeconds": 60, "action": "ScaleDown"})))
    a, b = wait_ready_pods(api, ns, "drain", 2)
    selector, w, stream = watch_pool(api, ns, "drain", a, b)
    sim_post(a.status.pod_ip, "/sim/fault", {"fault": "load", "running": 1})  # in flight
    sim_post(a.status.pod_ip, "/sim/fault", {"fault": "tokenizer_retry", "rate": 20,
                                             "count": 2})
    left = leaves_selection(api, ns, stream, a.metadata.name)
    w.stop()
    assert left.metadata.labels[IN_SERVICE_LABEL] == "false"
    assert left.metadata.deletion_timestamp is None
    assert not pod_gone(api, ns, a)  # still draining its request, out of the pool
    assert set(in_pool(api, ns, selector)) == {b.metadata.name}
    sim_post(a.status.pod_ip, "/sim/fault", {"fault": "clear"})
    wait_for("deleted after the drain", lambda: pod_gone(api, ns, a), timeout=30)
