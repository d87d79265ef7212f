"""The InferencePool child (desired/inference_pool.py): what spec.gateway.inferencePool makes."""

from __future__ import annotations

from vlm_operator.api import names
from vlm_operator.api.validation import parse
from vlm_operator.desired import children, inference_pool

PICKER = {"endpointPickerRef": {"name": "qwen-epp", "port": {"number": 9002}}}


def vlmd(**spec):
    return parse({"apiVersion": names.API_VERSION, "kind": names.KIND,
                  "metadata": {"name": "qwen", "namespace": "models", "uid": "u-1"},
                  "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", **spec}})


def test_the_pool_selects_exactly_the_pods_in_service():
    """A fence, a drain or a ScaleDown flips the in-service label: the pool must drop the pod
    exactly when the Service does, so it selects on that label too."""
    d = vlmd(gateway={"inferencePool": PICKER})
    (pool,) = inference_pool.get_gateway_children(d, inference_pools=True)
    service = children.get_service(d)
    assert pool["spec"]["selector"] == {"matchLabels": service["spec"]["selector"]}
    assert pool["spec"]["selector"]["matchLabels"][names.IN_SERVICE_LABEL] == "true"
    assert pool["spec"]["targetPorts"] == [{"number": names.PORT}]


def test_the_pool_names_the_users_picker_and_is_owned_like_the_other_children():
    d = vlmd(gateway={"inferencePool": {"endpointPickerRef": {
        "name": "qwen-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}}})
    (pool,) = inference_pool.get_gateway_children(d, inference_pools=True)
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1",
                                                  "InferencePool")
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "qwen-epp", "port": {"number": 9002},
        "failureMode": "FailOpen"}
    assert pool["metadata"] == children.get_service(d)["metadata"]
    assert children.is_controlled_by(pool, "u-1")


def test_failure_mode_defaults_to_fail_close():
    (pool,) = inference_pool.get_gateway_children(vlmd(gateway={"inferencePool": PICKER}), True)
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"


def test_no_pool_unless_asked_for_and_allowed():
    assert inference_pool.get_gateway_children(vlmd(), inference_pools=True) == []
    assert inference_pool.get_gateway_children(vlmd(gateway={}), inference_pools=True) == []
    assert inference_pool.get_gateway_children(
        vlmd(gateway={"inferencePool": PICKER}), inference_pools=False) == []


def test_a_spec_without_a_pool_wants_ours_gone():
    assert inference_pool.unwanted_pool(vlmd()) == (
        "inference.networking.k8s.io/v1", "InferencePool", "qwen")
    assert inference_pool.unwanted_pool(vlmd(gateway={"inferencePool": PICKER})) is None


def test_the_cluster_is_asked_only_when_the_answer_matters():
    wants, plain = vlmd(gateway={"inferencePool": PICKER}), vlmd()
    assert inference_pool.asks_cluster(wants, managed=True, drift=True)
    assert inference_pool.asks_cluster(plain, managed=True, drift=False)  # may have dropped one
    assert not inference_pool.asks_cluster(plain, managed=True, drift=True)
    assert not inference_pool.asks_cluster(wants, managed=False, drift=False)


def test_the_plan_names_what_is_missing_for_a_spec_that_wants_a_pool():
    wants, plain = vlmd(gateway={"inferencePool": PICKER}), vlmd()
    assert inference_pool.get_pool_plan(wants, managed=True, served=True) == (True, [])
    assert inference_pool.get_pool_plan(plain, managed=True, served=True) == (True, [])
    assert inference_pool.get_pool_plan(plain, managed=False, served=False) == (False, [])
    for managed, missing in ((False, "rbac.inferencePools"),
                             (True, "does not serve inference.networking.k8s.io/v1")):
        pools, (report,) = inference_pool.get_pool_plan(wants, managed=managed, served=False)
        assert not pools
        assert (report.type, report.status, report.reason) == (
            "Degraded", "True", "InferencePoolUnavailable")
        assert report.message.startswith("spec.gateway.inferencePool: ")
        assert missing in report.message
