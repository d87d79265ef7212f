"""The reconciler and spec.gateway.inferencePool (unit fakes for the apiserver): the pool is
applied only where this installation manages InferencePools and the cluster serves them;
otherwise Degraded says which, and the other children are applied all the same."""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

from vlm_operator.reconcile.reconciler import Reconciler

from ..fakes import NAMESPACE, ChildStore

PICKER = {"inferencePool": {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}


def pass_over(kube: ChildStore, *, installed: bool = True, first_look: bool = True,
              **spec) -> dict:
    body = kube.add_vlmd(NAMESPACE, "vl", replicas=0, **spec)
    body["metadata"]["generation"] = 1
    if not first_look:
        body["status"]["observedGeneration"] = 1
    Reconciler(kube, inference_pools=installed).reconcile(NAMESPACE, "vl")
    return kube.vlmds[(NAMESPACE, "vl")]["status"]


def degraded(status: dict) -> tuple[str, str, str]:
    (c,) = [c for c in status["conditions"] if c["type"] == "Degraded"]
    return c["status"], c["reason"], c["message"]


def applied(kube: ChildStore) -> list[str]:
    return [c[1] for c in kube.calls if c[0] == "apply"]


def test_a_served_pool_is_applied_after_the_other_children():
    kube = ChildStore()
    status = pass_over(kube, gateway=PICKER)
    assert applied(kube) == ["Deployment", "Service", "PodDisruptionBudget", "InferencePool"]
    assert degraded(status)[0] == "False"


def test_an_installation_without_inference_pools_says_so_and_never_asks_the_cluster():
    kube = ChildStore()
    status = pass_over(kube, installed=False, gateway=PICKER)
    assert "InferencePool" not in applied(kube) and "Service" in applied(kube)
    assert ("discovery", "inferencepools") not in kube.calls
    assert degraded(status) == (
        "True", "InferencePoolUnavailable",
        "spec.gateway.inferencePool: this installation does not manage InferencePools (chart "
        "value rbac.inferencePools, flag --inference-pools); no pool was made")


def test_a_cluster_without_the_crd_is_degraded_and_the_rest_applied():
    kube = ChildStore(pools_served=False)
    status = pass_over(kube, gateway=PICKER)
    assert applied(kube) == ["Deployment", "Service", "PodDisruptionBudget"]
    assert degraded(status) == (
        "True", "InferencePoolUnavailable",
        "spec.gateway.inferencePool: the cluster does not serve inference.networking.k8s.io/v1 "
        "InferencePools: install the Gateway API Inference Extension's CRD (the pool is made "
        "once it is served)")


def test_discovery_that_fails_is_an_apply_failure_not_a_missing_crd():
    kube = ChildStore(pools_served=None)
    try:
        pass_over(kube, gateway=PICKER)
    except ApiException as exc:  # a 503 is retried by the caller
        assert exc.status == 503
    status = kube.vlmds[(NAMESPACE, "vl")]["status"]
    assert applied(kube) == ["Deployment", "Service", "PodDisruptionBudget"]
    assert degraded(status) == ("True", "ApplyFailed",
                                "InferencePool vl: 503 Service Unavailable")


def test_a_pool_of_that_name_another_controller_owns_is_never_written():
    kube = ChildStore()
    theirs = {"kind": "InferencePool", "metadata": {"name": "vl", "namespace": NAMESPACE,
                                                    "ownerReferences": []}}
    kube.children[("InferencePool", "vl")] = theirs
    status = pass_over(kube, gateway=PICKER)
    assert "InferencePool" not in applied(kube)
    assert kube.children[("InferencePool", "vl")] == theirs
    assert degraded(status)[:2] == ("True", "ObjectNotOwned")
    assert "InferencePool vl" in degraded(status)[2]


def test_a_spec_that_drops_its_pool_deletes_ours_and_only_ours():
    kube = ChildStore()
    ours = {"kind": "InferencePool", "metadata": {"name": "vl", "uid": "p1", "ownerReferences": [
        {"kind": "VLMDeployment", "name": "vl", "uid": "uid-vl", "controller": True}]}}
    kube.children[("InferencePool", "vl")] = ours
    pass_over(kube)
    assert ("InferencePool", "vl") not in kube.children

    kube = ChildStore()
    theirs = {"kind": "InferencePool", "metadata": {"name": "vl", "uid": "p2"}}
    kube.children[("InferencePool", "vl")] = theirs
    pass_over(kube)
    assert kube.children[("InferencePool", "vl")] == theirs


def test_a_resync_of_a_spec_without_a_pool_costs_no_request_for_pools():
    kube = ChildStore()
    pass_over(kube, first_look=False)
    assert not [c for c in kube.calls if "inferencepools" in c or "InferencePool" in c]
