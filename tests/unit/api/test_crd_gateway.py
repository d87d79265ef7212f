"""spec.gateway (api/crd_gateway.py): what the schema refuses, naming the field."""

from __future__ import annotations

import pytest

from vlm_operator.api import crd
from vlm_operator.api.validation import validate


def problems(gateway: dict) -> list[str]:
    return validate({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                     "metadata": {"name": "m", "namespace": "n"},
                     "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", "gateway": gateway}})[0]


@pytest.mark.parametrize("gateway, expected", [
    ({"inferencePool": {}}, ["spec.gateway.inferencePool.endpointPickerRef: is required"]),
    ({"inferencePool": {"endpointPickerRef": {"name": "epp"}}},
     ["spec.gateway.inferencePool.endpointPickerRef.port: is required"]),
    ({"inferencePool": {"endpointPickerRef": {"name": "epp", "port": {"number": 0}}}},
     ["spec.gateway.inferencePool.endpointPickerRef.port.number: 0 is less than the minimum "
      "of 1"]),
    ({"inferencePool": {"endpointPickerRef": {"name": "Epp.x", "port": {"number": 9002}}}},
     ["spec.gateway.inferencePool.endpointPickerRef.name: 'Epp.x' does not match "
      "'^[a-z]([-a-z0-9]*[a-z0-9])?$'"]),
    ({"inferencePool": {"endpointPickerRef": {"name": "epp", "port": {"number": 9002},
                                              "failureMode": "Retry"}}},
     ["spec.gateway.inferencePool.endpointPickerRef.failureMode: 'Retry' is not one of "
      "['FailClose', 'FailOpen']"]),
])
def test_bad_gateway_specs_name_the_field(gateway, expected):
    assert problems(gateway) == expected


def test_a_pool_with_a_picker_is_valid_and_read_back():
    pool = {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}
    assert problems({"inferencePool": pool}) == []
    assert crd.inference_pool({"gateway": {"inferencePool": pool}}) == pool
    assert crd.inference_pool({"gateway": {}}) is None
    assert crd.inference_pool({}) is None
