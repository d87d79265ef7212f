"""Autoscaling against the real apiserver/scheduler/controllers; nodes and vLLM simulated.

Load is set on the vLLM stand-in at podIP:8000 (POST /sim/fault {"fault": "load", ...}), the
Builtin autoscaler scrapes it like a real vLLM's /metrics.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import yaml
from kube_helpers import (
    SESSION_KEDA_PROMETHEUS,
    condition,
    cr,
    create,
    events,
    get_cr,
    metric,
    patch_cr,
    ready_pods,
    sim_post,
    wait_for,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from vlm_operator.desired import children
from vlm_testbed.nodesim import NodeSimulator

DATA = Path(__file__).parent / "data"


def replicas(api, ns, name):
    return get_cr(api, ns, name)["spec"]["replicas"]


def scaling(**kw):
    return {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "target": 5, **kw}


def test_load_scales_up_then_down_after_the_delay(api, ns, cluster, operator):
    with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=4, backoff_base=1.0,
                       name_prefix=f"sim-{ns}"):
        create(api, ns, cr("as-a", autoscaling=scaling(scaleDownDelaySeconds=5)))
        (first,) = wait_for("one ready pod", lambda: ready_pods(api, ns, "as-a"), timeout=90)
        # need: 2.4 replicas
        sim_post(first.status.pod_ip, "/sim/fault", {"fault": "load", "waiting": 12})
        wait_for("scaled up to 3", lambda: replicas(api, ns, "as-a") == 3, timeout=30)
        # the decision goes to status after the replica write: wait for the record
        status = wait_for("the ScaleUp in status", lambda: (
            s := get_cr(api, ns, "as-a").get("status", {}).get("autoscaling", {})).get(
            "desiredReplicas") == 3 and s, timeout=30)
        assert status["reason"].startswith("ScaleUp"), status
        wait_for("3 ready pods", lambda: len(ready_pods(api, ns, "as-a")) == 3, timeout=90)
        sim_post(first.status.pod_ip, "/sim/fault", {"fault": "clear"})
        wait_for("scaled down to 1", lambda: replicas(api, ns, "as-a") == 1, timeout=60)
        # the newest pods went (drained, then deleted); the first one still serves
        left = wait_for("one pod left", lambda: (r := ready_pods(api, ns, "as-a")) and
                        len(client.CoreV1Api(api).list_namespaced_pod(ns).items) == 1 and r,
                        timeout=90)
        assert [p.metadata.name for p in left] == [first.metadata.name]
        assert left[0].metadata.labels[children.IN_SERVICE_LABEL] == "true"
        # status.autoscaling is the last decision: ScaleDown while draining, WithinTarget from
        # the round after the replicas dropped; the operator counted the ScaleDown decisions
        status = wait_for("the decision in status", lambda: (
            s := get_cr(api, ns, "as-a")["status"]["autoscaling"])["desiredReplicas"] == 1
            and s, timeout=30)
        assert status["reason"].startswith(("ScaleDown", "WithinTarget")), status
        assert metric(operator.metrics(), "vlm_operator_autoscaler_decisions_total",
                      vlmdeployment_namespace=ns, vlmdeployment="as-a", reason="ScaleDown") >= 1


def gpu_blocker(api, ns):
    client.CoreV1Api(api).create_namespaced_pod(ns, {
        "metadata": {"name": "blocker"},
        "spec": {"containers": [{"name": "c", "image": "example.org/idle:1",
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                 "terminationGracePeriodSeconds": 1}})


def test_competing_deployments_share_free_gpus_by_priority(api, ns, cluster):
    with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=3, backoff_base=1.0,
                       name_prefix=f"sim-{ns}"):
        gpu_blocker(api, ns)
        create(api, ns, cr("as-high", autoscaling=scaling(priority=10)))
        create(api, ns, cr("as-low", autoscaling=scaling(priority=0)))
        pods = {n: wait_for(f"{n} ready", lambda n=n: ready_pods(api, ns, n), timeout=90)[0]
                for n in ("as-high", "as-low")}
        for pod in pods.values():  # both want 3 replicas; no GPU is free
            sim_post(pod.status.pod_ip, "/sim/fault", {"fault": "load", "waiting": 20})
        for name in ("as-high", "as-low"):
            obj = wait_for(f"{name} ScalingLimited", lambda n=name: (o := get_cr(api, ns, n)) and
                           (c := condition(o, "ScalingLimited")) and c["status"] == "True" and o,
                           timeout=90)
            assert replicas(api, ns, name) == 1
            assert wait_for("ScalingLimited event",
                            lambda n=name: events(api, ns, n, "ScalingLimited"))
        client.CoreV1Api(api).delete_namespaced_pod("blocker", ns)  # one GPU becomes free
        wait_for("high priority takes it", lambda: replicas(api, ns, "as-high") == 2, timeout=60)
        wait_for("its second pod ready", lambda: len(ready_pods(api, ns, "as-high")) == 2,
                 timeout=90)
        time.sleep(3)  # a few more rounds: the low one must not have asked for a pod
        assert replicas(api, ns, "as-low") == 1
        obj = get_cr(api, ns, "as-low")
        assert condition(obj, "ScalingLimited")["status"] == "True"
        assert "fit the free GPUs" in obj["status"]["autoscaling"]["reason"]
        unbound = [p.metadata.name for p in client.CoreV1Api(api).list_namespaced_pod(ns).items
                   if not p.spec.node_name]
        assert unbound == []


def hpa(api, ns, name):
    """autoscaling/v2beta2 (the client no longer ships that API class: read it generically)."""
    return client.CustomObjectsApi(api).get_namespaced_custom_object(
        "autoscaling", "v2beta2", ns, "horizontalpodautoscalers", name)


def scaled_object(api, ns, name):
    return client.CustomObjectsApi(api).get_namespaced_custom_object(
        "keda.sh", "v1alpha1", ns, "scaledobjects", name)


def gone(fn):
    try:
        fn()
    except ApiException as exc:
        return exc.status == 404
    return False


def test_hpa_and_keda_children(api, ns):
    create(api, ns, cr("as-h", autoscaling=scaling(mode="HPA", maxReplicas=4)))
    h = wait_for("HPA", lambda: hpa(api, ns, "as-h"))
    assert h["spec"]["scaleTargetRef"] == {"apiVersion": "serving.vlm-operator.dev/v1alpha1",
                                           "kind": "VLMDeployment", "name": "as-h"}
    assert h["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert h["spec"]["maxReplicas"] == 4
    assert h["metadata"]["ownerReferences"][0]["name"] == "as-h"

    # a Prometheus of the tenant's choosing is refused: KEDA would query it from its own
    # network position; nothing changes meanwhile
    patch_cr(api, ns, "as-h", {"autoscaling": {
        "mode": "KEDA", "prometheus": {"serverAddress": "http://169.254.169.254/latest"}}})
    refused = wait_for("refused", lambda: (c := condition(get_cr(api, ns, "as-h"), "SpecValid"))
                       and c["status"] == "False" and c)
    assert refused["message"].startswith("spec.autoscaling.prometheus.serverAddress: "
                                         "'http://169.254.169.254/latest' is not a Prometheus")
    assert hpa(api, ns, "as-h")
    # KEDA mode without KEDA: the HPA goes, a condition says why nothing replaces it; the
    # Prometheus is the one the admin configured (conftest: the session operator's flag)
    patch_cr(api, ns, "as-h", {"autoscaling": {"prometheus": {"serverAddress": None}}})
    obj = wait_for("KEDANotInstalled", lambda: (o := get_cr(api, ns, "as-h")) and
                   (c := condition(o, "AutoscalerReady")) and c["reason"] == "KEDANotInstalled"
                   and o)
    assert condition(obj, "AutoscalerReady")["status"] == "False"
    wait_for("HPA deleted", lambda: gone(lambda: hpa(api, ns, "as-h")))

    ext = client.ApiextensionsV1Api(api)
    definition = yaml.safe_load((DATA / "keda-scaledobject-crd.yaml").read_text())
    ext.create_custom_resource_definition(definition)
    try:
        def created():
            # nudge a reconcile (an annotation change) while the operator rechecks discovery
            client.CustomObjectsApi(api).patch_namespaced_custom_object(
                "serving.vlm-operator.dev", "v1alpha1", ns, "vlmdeployments", "as-h",
                {"metadata": {"annotations": {"test/nudge": str(time.monotonic())}}})
            return scaled_object(api, ns, "as-h")
        so = wait_for("ScaledObject", created, timeout=60, interval=2)
        assert so["spec"]["scaleTargetRef"]["kind"] == "VLMDeployment"
        trigger, kv = so["spec"]["triggers"]
        assert trigger["type"] == kv["type"] == "prometheus"
        assert trigger["metadata"]["serverAddress"] == SESSION_KEDA_PROMETHEUS
        assert trigger["metadata"]["query"].startswith("sum(vllm:num_requests_waiting{")
        assert kv["metadata"]["query"].startswith("sum(vllm:kv_cache_usage_perc{")
        wait_for("AutoscalerReady=True", lambda: (c := condition(
            get_cr(api, ns, "as-h"), "AutoscalerReady")) and c["status"] == "True")
        patch_cr(api, ns, "as-h", {"autoscaling": {"enabled": False}})
        wait_for("ScaledObject deleted", lambda: gone(lambda: scaled_object(api, ns, "as-h")))
    finally:
        ext.delete_custom_resource_definition(definition["metadata"]["name"])


def test_a_same_named_hpa_that_is_not_ours_stays(api, ns):
    """Turning autoscaling off deletes only the HPA the VLMDeployment made: one a user (or
    another controller) made under the same name is not the operator's to delete."""
    theirs = client.CustomObjectsApi(api).create_namespaced_custom_object(
        "autoscaling", "v2beta2", ns, "horizontalpodautoscalers", {
            "apiVersion": "autoscaling/v2beta2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "as-u"},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": "as-u"}, "maxReplicas": 2}})
    create(api, ns, cr("as-u", autoscaling=scaling(mode="Builtin")))
    patch_cr(api, ns, "as-u", {"autoscaling": {"enabled": False}})
    wait_for("the disabled spec observed", lambda: (o := get_cr(api, ns, "as-u")) and (
        o.get("status") or {}).get("observedGeneration") == o["metadata"]["generation"])
    assert hpa(api, ns, "as-u")["metadata"]["uid"] == theirs["metadata"]["uid"]
    assert not [e for e in events(api, ns, "as-u") if e.reason == "Deleted"]


