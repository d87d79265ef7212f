"""The operator against a real apiserver, controller-manager and scheduler; only nodes simulated."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from kube_helpers import (
    condition,
    container_args,
    cr,
    create,
    custom,
    delete_cr,
    deployment,
    events,
    get_cr,
    make_namespace,
    patch_cr,
    wait_for,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from vlm_operator.api import crd
from vlm_operator.k8s.kube import Kube
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess


def test_create_builds_owned_children_and_status(api, ns):
    body = create(api, ns, cr("alpha", rendererNumWorkers=3))
    uid = body["metadata"]["uid"]
    dep = wait_for("deployment", lambda: deployment(api, ns, "alpha"))
    args = container_args(dep)
    assert args[0] == "Qwen/Qwen2-VL-2B-Instruct"
    assert args[args.index("--renderer-num-workers") + 1] == "3"
    env = {e.name: e.value for e in dep.spec.template.spec.containers[0].env}
    assert env["VLM_TOKENIZER_POOL_SIZE"] == "4"
    assert dep.spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
    # the children are applied one after another: each is waited for
    svc = wait_for("service", lambda: next(iter(client.CoreV1Api(api).list_namespaced_service(
        ns, field_selector="metadata.name=alpha").items), None))
    kube = Kube(api)
    pdb = wait_for("pdb", lambda: kube.get(kube.pdb_api_version, "PodDisruptionBudget", ns,
                                           "alpha"))
    assert pdb["spec"]["minAvailable"] == 1
    refs = [child.metadata.owner_references for child in (dep, svc)]
    refs.append([client.V1OwnerReference(**{k: v for k, v in r.items() if k in (
        "kind", "name", "uid", "controller", "api_version")}) for r in [
        {**ref, "api_version": ref["apiVersion"]} for ref in pdb["metadata"]["ownerReferences"]]])
    for (ref,) in refs:
        assert (ref.kind, ref.name, ref.uid, ref.controller) == ("VLMDeployment", "alpha", uid,
                                                                 True)
    obj = wait_for("status", lambda: (o := get_cr(api, ns, "alpha")).get("status", {}).get(
        "tokenizerPoolSize") and o)
    assert obj["status"]["tokenizerPoolSize"] == 4
    assert obj["status"]["vllmVersion"] == "0.20.2"
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert obj["status"]["selector"] == (
        "app.kubernetes.io/name=vllm,app.kubernetes.io/instance=alpha,"
        "app.kubernetes.io/component=engine,app.kubernetes.io/managed-by=vlm-operator")
    assert condition(obj, "SpecValid")["status"] == "True"
    assert condition(obj, "Ready")["status"] == "False"  # no node: pods stay Pending
    created = wait_for("Created events", lambda: len(events(api, ns, "alpha", "Created")) >= 3
                       and events(api, ns, "alpha", "Created"))
    assert {e.message for e in created} >= {"Created Deployment alpha", "Created Service alpha",
                                            "Created PodDisruptionBudget alpha"}


def test_update_rolls_the_deployment(api, ns):
    create(api, ns, cr("beta"))
    wait_for("deployment", lambda: deployment(api, ns, "beta"))
    patch_cr(api, ns, "beta", {"rendererNumWorkers": 6, "vllm": {"extraArgs": ["--enforce-eager"]},
                               "replicas": 2})
    dep = wait_for("rolled deployment", lambda: (d := deployment(api, ns, "beta")).spec.replicas
                   == 2 and "--enforce-eager" in container_args(d) and d)
    args = container_args(dep)
    assert args[args.index("--renderer-num-workers") + 1] == "6"
    obj = wait_for("pool size", lambda: (o := get_cr(api, ns, "beta"))["status"].get(
        "tokenizerPoolSize") == 7 and o)
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert wait_for("Updated event", lambda: events(api, ns, "beta", "Updated"))


def test_delete_garbage_collects_children(api, ns):
    create(api, ns, cr("gamma"))
    wait_for("deployment", lambda: deployment(api, ns, "gamma"))
    delete_cr(api, ns, "gamma")
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    wait_for("children gone", lambda: not apps.list_namespaced_deployment(ns).items
             and not core.list_namespaced_service(ns).items, timeout=60)


def test_no_finalizer_so_deleting_never_waits_for_the_operator(api, ns):
    """Autoscaling rounds and the resync run in the operator's own threads: kopf timers and
    daemons would put a finalizer on the VLMDeployment, and deleting it would hang whenever the
    operator is down (kopf adds one before its first handler call, so status means it is
    settled)."""
    create(api, ns, cr("eps", autoscaling={"enabled": True, "mode": "Builtin"}))
    obj = wait_for("status", lambda: (o := get_cr(api, ns, "eps")).get("status", {}).get(
        "observedGeneration") and o)
    assert condition(obj, "SpecValid")["status"] == "True"
    time.sleep(2)
    assert not get_cr(api, ns, "eps")["metadata"].get("finalizers")
    # the finalizer an older operator version (kopf timers) added goes at the next event
    custom = client.CustomObjectsApi(api)
    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, "eps", {
        "metadata": {"finalizers": ["serving.vlm-operator.dev/finalizer"]}})
    wait_for("the old finalizer removed",
             lambda: not get_cr(api, ns, "eps")["metadata"].get("finalizers"), timeout=30)


def test_drift_is_restored(api, ns):
    create(api, ns, cr("delta"))
    wait_for("deployment", lambda: deployment(api, ns, "delta"))
    wait_for("status", lambda: get_cr(api, ns, "delta").get("status", {}).get(
        "observedGeneration"))
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    old_uid = core.read_namespaced_service("delta", ns).metadata.uid
    core.delete_namespaced_service("delta", ns, _preload_content=False)  # 1.20 answers a Status
    svc = wait_for("service recreated", lambda: (s := core.read_namespaced_service("delta", ns))
                   .metadata.uid != old_uid and s)
    assert svc.spec.ports[0].port == 8000
    apps.patch_namespaced_deployment("delta", ns, {"spec": {"replicas": 5, "template": {
        "spec": {"containers": [{"name": "vllm", "args": ["hijacked"]}]}}}})
    wait_for("deployment restored", lambda: (d := deployment(api, ns, "delta")).spec.replicas == 1
             and container_args(d)[0] == "Qwen/Qwen2-VL-2B-Instruct")
    assert wait_for("DriftRestored events", lambda: events(api, ns, "delta", "DriftRestored"))


def test_an_existing_object_of_the_name_is_never_taken_over(api, ns):
    """Another app's Service with the VLMDeployment's name (port http 8000, its own selector):
    a forced server-side apply would rewrite its selector and add our controller reference, and
    the garbage collector would then delete it with the VLMDeployment. It is left as it was,
    Degraded names it, and the other children are still made."""
    core = client.CoreV1Api(api)
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "zeta"},
              "spec": {"selector": {"app": "their-app"},
                       "ports": [{"name": "http", "port": 8000, "targetPort": 8000}]}}
    before = core.create_namespaced_service(ns, theirs)
    create(api, ns, cr("zeta"))
    wait_for("deployment", lambda: deployment(api, ns, "zeta"))
    obj = wait_for("Degraded", lambda: (c := condition(get_cr(api, ns, "zeta"), "Degraded"))
                   and c["status"] == "True" and c)
    assert obj["reason"] == "ObjectNotOwned" and "Service zeta" in obj["message"]
    assert wait_for("Event", lambda: events(api, ns, "zeta", "ObjectNotOwned"))
    svc = core.read_namespaced_service("zeta", ns)
    assert svc.spec.selector == {"app": "their-app"}
    assert svc.metadata.owner_references is None
    assert svc.metadata.resource_version == before.metadata.resource_version
    delete_cr(api, ns, "zeta")
    apps = client.AppsV1Api(api)
    wait_for("our children gone", lambda: not apps.list_namespaced_deployment(ns).items,
             timeout=60)
    svc = core.read_namespaced_service("zeta", ns)
    assert svc.metadata.uid == before.metadata.uid
    assert svc.spec.selector == {"app": "their-app"}


def test_schema_invalid_is_rejected_by_the_apiserver(api, ns):
    with pytest.raises(ApiException) as info:
        create(api, ns, cr("eps", replicas=-1, rendererNumWorkers=99,
                           health={"engineDead": {"action": "Reboot"}}))
    assert info.value.status == 422
    body = info.value.body
    assert "spec.replicas" in body and "spec.rendererNumWorkers" in body
    assert "spec.health.engineDead.action" in body


@pytest.mark.parametrize("metric", [
    'vllm:num_requests_running{namespace="team-b"}) + 0 * sum(vllm:num_requests_running',
    "vllm:num_requests_running\n"])
def test_a_metric_that_is_not_a_metric_name_is_rejected_by_the_apiserver(api, ns, metric):
    """The CRD's pattern holds on the apiserver (RE2: '$' is the end of the text)."""
    with pytest.raises(ApiException) as info:
        create(api, ns, cr("eps-metric", autoscaling={
            "enabled": True, "mode": "KEDA", "metric": metric}))
    assert info.value.status == 422
    assert "spec.autoscaling.metric" in info.value.body


