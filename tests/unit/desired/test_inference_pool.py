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