def chat_with_images(pod_ip: str, images: int) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, *[image] * images]}]}
    req = urllib.request.Request(f"http://{pod_ip}:{children.PORT}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as rsp:
        assert rsp.status == 200


def test_the_same_queue_scales_further_when_requests_carry_images(api, ns, cluster):
    with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=4, backoff_base=1.0,
                       name_prefix=f"sim-{ns}"):
        create(api, ns, cr("as-mm", autoscaling=scaling(multimodalWeight=1.0)))
        (pod,) = wait_for("one ready pod", lambda: ready_pods(api, ns, "as-mm"), timeout=90)
        ip = pod.status.pod_ip
        # text only: need 1.0
        sim_post(ip, "/sim/fault", {"fault": "load", "waiting": 5, "mm_seconds": 0.01})
        wait_for("a decision on the text-only queue", lambda: (get_cr(api, ns, "as-mm").get(
            "status", {}).get("autoscaling") or {}).get("reason"))
        time.sleep(4)  # several rounds on the same queue: within target
        assert replicas(api, ns, "as-mm") == 1
        for _ in range(10):  # 2 images per request: the queue now weighs 5 * (1 + 2) = 15
            chat_with_images(ip, 2)
        wait_for("scaled up for the images", lambda: replicas(api, ns, "as-mm") >= 3,
                 timeout=30)
        # status.autoscaling is written just after the replicas: wait for that round's record
        wait_for("the ScaleUp decision in status", lambda: get_cr(api, ns, "as-mm")["status"][
            "autoscaling"]["reason"].startswith("ScaleUp"), timeout=5, interval=0.05)


def test_series_go_with_their_vlmdeployment(api, ns, operator):
    """Per-VLMDeployment series of the operator's /metrics are removed when the VLMDeployment
    is deleted: with objects that come and go they would otherwise pile up for ever."""
    from kube_helpers import delete_cr

    def series():
        return [line for line in operator.metrics().splitlines()
                if f'vlmdeployment_namespace="{ns}"' in line and not line.startswith("#")]

    create(api, ns, cr("as-gone", autoscaling=scaling()))  # no node: its pod stays Pending
    wait_for("its autoscaler series", lambda: any(
        "vlm_operator_autoscaler_desired_replicas" in line for line in series()), timeout=30)
    delete_cr(api, ns, "as-gone")
    wait_for("no series left", lambda: not series(), timeout=30)
    time.sleep(3)  # a round still running when it went writes nothing back
    assert series() == []