def test_semantic_invalid_sets_condition_and_touches_nothing(api, ns):
    create(api, ns, cr("zeta", gpusPerReplica=1, vllm={"tensorParallelSize": 4}))
    obj = wait_for("SpecValid=False", lambda: (o := get_cr(api, ns, "zeta")) and
                   (c := condition(o, "SpecValid")) and c["status"] == "False" and o)
    assert "spec.vllm.tensorParallelSize: 4 is larger than spec.gpusPerReplica (1)" in \
        condition(obj, "SpecValid")["message"]
    warning = wait_for("InvalidSpec event", lambda: events(api, ns, "zeta", "InvalidSpec"))
    assert warning[0].type == "Warning"
    time.sleep(2)
    assert client.AppsV1Api(api).list_namespaced_deployment(ns).items == []
    patch_cr(api, ns, "zeta", {"gpusPerReplica": 4})
    wait_for("deployment after fix", lambda: deployment(api, ns, "zeta"))
    assert wait_for("SpecFixed event", lambda: events(api, ns, "zeta", "SpecFixed"))


def test_scale_subresource(api, ns, cluster):
    create(api, ns, cr("eta"))
    wait_for("selector", lambda: get_cr(api, ns, "eta").get("status", {}).get("selector"))
    subprocess.run([str(cluster.kubectl), "--kubeconfig", str(cluster.kubeconfig), "-n", ns,
                    "scale", "vlmd", "eta", "--replicas", "3"], check=True, capture_output=True)
    assert get_cr(api, ns, "eta")["spec"]["replicas"] == 3
    wait_for("deployment scaled", lambda: deployment(api, ns, "eta").spec.replicas == 3)
    scale = custom(api).get_namespaced_custom_object_scale(crd.GROUP, crd.VERSION, ns,
                                                           crd.PLURAL, "eta")
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["selector"].startswith("app.kubernetes.io/name=vllm")


def test_ready_with_simulated_gpu_nodes_and_kubectl_columns(api, ns, cluster):
    with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=2, backoff_base=1.0,
                       name_prefix=f"sim-{ns}"):
        create(api, ns, cr("theta", replicas=2, rendererNumWorkers=4))
        obj = wait_for("Ready=True", lambda: (o := get_cr(api, ns, "theta")) and
                       (c := condition(o, "Ready")) and c["status"] == "True" and o, timeout=90)
        assert obj["status"]["readyReplicas"] == 2
        assert condition(obj, "Progressing")["reason"] == "RolloutComplete"
        out = subprocess.run([str(cluster.kubectl), "--kubeconfig", str(cluster.kubeconfig), "-n",
                              ns, "get", "vlmd"], check=True, capture_output=True,
                             text=True).stdout
        header, row = out.splitlines()[:2]
        assert header.split()[:6] == ["NAME", "MODEL", "DESIRED", "READY", "POOL", "VLLM"]
        assert row.split()[:7] == ["theta", "Qwen/Qwen2-VL-2B-Instruct", "2", "2", "5", "0.20.2",
                                   "AllReplicasReady"]
        assert wait_for("Ready event", lambda: events(api, ns, "theta", "AllReplicasReady"))
        delete_cr(api, ns, "theta")
        wait_for("pods gone", lambda: not client.CoreV1Api(api).list_namespaced_pod(ns).items,
                 timeout=90)


# -- operator restarts and replicas: these run their own operators in their own namespaces

def created_events(api, ns, name):
    return sorted(e.message for e in events(api, ns, name, "Created"))


def test_restart_mid_way_resumes_without_duplicate_work(api, cluster):
    ns = make_namespace(api, "e2e-solo-")
    try:
        first = OperatorProcess(cluster.kubeconfig, "-n", ns, "--peering", "solo").start()
        create(api, ns, cr("iota"))
        first.stop()  # possibly before it handled the resource
        create(api, ns, cr("kappa"))  # created while no operator runs
        with OperatorProcess(cluster.kubeconfig, "-n", ns, "--peering", "solo"):
            for name in ("iota", "kappa"):
                wait_for(f"{name} status", lambda n=name: get_cr(api, ns, n).get("status", {}).get(
                    "observedGeneration"))
            before = {n: deployment(api, ns, n).metadata.generation for n in ("iota", "kappa")}
            time.sleep(3)
        with OperatorProcess(cluster.kubeconfig, "-n", ns, "--peering", "solo"):
            time.sleep(5)  # a third start resumes both objects
            for name in ("iota", "kappa"):
                assert created_events(api, ns, name) == [
                    f"Created Deployment {name}", f"Created PodDisruptionBudget {name}",
                    f"Created Service {name}"]
                assert deployment(api, ns, name).metadata.generation == before[name]
    finally:
        client.CoreV1Api(api).delete_namespace(ns)


def test_two_operator_replicas_never_act_twice(api, cluster):
    ns = make_namespace(api, "e2e-solo-")
    try:
        with OperatorProcess(cluster.kubeconfig, "-n", ns, "--peering", "pair",
                             "--priority", "10") as high, \
                OperatorProcess(cluster.kubeconfig, "-n", ns, "--peering", "pair",
                                "--priority", "5") as low:
            wait_for("high replica active", lambda: "Resuming operations" in high.log(),
                     timeout=30)
            for i in range(3):
                create(api, ns, cr(f"pair-{i}"))
            for i in range(3):
                wait_for("status", lambda i=i: get_cr(api, ns, f"pair-{i}").get("status", {}).get(
                    "observedGeneration"))
            time.sleep(3)
            for i in range(3):
                assert len(created_events(api, ns, f"pair-{i}")) == 3
            assert "pair-0" in high.log() and "pair-0" not in low.log()
            assert "Resuming operations" not in low.log()
            high.stop()  # a graceful stop leaves the peering: the other replica takes over
            wait_for("low replica resumes", lambda: "Resuming operations" in low.log(),
                     timeout=60)
            create(api, ns, cr("pair-3"))
            wait_for("handled by the remaining replica",
                     lambda: get_cr(api, ns, "pair-3").get("status", {}).get("observedGeneration"))
            assert len(created_events(api, ns, "pair-3")) == 3
    finally:
        client.CoreV1Api(api).delete_namespace(ns)


def test_a_namespace_created_while_kopf_lists_namespaces_is_watched(api, cluster, tmp_path):
    """A namespace matching -n's pattern, created between kopf's first listing of the
    namespaces and its watch's own (held open here by 3 s; on a loaded machine it opens by
    chance just after the liveness probe answers): kopf alone never watched it, so its
    VLMDeployment got no status (runtime/namespace_discovery.py)."""
    mark = tmp_path / "listing"
    hook = Path(__file__).parent / "data" / "slow_namespace_listing"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
           "VLM_TEST_LISTING_MARK": str(mark), "VLM_TEST_LISTING_DELAY_S": "3"}
    prefix = f"e2e-listed-{time.monotonic_ns() % 10_000:04d}-"
    with OperatorProcess(cluster.kubeconfig, "--standalone", "-n", f"{prefix}*", env=env):
        wait_for("kopf's second listing of the namespaces", mark.exists, timeout=30)
        ns = make_namespace(api, prefix)
        try:
            create(api, ns, cr("listed"))
            wait_for("status", lambda: get_cr(api, ns, "listed").get("status", {}).get(
                "observedGeneration"), timeout=30)
            assert deployment(api, ns, "listed")
        finally:
            client.CoreV1Api(api).delete_namespace(ns)
